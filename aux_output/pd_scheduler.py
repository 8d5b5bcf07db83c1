"""Scheduler side of ``--aux-output-pd splice``: a decoder returns only the rows it computed.

Under P/D a decoder's prompt KV comes from a prefiller, so the decoder never captured the
routed-expert rows of those tokens; asked for them (``routed_experts_prompt_start`` below the
first token it computes) its worker would look them up in a store that never had them. Under
``splice`` the engine's scheduler-side aux-output connector (vLLM's
``AuxOutputSchedulerConnector``) is wrapped by ``PDSchedulerConnector``, so that:

* **Decode-leg requests** (``is_decode_leg``: ``kv_transfer_params`` carrying
  ``do_remote_prefill``, which a KV connector may already have cleared to ``False``, and not
  ``do_remote_decode``) get an emit start of at least their first computed position: the
  request's ``num_computed_tokens`` the first time it is scheduled after admission (local
  prefix hit plus loaded KV). Rows below it are never read, so the worker never asks its
  store for rows it does not hold. A router splices the prefiller's rows before them.
* **vLLM 0.33.x only** (its connector caps external KV hits at the rows it holds):
  ``cap_external_hit`` lets a decode-leg hit through, block-aligned or not (NIXL's prefill
  backoff ends it mid-block; the worker, under ``splice``, starts the first capture there),
  up to the whole prompt (NIXL without backoff: after that asynchronous load vLLM rewinds
  ``num_computed_tokens`` to ``num_tokens - 1`` and recomputes the last token, so the first
  capture starts at that token). The loaded blocks, and the block the first computed
  position falls inside (whose earlier rows were never computed here; its hash may only
  appear once the request's output completes it), are recorded as *rowless* (their rows are
  nowhere on this instance) until they leave the GPU prefix cache or a request computes them
  whole; rowless blocks are never retained (``_kv_cached`` / ``retained_block_hashes``) and
  ``max_cache_hit`` stops at them for every request but a decode-leg one (which never reads
  rows below its first computed position, so it may reuse their KV).
* Prefill-leg (``do_remote_decode``) and plain requests are scheduled exactly as before.

vLLM 0.32.x's connector has no such hooks: ``PDSchedulerConnector032`` (pd_scheduler_032.py)
keeps the same rowless bookkeeping and caps hits in the scheduler's KV cache manager and KV
connector instead. ``wrap_scheduler_connector`` is installed per scheduler by ``plugin.py``
(``Scheduler.__init__``) when ``aux_output_pd`` is ``splice`` and the backend ``triton``; it
imports nothing from vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from itertools import islice
from typing import Any

from r3capture.aux_output import compat

DECODE_LEG_KEY = "do_remote_prefill"
PREFILL_LEG_KEY = "do_remote_decode"


def is_decode_leg(request: Any) -> bool:
    """True for a request whose KV is to come from a prefiller: its ``kv_transfer_params``
    (a dict) carry ``do_remote_prefill`` (``True`` as the router sent it, or ``False`` once a
    KV connector has scheduled the transfer: NIXL, Mooncake and MoRIIO clear it in
    ``update_state_after_alloc``) and do not set ``do_remote_decode`` (a prefill-leg request).
    """
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and DECODE_LEG_KEY in params and not params.get(PREFILL_LEG_KEY)


class PDSchedulerConnector:
    """vLLM's scheduler-side aux-output connector, with decode-leg requests returning only the
    rows they computed (module docstring). Every method or attribute it does not define is the
    wrapped connector's.

    State (request ids are vLLM's ``request.request_id``):

    * ``_decode_leg``: request id -> whether it is a decode-leg request, decided when the
      request is first seen and kept until it finishes (a preemption keeps it: the KV
      connector may have cleared ``do_remote_prefill`` by then);
    * ``_first_computed``: request id -> its ``num_computed_tokens`` when first scheduled
      after (re)admission (int); 0 for requests that are not decode-leg;
    * rowless blocks (0.33.x; 0.32.x in ``PDSchedulerConnector032``): ``_rowless`` (set of
      ``bytes``, the last hash-block hash of each KV block whose rows this instance does not
      hold), ``_rowless_of`` (request id -> the rowless keys its KV load brings, kept from
      the load's admission until its first schedule, so that pruning never drops them while
      the load is in flight and the blocks are not cached yet) and ``_partial_of`` (request
      id -> [request, index of the KV block its first computed position falls inside when
      that is mid-block, that block's key once the request's hashes reach it or None], kept
      until the request finishes or is preempted, so that pruning never drops the key
      before the block is cached).
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._decode_leg: dict[str, bool] = {}
        self._first_computed: dict[str, int] = {}
        self._caps = callable(getattr(inner, compat.CAP_EXTERNAL_HIT_METHOD, None))
        self._rowless: set[bytes] = set()
        self._rowless_of: dict[str, tuple[bytes, ...]] = {}
        self._partial_of: dict[str, list[Any]] = {}
        self._hide_rowless = True
        self._tracks_rowless = self._caps
        if self._caps:
            missing = [n for n in compat.SCHEDULER_CONNECTOR_INTERNALS if not hasattr(inner, n)]
            if missing:
                raise compat.UnsupportedVLLMError(
                    f"r3capture: --aux-output-pd splice needs {type(inner).__name__}."
                    f"{', '.join(missing)}, which this vLLM build ({compat.vllm_version()}) "
                    "lacks; it is not one r3capture supports"
                )
            self._block_size: int = inner._block_size
            self._prune_at: int = max(int(getattr(inner, "_capacity", 0)), 64)
            self._raw_gpu_cached = inner._gpu_cached
            # The wrapped connector asks this for every GPU-cached block it counts (its
            # max_cache_hit) or retains (its request_finished): a rowless block reads as not
            # cached, unless a decode-leg request's own cache-hit lookup is running.
            inner._gpu_cached = self._gpu_cached_with_rows

    # ------------------------------------------------------------ attributes
    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class does not define: the wrapped connector's.
        return getattr(self._inner, name)

    # ------------------------------------------------------------ classification
    def _is_decode_leg(self, request: Any) -> bool:
        request_id = request.request_id
        known = self._decode_leg.get(request_id)
        if known is None:
            known = self._decode_leg[request_id] = is_decode_leg(request)
        return known

    # ------------------------------------------------------------ every vLLM
    def build_connector_meta(self, scheduler_output: Any, requests: Mapping[str, Any]) -> Any:
        """The wrapped connector's metadata, with each decode-leg request's emit start
        (``metadata.requests[request_id]``, an int token position) raised to at least its
        first computed position. Called before the scheduler advances
        ``num_computed_tokens``, so at a request's first schedule that is local hit plus
        loaded KV."""
        self._record_partial_keys()
        metadata = self._inner.build_connector_meta(scheduler_output, requests)
        emit_starts = metadata.requests
        for request_id, emit_start in emit_starts.items():
            first = self._first_computed.get(request_id)
            if first is None:
                request = requests[request_id]
                first = request.num_computed_tokens if self._is_decode_leg(request) else 0
                self._first_computed[request_id] = first
                # Its KV load, if any, is over: its blocks are cached and held by it now.
                self._rowless_of.pop(request_id, None)
            if first > emit_start:
                emit_starts[request_id] = first
        return metadata

    def request_finished(self, request: Any) -> None:
        """Finish (or preempt: vLLM calls this for both) a request in the wrapped connector.

        Where rowless blocks are tracked: blocks the request holds rows for (all of its
        computed blocks; for a decode-leg request, those from its first computed position
        on) stop being rowless, then the wrapped connector (0.33.x) retains what it caches,
        rowless blocks excluded.
        """
        request_id = request.request_id
        first = self._first_computed.pop(request_id, None)
        if self._tracks_rowless:
            self._record_partial_keys()
            self._drop_rowless_rows_of(request, first)
            with self._rowless_hidden(True):
                self._inner.request_finished(request)
            self._rowless_of.pop(request_id, None)
            self._partial_of.pop(request_id, None)
            if len(self._rowless) > self._prune_at:
                self._prune_rowless()
        else:
            self._inner.request_finished(request)
        if request.is_finished():
            self._decode_leg.pop(request_id, None)

    def reset(self) -> None:
        """The wrapped connector's reset (a prefix-cache reset: the GPU cache is empty, so
        only blocks of loads still in flight stay rowless)."""
        self._inner.reset()
        self._rowless = set().union(*self._rowless_of.values())
        for entry in self._partial_of.values():
            entry[2] = None  # recorded again if the request's hashes still reach it

    # ------------------------------------------------------------ vLLM 0.33.x
    def max_cache_hit(self, request: Any) -> int:
        """Tokens of ``request``'s prefix whose rows the wrapped connector can serve; a
        decode-leg request also counts rowless blocks (it never reads rows below its first
        computed position)."""
        self._record_partial_keys()
        with self._rowless_hidden(not self._is_decode_leg(request)):
            return self._inner.max_cache_hit(request)

    def cap_external_hit(self, request: Any, num_local: int, num_external: int) -> int:
        """External KV tokens the scheduler may load for ``request`` after ``num_local``
        local-hit tokens (ints). The wrapped connector's answer, except for a decode-leg
        request: its hit is let through (up to the whole request, whose last token vLLM
        recomputes after the load), the loaded whole blocks not already holding rows are
        recorded as rowless, and so is the block the request's first computed position
        falls inside when that is mid-block, now or once the request's hashes reach it."""
        self._record_partial_keys()
        with self._rowless_hidden(True):
            allowed = self._inner.cap_external_hit(request, num_local, num_external)
        num_hit = num_local + num_external
        if (
            allowed == num_external
            or num_external <= 0
            or not self._is_decode_leg(request)
            or num_hit > request.num_tokens
        ):
            return allowed
        self._record_load(request, num_local, num_external)
        return num_external

    # ------------------------------------------------------------ rowless blocks
    def _kv_blocks(self, block_hashes: Any) -> Iterator[tuple[Any, Any]]:
        """Per KV block of ``block_hashes``: (its key, its hash-block hashes); 0.33.x: the
        wrapped connector's."""
        return self._inner._kv_blocks(block_hashes)

    def _holds_rows(self, block: Any) -> bool:
        """Whether this instance's store holds the rows of KV block ``block`` (a key from
        ``_kv_blocks``); 0.33.x: the wrapped connector retains them (``_kv_cached``)."""
        return block in self._inner._kv_cached

    def _record_load(self, request: Any, num_local: int, num_external: int) -> None:
        """Record what a decode-leg request's KV load (tokens ``num_local`` to ``num_local +
        num_external``, ints) leaves without rows here: its whole blocks whose rows this
        instance does not hold, and the block its first computed position falls inside when
        that is mid-block (now, or once the request's hashes reach it)."""
        num_hit = num_local + num_external
        # A hit covering the whole request is an asynchronous load (a synchronous one would
        # leave no token to compute); once it lands, _update_waiting_for_remote_kv rewinds
        # num_computed_tokens to num_tokens - 1, so the decoder computes the last token
        # itself and its first capture starts there.
        first = min(num_hit, request.num_tokens - 1)
        begin, end = num_local // self._block_size, num_hit // self._block_size
        keys = tuple(
            last_key
            for block, last_key in self._blocks(request, begin, end)
            if not self._holds_rows(block)
        )
        self._rowless.update(keys)
        self._rowless_of[request.request_id] = keys
        if first % self._block_size:
            self._partial_of[request.request_id] = [request, first // self._block_size, None]
            self._record_partial_keys()

    def _gpu_cached_with_rows(self, block_hash: Any) -> Any:
        if self._hide_rowless and block_hash in self._rowless:
            return None
        return self._raw_gpu_cached(block_hash)

    @contextmanager
    def _rowless_hidden(self, hidden: bool) -> Iterator[None]:
        before, self._hide_rowless = self._hide_rowless, hidden
        try:
            yield
        finally:
            self._hide_rowless = before

    def _blocks(self, request: Any, begin: int, end: int) -> Iterator[tuple[Any, bytes]]:
        """(the wrapped connector's key, the last hash-block hash) of ``request``'s KV blocks
        ``begin .. end`` (block indices; blocks past its known hashes are left out)."""
        blocks = islice(self._kv_blocks(request.block_hashes), begin, max(begin, end))
        for block, keys in blocks:
            yield block, keys[-1]

    def _record_partial_keys(self) -> None:
        """Record as rowless the key of each block a decode-leg request's first computed
        position falls inside (mid-block), once its request's hashes reach it (the scheduler
        caches a block, so other requests can hit it, only after its hash is known; every
        entry point that may count or retain a block runs this first)."""
        for entry in self._partial_of.values():
            request, index, key = entry
            if key is not None:
                continue
            for block, last_key in self._blocks(request, index, index + 1):
                entry[2] = last_key
                if not self._holds_rows(block):
                    self._rowless.add(last_key)

    def _drop_rowless_rows_of(self, request: Any, first_computed: int | None) -> None:
        """Blocks ``request`` computed (or hit with rows) are no longer rowless: all of its
        full computed blocks, or for a decode-leg request those from its first computed
        position on (rounded up to a block). A decode-leg request never scheduled computed
        none."""
        if not self._rowless:
            return
        if self._decode_leg.get(request.request_id):
            if first_computed is None:
                return
            begin = -(-first_computed // self._block_size)
        else:
            begin = 0
        end = request.num_computed_tokens // self._block_size
        for _, last_key in self._blocks(request, begin, end):
            self._rowless.discard(last_key)

    def _prune_rowless(self) -> None:
        """Forget rowless blocks that left the GPU prefix cache (no request can hit them
        locally any more; a new load records them again), except those of loads in flight."""
        live = set().union(*self._rowless_of.values())
        live.update(entry[2] for entry in self._partial_of.values())
        self._rowless = {
            key for key in self._rowless if key in live or self._raw_gpu_cached(key) is not None
        }
        self._prune_at = max(self._prune_at, 2 * len(self._rowless))


def wrap_scheduler_connector(scheduler: Any) -> None:
    """Replace ``scheduler``'s aux-output connector (``compat.SCHEDULER_AUX_CONNECTOR_ATTR``)
    with a ``PDSchedulerConnector`` around it (0.32.x's, which has no ``cap_external_hit``: a
    ``PDSchedulerConnector032``, which also caps the scheduler's hits); no-op when it has none
    or it is wrapped."""
    connector = getattr(scheduler, compat.SCHEDULER_AUX_CONNECTOR_ATTR, None)
    if connector is None or isinstance(connector, PDSchedulerConnector):
        return
    if callable(getattr(connector, compat.CAP_EXTERNAL_HIT_METHOD, None)):
        wrapped = PDSchedulerConnector(connector)
    else:
        from r3capture.aux_output.pd_scheduler_032 import PDSchedulerConnector032

        wrapped = PDSchedulerConnector032(connector, scheduler)
    setattr(scheduler, compat.SCHEDULER_AUX_CONNECTOR_ATTR, wrapped)
