"""Errors the worker connector raises for protocol violations.

vLLM 0.33.0's connector signals these with ``assert`` statements; r3capture raises them
explicitly (they survive ``python -O``) as a subclass of ``AssertionError`` so callers that
catch vLLM's errors catch ours, and the differential tests can compare error types.
"""


class AuxOutputProtocolError(AssertionError):
    """The engine drove the connector in a way that would produce wrong rows."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`AuxOutputProtocolError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise AuxOutputProtocolError(message)
