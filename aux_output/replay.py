"""Per-request routed experts: a request that does not need its rows costs nothing to return.

vLLM 0.32.x and 0.33.x return routed experts for every request or for none. Under
``--aux-output-backend triton`` a request says whether it wants its rows with
``SamplingParams.extra_args["aux_output_replay"]`` (the OpenAI server's ``vllm_xargs``: a
JSON boolean, which the server narrows to 0/1), the key vLLM's logprob-replay branch reads:

* absent: the server's default, rows returned, unless the server was started with
  ``--aux-output-replay-default off`` (``additional_config["aux_output_replay_default"] =
  False``), which makes them opt-in;
* ``True`` / ``1``: rows returned, exactly as without the switch;
* ``False`` / ``0``: no rows (``routed_experts`` is None); anything else is refused when the
  request is made (``request_replay``; the OpenAI server answers 400).

How an opted-out request costs nothing to return: the scheduler-side connector
(``ReplaySchedulerConnector``, wrapping vLLM's) sends the worker an emit start no request
reaches (``NO_EMIT_START``), so r3capture's worker never gathers, copies or reads back a row
for it (no emitted rows, no prefix-hit reads) and returns no output for it; the wrapper's
``take_output`` answers None without asking the worker. Everything else is as for any
request: its rows are still written by the capture kernel and its complete blocks published,
so a later request that wants rows and hits its prefix reads them (vLLM's scheduler keeps
them as it keeps any request's), and every other request's rows are vLLM's.

With ``torch`` (vLLM's own backend) nothing here is installed: vLLM ignores the key and
returns every request's rows. This module imports nothing from vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from r3capture.aux_output import compat, envs

logger = logging.getLogger("vllm.r3capture")

REPLAY_KEY = "aux_output_replay"
DEFAULT_KEY = "aux_output_replay_default"
DEFAULT_FLAG = "--aux-output-replay-default"
# The flag's words and the additional_config value each stands for.
DEFAULT_CHOICES = {"on": True, "off": False}
_NEEDED_BACKEND = "triton"
# An emit start past any token position (the worker's cursors are int64): the worker's emit
# cursor is never reached, so it returns no row of the request, and every check it makes of
# emit starts (never moving ahead of its cursor) holds, as the start never changes.
NO_EMIT_START = 2**62
_ABSENT = object()


# ---------------------------------------------------------------- the switch
def replay_default(vllm_config: Any) -> bool:
    """Whether a request without the switch gets its rows, from a ``VllmConfig``'s
    ``additional_config`` (True when unset). Raises ``ValueError`` for a value that is not a
    boolean."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict):
        return True
    value = additional.get(DEFAULT_KEY, True)
    if type(value) is not bool:
        raise ValueError(
            f"additional_config[{DEFAULT_KEY!r}] must be true or false (set by {DEFAULT_FLAG} "
            f"on|off), got {value!r}"
        )
    return value


def check_replay_default(vllm_config: Any, backend: str) -> bool:
    """Validate the replay default of a ``VllmConfig`` whose aux-output backend is
    ``backend``; return it. ``off`` needs ``triton``: vLLM's own backend would return every
    request's rows regardless."""
    default = replay_default(vllm_config)
    if not default and backend != _NEEDED_BACKEND:
        raise ValueError(
            f"{DEFAULT_FLAG} off needs --aux-output-backend {_NEEDED_BACKEND} (the selected "
            f"backend is {backend!r}, which returns every request's routed experts)"
        )
    return default


def request_replay(extra_args: Any, default: bool = True) -> bool:
    """Whether a request with ``SamplingParams.extra_args`` ``extra_args`` (a dict or None)
    gets its routed-expert rows: its ``aux_output_replay`` (a bool, or 0/1 as the OpenAI
    server narrows JSON booleans), else ``default``.

    Raises ``ValueError`` naming the key for any other value (a string such as ``"false"``
    would otherwise read as true).
    """
    if not extra_args or not isinstance(extra_args, Mapping):
        return default
    value = extra_args.get(REPLAY_KEY, _ABSENT)
    if value is _ABSENT:
        return default
    if value is True or value is False:
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise ValueError(
        f"{REPLAY_KEY} must be a boolean (true or false; 0 or 1), got {value!r} of type "
        f"{type(value).__name__} (SamplingParams.extra_args[{REPLAY_KEY!r}]; over HTTP, "
        f"vllm_xargs.{REPLAY_KEY})"
    )


def check_request(params: Any) -> None:
    """Refuse a request whose sampling parameters carry a malformed switch (``ValueError``
    naming it). ``params``: vLLM's ``SamplingParams`` (anything without ``extra_args``, such
    as ``PoolingParams``, passes)."""
    request_replay(getattr(params, "extra_args", None))


# ---------------------------------------------------------------- the scheduler side
@dataclass
class ReplayCounts:
    """What the switch saved since the server started, counted as requests finish.

    ``rows_returned``: rows handed to the engine's output for requests that wanted them (each
    row ``[L, K]`` expert ids); ``rows_withheld``: rows vLLM's backend would have returned
    for requests that opted out (``num_tokens - 1`` past their ``routed_experts_prompt_start``).
    """

    requests_with_rows: int = 0
    rows_returned: int = 0
    requests_without_rows: int = 0
    rows_withheld: int = 0

    def line(self) -> str:
        return (
            f"routed experts: {self.rows_returned} rows returned to "
            f"{self.requests_with_rows} requests; {self.rows_withheld} rows withheld from "
            f"{self.requests_without_rows} requests that opted out ({REPLAY_KEY})"
        )


class ReplaySchedulerConnector:
    """vLLM's scheduler-side aux-output connector (or r3capture's P/D wrapper of it), with
    opted-out requests returning no rows (module docstring). Every method or attribute it
    does not define is the wrapped connector's. ``counts`` (``ReplayCounts``) is logged
    (logger ``vllm.r3capture``) at most every ``R3CAPTURE_REPLAY_LOG_INTERVAL_S`` seconds
    when a request finishes.

    State (request ids are vLLM's ``request.request_id``): ``_replays``, request id ->
    whether it gets rows, decided the first time it is scheduled and kept until it finishes
    (a preemption keeps it); ``_opted_out``, the ids of those that do not.
    """

    def __init__(self, inner: Any, *, default: bool = True) -> None:
        if type(default) is not bool:
            raise TypeError(f"default must be a bool, got {default!r}")
        self._inner = inner
        self._default = default
        self._replays: dict[str, bool] = {}
        self._opted_out: set[str] = set()
        self.counts = ReplayCounts()
        self._log_interval_s = envs.replay_log_interval_s()
        self._logged_at = float("-inf")

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class does not define: the wrapped connector's.
        return getattr(self._inner, name)

    def build_connector_meta(self, scheduler_output: Any, requests: Mapping[str, Any]) -> Any:
        """The wrapped connector's metadata, with every opted-out request's emit start
        (``metadata.requests[request_id]``) set to ``NO_EMIT_START``."""
        metadata = self._inner.build_connector_meta(scheduler_output, requests)
        emit_starts = metadata.requests
        # One C-level subset test a step; only a step with new requests classifies.
        if not emit_starts.keys() <= self._replays.keys():
            self._classify(emit_starts, requests)
        if self._opted_out:
            opted_out = emit_starts.keys() & self._opted_out
            if opted_out:
                emit_starts.update(dict.fromkeys(opted_out, NO_EMIT_START))
        return metadata

    def _classify(self, emit_starts: Mapping[str, int], requests: Mapping[str, Any]) -> None:
        replays = self._replays
        for request_id in emit_starts:
            if request_id in replays:
                continue
            params = getattr(requests[request_id], "sampling_params", None)
            try:
                replay = request_replay(getattr(params, "extra_args", None), self._default)
            except ValueError:
                # Refused at admission (check_request); one that bypassed the input
                # processor gets its rows rather than stopping the engine.
                replay = True
            replays[request_id] = replay
            if not replay:
                self._opted_out.add(request_id)

    def take_output(self, request: Any, output: Any) -> Any:
        """None for an opted-out request (the worker returns nothing for it); otherwise the
        wrapped connector's rows."""
        if request.request_id in self._opted_out:
            return None
        rows = self._inner.take_output(request, output)
        if rows is not None:
            self.counts.rows_returned += len(rows)
        return rows

    def request_finished(self, request: Any) -> None:
        """The wrapped connector's; a finished request (not a preempted one) is forgotten."""
        self._inner.request_finished(request)
        if request.is_finished():
            request_id = request.request_id
            counts = self.counts
            replay = self._replays.pop(request_id, None)
            if replay is None:  # finished (aborted) before it was ever scheduled
                return
            if replay:
                counts.requests_with_rows += 1
            else:
                self._opted_out.discard(request_id)
                counts.requests_without_rows += 1
                counts.rows_withheld += _rows_asked_for(request)
            now = time.monotonic()
            if now - self._logged_at >= self._log_interval_s:
                self._logged_at = now
                logger.info("r3capture %s", counts.line())


def _rows_asked_for(request: Any) -> int:
    """The rows vLLM's backend returns for a finished ``request``: one per token but the last,
    from its ``routed_experts_prompt_start`` (capped at the prompt) on."""
    start = getattr(request.sampling_params, "routed_experts_prompt_start", 0) or 0
    return max(request.num_tokens - 1 - min(start, request.num_prompt_tokens), 0)


def wrap_for_replay(scheduler: Any, default: bool) -> None:
    """Replace ``scheduler``'s aux-output connector (``compat.SCHEDULER_AUX_CONNECTOR_ATTR``)
    with a ``ReplaySchedulerConnector`` around it; no-op when it has none or it is wrapped."""
    connector = getattr(scheduler, compat.SCHEDULER_AUX_CONNECTOR_ATTR, None)
    if connector is None or isinstance(connector, ReplaySchedulerConnector):
        return
    wrapped = ReplaySchedulerConnector(connector, default=default)
    setattr(scheduler, compat.SCHEDULER_AUX_CONNECTOR_ATTR, wrapped)
