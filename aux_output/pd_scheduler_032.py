"""``--aux-output-pd splice`` on vLLM 0.32.x: rowless blocks kept out of other requests' hits.

vLLM 0.32.x's scheduler-side aux-output connector has no ``max_cache_hit`` nor
``cap_external_hit``: the scheduler takes every prefix hit, local or loaded. A decoder's GPU
prefix cache then holds the KV blocks it loaded from a prefiller, and a request that is not a
decode-leg one (a plain request, or one whose router dropped ``do_remote_prefill``) sharing
that prefix would hit them and ask its worker for rows this instance never computed
(``BlockObjectStoreError``, and the engine dies). ``PDSchedulerConnector032`` keeps the same
rowless bookkeeping as on 0.33.x (``PDSchedulerConnector``) and caps hits where 0.32.x's
scheduler takes them (``compat.LOCAL_HIT_METHODS``, ``compat.EXTERNAL_HIT_METHOD``):

* **local hit** (the KV cache manager's ``get_computed_blocks`` and, with NIXL or MoRIIO,
  ``get_computed_blocks_for_connector``): a request that is not decode-leg stops at its first
  rowless block, so it computes (and captures) those tokens itself; a decode-leg request's hit
  is untouched (it never reads rows below its first computed position);
* **KV connector hit** (``get_num_new_matched_tokens``): a decode-leg request's load is
  recorded as on 0.33.x (its whole blocks, and the block its first computed position falls
  inside when mid-block, are rowless); any other request's load is refused (0 tokens, as
  0.32.x's scheduler itself answers for a request that skips the prefix cache): this
  instance keeps no record of which rows its worker's store holds, and KV from a prefiller
  has none (0.33.x caps such a load at the rows its connector retains).

A block stops being rowless when a request computes it whole, and is forgotten once it leaves
the GPU prefix cache or on a prefix-cache reset, as on 0.33.x. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from r3capture.aux_output import compat
from r3capture.aux_output.pd_scheduler import PDSchedulerConnector


class PDSchedulerConnector032(PDSchedulerConnector):
    """``PDSchedulerConnector`` around vLLM 0.32.x's connector, with ``scheduler``'s local and
    KV connector hits capped (module docstring). Built (and the caps installed on
    ``scheduler.kv_cache_manager`` and ``scheduler.connector``, instance attributes) once per
    scheduler by ``wrap_scheduler_connector``.

    Raises ``compat.UnsupportedVLLMError`` when ``scheduler`` or its KV cache manager lacks a
    name the caps need (``compat.SCHEDULER_032_INTERNALS``,
    ``compat.KV_CACHE_MANAGER_032_INTERNALS``).
    """

    def __init__(self, inner: Any, scheduler: Any) -> None:
        super().__init__(inner)
        manager = getattr(scheduler, "kv_cache_manager", None)
        missing = [n for n in compat.SCHEDULER_032_INTERNALS if not hasattr(scheduler, n)]
        missing += [n for n in compat.KV_CACHE_MANAGER_032_INTERNALS if not hasattr(manager, n)]
        if missing:
            raise compat.UnsupportedVLLMError(
                f"r3capture: --aux-output-pd splice needs the scheduler's {', '.join(missing)}, "
                f"which this vLLM build ({compat.vllm_version()}) lacks; it is not one "
                "r3capture supports"
            )
        self._manager = manager
        self._block_size = int(scheduler.block_size)
        self._hashes_per_block = self._block_size // int(scheduler.hash_block_size)
        coordinator = getattr(manager, "coordinator", None)
        group = getattr(coordinator, "full_attention_group_id", None) or 0
        pool = manager.block_pool
        self._raw_gpu_cached = lambda block_hash: pool.get_cached_block(block_hash, [group])
        num_blocks = getattr(getattr(manager, "kv_cache_config", None), "num_blocks", 0)
        self._prune_at = max(2 * int(num_blocks), 64)
        self._tracks_rowless = True
        for name in compat.LOCAL_HIT_METHODS:
            lookup = getattr(manager, name, None)
            if lookup is not None:
                setattr(manager, name, self._capping_local_hit(lookup))
        kv_connector = getattr(scheduler, compat.SCHEDULER_KV_CONNECTOR_ATTR)
        if kv_connector is not None:
            matched = getattr(kv_connector, compat.EXTERNAL_HIT_METHOD)
            setattr(kv_connector, compat.EXTERNAL_HIT_METHOD, self._capping_external_hit(matched))

    # ------------------------------------------------------------ block geometry
    def _kv_blocks(self, block_hashes: Sequence[Any]) -> Iterator[tuple[Any, Sequence[Any]]]:
        """Per full KV block of ``block_hashes``: (its last hash, its hash-block hashes)."""
        step = self._hashes_per_block
        for end in range(step, len(block_hashes) + 1, step):
            yield block_hashes[end - 1], block_hashes[end - step : end]

    def _holds_rows(self, block: Any) -> bool:
        """Never known on 0.32.x (its connector retains no rows): a loaded block is rowless."""
        return False

    # ------------------------------------------------------------ the caps
    def rows_hit_limit(self, request: Any, num_local: int) -> int:
        """How much of ``request``'s local prefix hit of ``num_local`` tokens (an int) it may
        take: all of it for a decode-leg request, else up to its first rowless KV block (a
        token position, a multiple of the block size when below ``num_local``)."""
        self._record_partial_keys()
        if not self._rowless or self._is_decode_leg(request):
            return num_local
        end = -(-num_local // self._block_size)
        for index, (_, last_key) in enumerate(self._blocks(request, 0, end)):
            if last_key in self._rowless:
                return min(index * self._block_size, num_local)
        return num_local

    def _capping_local_hit(self, lookup: Callable[..., tuple]) -> Callable[..., tuple]:
        """``lookup`` (``request -> (blocks, num_tokens, *rest)``) with the hit cut at
        ``rows_hit_limit`` (``blocks`` through the manager's ``truncate_computed_blocks``)."""

        def capped(request: Any, *args: Any, **kwargs: Any) -> tuple:
            found = lookup(request, *args, **kwargs)
            blocks, num_local = found[0], found[1]
            limit = self.rows_hit_limit(request, num_local)
            if limit >= num_local:
                return found
            truncate = getattr(self._manager, compat.TRUNCATE_HIT_METHOD)
            return (truncate(blocks, limit), limit, *found[2:])

        capped.__wrapped__ = lookup
        return capped

    def _capping_external_hit(self, matched: Callable[..., tuple]) -> Callable[..., tuple]:
        """The KV connector's ``matched(request, num_local) -> (num_tokens | None,
        load_async)``: a decode-leg request's hit recorded, any other request's refused."""

        def capped(request: Any, num_local: int, *args: Any, **kwargs: Any) -> tuple:
            num_external, load_async = matched(request, num_local, *args, **kwargs)
            if not num_external:
                return num_external, load_async  # None: asked again in a later step
            if not self._is_decode_leg(request):
                return 0, False
            self._record_partial_keys()
            if num_local + num_external <= request.num_tokens:
                self._record_load(request, num_local, num_external)
            return num_external, load_async

        capped.__wrapped__ = matched
        return capped
