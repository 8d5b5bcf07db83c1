"""Routed experts under prefill/decode disaggregation (P/D): the opt-in mode and the splice.

Under P/D a request's prompt is computed by a prefiller, its KV travels to a decoder, and the
decoder computes the rest. Each instance can only return the routed-expert rows it computed
(or holds), so a router joins the two answers by length: the decoder's rows are the last
ones, the prefiller's fill the rows before them. ``splice`` is that join; it refuses
anything it would have to guess (it never pads).

The mode (``--aux-output-pd {off,splice}``, or ``additional_config["aux_output_pd"]``):

* ``off`` (default): vLLM's own refusal of routed experts with P/D KV connectors stays, and
  nothing is added to the config.
* ``splice``: needs ``--aux-output-backend triton``. vLLM's compatibility check runs with the
  P/D connectors (``PD_CONNECTORS``, directly or as ``MultiConnector`` children) hidden from
  it, so that refusal, and only that one, is lifted; the router splices the rows.

This module imports numpy only, so a router can import ``splice`` without torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

PD_KEY = "aux_output_pd"
PD_MODES = ("off", "splice")
DEFAULT_PD = "off"
PD_FLAG = "--aux-output-pd"
# The connectors vLLM 0.32.x/0.33.x refuse with routed experts ("PD auxiliary output is not
# supported"). Offload connectors and ExampleConnector are not refused, so not listed.
PD_CONNECTORS = (
    "NixlConnector",
    "NixlPullConnector",
    "NixlPushConnector",
    "MoRIIOConnector",
    "MooncakeConnector",
)
_NEEDED_BACKEND = "triton"


# ---------------------------------------------------------------- the mode
def selected_pd(vllm_config: Any) -> Any:
    """The P/D mode a ``VllmConfig`` selects (``"off"`` when none is set; unvalidated)."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict):
        return DEFAULT_PD
    return additional.get(PD_KEY, DEFAULT_PD)


def check_pd(vllm_config: Any, backend: str) -> str:
    """Validate the P/D mode of a ``VllmConfig`` whose aux-output backend is ``backend``.

    Returns the mode. Raises ``ValueError`` for an unknown mode, or for ``splice`` with any
    backend but ``triton``.
    """
    mode = selected_pd(vllm_config)
    if mode not in PD_MODES:
        raise ValueError(
            f"{PD_KEY}={mode!r} is not one of {PD_MODES} "
            f"(set by {PD_FLAG} or additional_config[{PD_KEY!r}])"
        )
    if mode == "splice" and backend != _NEEDED_BACKEND:
        raise ValueError(
            f"{PD_FLAG} splice needs --aux-output-backend {_NEEDED_BACKEND} (the selected "
            f"backend is {backend!r}); vLLM's own backend keeps its refusal of P/D connectors"
        )
    return mode


# ---------------------------------------------------------------- the lifted refusal
class _KVTransferWithoutPD:
    """A read-only view of a ``KVTransferConfig`` on which ``has_connector`` is False for
    the P/D connectors (direct or MultiConnector children) and vLLM's answer otherwise."""

    def __init__(self, kv_transfer_config: Any) -> None:
        self._kv_transfer_config = kv_transfer_config

    def has_connector(self, connector_name: str) -> bool:
        if connector_name in PD_CONNECTORS:
            return False
        return self._kv_transfer_config.has_connector(connector_name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv_transfer_config, name)


class _ConfigWithoutPD:
    """A read-only view of a ``VllmConfig`` whose KV transfer config hides the P/D
    connectors, so vLLM's other routed-experts checks still run on it unchanged."""

    def __init__(self, vllm_config: Any) -> None:
        self._vllm_config = vllm_config

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._vllm_config, name)
        if name == "kv_transfer_config" and value is not None:
            return _KVTransferWithoutPD(value)
        return value


def verify_without_pd_refusal(original_verify: Callable[[Any], None], vllm_config: Any) -> None:
    """Run vLLM's routed-experts compatibility check with the P/D connectors hidden (every
    other refusal still applies)."""
    original_verify(_ConfigWithoutPD(vllm_config))


# ---------------------------------------------------------------- the splice
def _check_rows(name: str, rows: Any) -> np.ndarray:
    if rows is None:
        raise ValueError(f"{name} is missing (None): no rows to splice")
    if not isinstance(rows, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(rows).__name__}")
    if rows.ndim != 3:
        raise ValueError(f"{name} must be [n, L, K] (3 dims), got shape {rows.shape}")
    if not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"{name} must hold integer expert ids, got dtype {rows.dtype}")
    return rows


def splice(prefill_rows: np.ndarray, decode_rows: np.ndarray, num_tokens: int) -> np.ndarray:
    """Join a prefiller's and a decoder's routed-expert rows into one request's rows.

    Args:
        prefill_rows: ``[Np, L, K]`` integer expert ids (``uint8``/``uint16`` from vLLM)
            returned by the prefiller, from token 0 on.
        decode_rows: ``[Nd, L, K]``, same dtype: the decoder's rows, which end at the
            request's last row (token ``num_tokens - 2``).
        num_tokens: the request's tokens, prompt plus output (``>= 1``).

    Returns:
        A new ``[num_tokens - 1, L, K]`` array of the same dtype: rows ``[0, start)`` are
        ``prefill_rows[:start]`` and rows ``[start, num_tokens - 1)`` are ``decode_rows``,
        where ``start = num_tokens - 1 - Nd``. Prefill rows past ``start`` (the positions
        the decoder recomputed) are not used.

    Raises:
        ValueError: naming what is wrong: missing (``None``) or non-array rows, rows that
            are not 3-D or not integers, an ``(L, K)`` or dtype mismatch, ``num_tokens < 1``,
            more decode rows than ``num_tokens - 1``, or fewer prefill rows than ``start``
            (it never pads).
    """
    prefill_rows = _check_rows("prefill_rows", prefill_rows)
    decode_rows = _check_rows("decode_rows", decode_rows)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
        raise ValueError(f"num_tokens must be an integer, got {type(num_tokens).__name__}")
    num_tokens = int(num_tokens)
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if prefill_rows.shape[1:] != decode_rows.shape[1:]:
        raise ValueError(
            f"(L, K) mismatch: prefill_rows {prefill_rows.shape[1:]}, "
            f"decode_rows {decode_rows.shape[1:]}"
        )
    if prefill_rows.dtype != decode_rows.dtype:
        raise ValueError(
            f"dtype mismatch: prefill_rows {prefill_rows.dtype}, decode_rows {decode_rows.dtype}"
        )
    num_rows = num_tokens - 1
    if len(decode_rows) > num_rows:
        raise ValueError(
            f"decode_rows has {len(decode_rows)} rows, more than num_tokens - 1 = {num_rows}"
        )
    start = num_rows - len(decode_rows)
    if len(prefill_rows) < start:
        raise ValueError(
            f"prefill_rows has {len(prefill_rows)} rows, short of the {start} rows before the "
            f"decoder's {len(decode_rows)} (num_tokens={num_tokens})"
        )
    return np.concatenate([prefill_rows[:start], decode_rows], axis=0)
