"""Unit tests of r3capture's scheduler connector (seed 002 / vLLM 0.33.0 semantics).

A hand-driven KV double (``FakeKV``: which hashes the GPU caches is set by the test) makes
every rule explicit; the last tests use vLLM's real KVCacheManager and Request objects and
compare with vLLM's own connector call by call.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np
import pytest

from r3capture.aux_output.types import AuxRequestOutput
from sim.scheduler import SchedulerConnector

BLOCK = 4  # KV block size (tokens)
HBS = 2  # hash block size: two hashes per KV block


class FakeKV:
    """The attributes a scheduler connector reads; ``gpu`` = hashes the GPU caches."""

    def __init__(self, num_blocks: int = 8, block_size: int = BLOCK, hbs: int = HBS) -> None:
        self.gpu: set[bytes] = set()
        pool = SimpleNamespace(hash_block_size=hbs, get_cached_block=self._lookup)
        manager = SimpleNamespace(block_size=block_size, block_pool=pool)
        self.block_pool = pool
        self.coordinator = SimpleNamespace(single_type_managers=[manager])
        self.kv_cache_config = SimpleNamespace(num_blocks=num_blocks)
        self.lookups: list[tuple[bytes, list[int]]] = []

    def _lookup(self, block_hash: bytes, groups: list[int]):
        self.lookups.append((block_hash, groups))
        return [object()] if block_hash in self.gpu else None


def h(tag: str, i: int) -> bytes:
    return hashlib.sha256(f"{tag}/{i}".encode()).digest()


class Req:
    """A request with ``num_hashes`` hash blocks of tokens (hashes named by ``tag``)."""

    def __init__(
        self, req_id: str, num_prompt: int, *, tag: str | None = None, prompt_start: int = 0
    ) -> None:
        self.request_id = req_id
        self.tag = tag or req_id
        self.num_prompt_tokens = num_prompt
        self.num_tokens = num_prompt
        self.num_computed_tokens = 0
        self.sampling_params = SimpleNamespace(routed_experts_prompt_start=prompt_start)
        self.finished = False
        self._sync()

    def _sync(self) -> None:
        self.block_hashes = [h(self.tag, i) for i in range(self.num_tokens // HBS)]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def append(self, n: int) -> None:
        self.num_tokens += n
        self._sync()

    def is_finished(self) -> bool:
        return self.finished


def sched(**num_scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=dict(num_scheduled))


def hashes(packed) -> list[bytes]:
    return [] if packed is None else list(packed)


def step(conn: SchedulerConnector, reqs: dict[str, Req], **num_scheduled: int):
    """build_connector_meta, then advance num_computed_tokens like the scheduler does."""
    meta = conn.build_connector_meta(sched(**num_scheduled), reqs)
    for req_id, n in num_scheduled.items():
        reqs[req_id].num_computed_tokens += n
    return meta


def test_emit_start_prompt_start_then_newest_token():
    conn = SchedulerConnector(FakeKV())
    a = Req("a", 10, prompt_start=6)
    b = Req("b", 10, prompt_start=99)  # clamped to the prompt
    c = Req("c", 10)
    reqs = {"a": a, "b": b, "c": c}
    meta = step(conn, reqs, a=10, b=10, c=4)
    assert meta.requests == {"a": 6, "b": 10, "c": 0}
    assert list(meta.requests) == ["a", "b", "c"]  # batch order
    a.append(3)  # three outputs: only the newest token's row is still owed
    meta = step(conn, reqs, a=1, c=6)
    assert meta.requests == {"a": 12, "c": 0}


def test_emit_start_after_preemption_is_newest_token_even_below_prompt_start():
    conn = SchedulerConnector(FakeKV())
    a = Req("a", 8, prompt_start=8)
    a.append(1)
    a.num_computed_tokens = 0  # recompute after preemption
    assert step(conn, {"a": a}, a=9).requests == {"a": 8}


def test_hashes_travel_with_the_step_that_completes_their_block():
    conn = SchedulerConnector(FakeKV())
    a = Req("a", 11)  # 5 complete hash blocks
    reqs = {"a": a}
    m1 = step(conn, reqs, a=5)  # tokens 0..4 -> hash blocks 0, 1
    assert hashes(m1.block_hashes["a"]) == a.block_hashes[:2]
    assert m1.block_hashes["a"].item_size == 32
    m2 = step(conn, reqs, a=1)  # token 5 completes hash block 2
    assert hashes(m2.block_hashes["a"]) == a.block_hashes[2:3]
    m3 = step(conn, reqs, a=1)  # token 6 completes nothing
    assert "a" not in m3.block_hashes
    m4 = step(conn, reqs, a=4)  # up to 11: blocks 3, 4 (block 5 is not known yet)
    assert hashes(m4.block_hashes["a"]) == a.block_hashes[3:5]


def test_optimistic_compute_beyond_known_tokens_sends_only_known_hashes():
    conn = SchedulerConnector(FakeKV())
    a = Req("a", 4)
    a.num_computed_tokens = 4
    meta = step(conn, {"a": a}, a=6)  # 1 + 5 placeholder drafts: no new hash is known
    assert hashes(meta.block_hashes["a"]) == a.block_hashes[:2]


def test_hash_only_update_for_a_request_not_rescheduled():
    conn = SchedulerConnector(FakeKV())
    a, b = Req("a", 3), Req("b", 8)
    reqs = {"a": a, "b": b}
    step(conn, reqs, a=3, b=8)
    # The token that completes a's second hash block settles after the next schedule.
    a.append(1)
    meta = step(conn, reqs, b=1)
    assert list(meta.requests) == ["b"]
    assert "a" not in meta.block_hashes  # num_computed_tokens (3) does not cover block 1
    a.num_computed_tokens = 4
    meta = step(conn, reqs, b=1)
    assert list(meta.requests) == ["b"]
    assert hashes(meta.block_hashes["a"]) == [a.block_hashes[1]]
    assert "a" not in step(conn, reqs, b=1).block_hashes  # sent once


def test_terminal_event_is_one_shot_and_carries_final_hashes():
    kv = FakeKV()
    conn = SchedulerConnector(kv)
    a = Req("a", 7)
    reqs = {"a": a}
    step(conn, reqs, a=3)  # hash block 0 sent
    a.num_computed_tokens = 7
    conn.request_finished(a)
    del reqs["a"]
    meta = step(conn, reqs)
    assert meta.finished_requests == ("a",)
    assert meta.requests == {}
    assert hashes(meta.block_hashes["a"]) == a.block_hashes[1:3]
    nxt = step(conn, reqs)
    assert nxt.finished_requests == () and nxt.block_hashes == {}


def test_unscheduled_request_finishing_sends_no_terminal_event():
    conn = SchedulerConnector(FakeKV())
    a = Req("a", 8)
    conn.request_finished(a)
    assert step(conn, {}).finished_requests == ()


def test_finish_pins_gpu_cached_kv_blocks_once():
    kv = FakeKV()
    conn = SchedulerConnector(kv)
    a = Req("a", 13)  # 3 full KV blocks (keys = hash 1, 3, 5)
    a.num_computed_tokens = 10  # only blocks 0, 1 are computed
    kv.gpu = {a.block_hashes[1], a.block_hashes[5]}
    conn.request_finished(a)
    meta = step(conn, {})
    # Block 0 is pinned (both hashes), block 1 is not on the GPU, block 2 not computed.
    assert hashes(meta.retained_block_hashes) == a.block_hashes[0:2]
    assert meta.released_block_hashes is None
    b = Req("b", 8, tag="a")  # same prefix
    b.num_computed_tokens = 8
    kv.gpu.add(a.block_hashes[3])
    conn.request_finished(b)
    assert hashes(step(conn, {}).retained_block_hashes) == a.block_hashes[2:4]
    assert [g for _, g in kv.lookups] == [[0]] * len(kv.lookups)


def test_capacity_rule_unpins_lru_blocks_not_on_gpu_and_not_loading():
    kv = FakeKV(num_blocks=2)  # capacity 2 pinned KV blocks
    conn = SchedulerConnector(kv)
    assert conn.capacity == 2
    reqs = [Req(f"r{i}", 4) for i in range(4)]  # one KV block each
    for r in reqs:
        r.num_computed_tokens = 4
        kv.gpu.add(r.block_hashes[1])
    for r in reqs[:3]:
        conn.request_finished(r)  # 3 pins: over capacity, but all still on the GPU
    assert step(conn, {}).released_block_hashes is None
    kv.gpu.clear()
    conn.request_loading(reqs[0], 4)  # a KV load is bringing r0's block back
    kv.gpu.add(reqs[3].block_hashes[1])
    conn.request_finished(reqs[3])  # 4 pins, excess 2: r0 loading -> r1, r2 go
    meta = step(conn, {})
    assert hashes(meta.retained_block_hashes) == reqs[3].block_hashes
    assert hashes(meta.released_block_hashes) == reqs[1].block_hashes + reqs[2].block_hashes
    # r0 stays pinned: a hit on it counts even though the GPU lost it.
    probe = Req("p", 9, tag="r0")
    assert conn.max_cache_hit(probe) == 4


def test_kv_connector_doubles_capacity():
    assert SchedulerConnector(FakeKV(num_blocks=3), kv_connector=object()).capacity == 6


def test_max_cache_hit_refreshes_lru_order():
    kv = FakeKV(num_blocks=2)
    conn = SchedulerConnector(kv)
    rs = [Req(f"r{i}", 4) for i in range(3)]
    for r in rs[:2]:
        r.num_computed_tokens = 4
        kv.gpu.add(r.block_hashes[1])
        conn.request_finished(r)
    kv.gpu.clear()
    assert conn.max_cache_hit(Req("p", 9, tag="r0")) == 4  # r0 becomes most recent
    rs[2].num_computed_tokens = 4
    kv.gpu.add(rs[2].block_hashes[1])
    conn.request_finished(rs[2])
    step(conn, {})
    conn.request_finished(Req("x", 1))  # no-op finish to re-run the capacity rule
    meta = step(conn, {})
    assert meta.released_block_hashes is None  # already released in the previous step
    assert conn.max_cache_hit(Req("q", 9, tag="r1")) == 0  # r1 was the LRU victim
    assert conn.max_cache_hit(Req("q", 9, tag="r0")) == 4


def test_max_cache_hit_stops_at_first_gap_and_leaves_last_token():
    kv = FakeKV()
    conn = SchedulerConnector(kv)
    a = Req("a", 12)  # KV blocks keyed by hashes 1, 3, 5
    kv.gpu = {a.block_hashes[1], a.block_hashes[5]}
    assert conn.max_cache_hit(a) == 4
    kv.gpu.add(a.block_hashes[3])
    assert conn.max_cache_hit(a) == 11  # all 12 cached: the last token is recomputed
    assert conn.max_cache_hit(Req("b", 1)) == 0


def test_cap_external_hit_is_all_or_nothing():
    kv = FakeKV()
    conn = SchedulerConnector(kv)
    a = Req("a", 13)
    kv.gpu = {a.block_hashes[1], a.block_hashes[3]}  # 8 servable tokens
    assert conn.cap_external_hit(a, 4, 4) == 4
    assert conn.cap_external_hit(a, 0, 8) == 8
    assert conn.cap_external_hit(a, 4, 3) == 0  # not KV-block aligned
    assert conn.cap_external_hit(a, 4, 8) == 0  # beyond what is servable
    assert conn.cap_external_hit(a, 0, 0) == 0


def test_take_output_trims_to_accepted_tokens():
    conn = SchedulerConnector(FakeKV())
    rows = np.arange(5 * 2 * 3, dtype=np.uint8).reshape(5, 2, 3)
    out = {"a": AuxRequestOutput(4, rows)}  # positions 4..8
    a = Req("a", 8)
    a.append(1)  # num_tokens 9 -> rows of positions 4..7
    got = conn.take_output(a, out)
    assert got.dtype == np.uint8 and got.shape == (4, 2, 3)
    assert np.array_equal(got, rows[:4])
    a.append(1)
    assert np.array_equal(conn.take_output(a, out), rows)
    early = Req("a", 4)  # token_end 3 < token_start 4: nothing accepted yet
    assert conn.take_output(early, out) is None


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "worker output is missing a"),
        ("none", "worker output is missing a"),
        ("short", "invalid token range"),
        ("finished_empty", "no accepted token range"),
    ],
)
def test_take_output_errors(case, message):
    conn = SchedulerConnector(FakeKV())
    rows = np.zeros((2, 1, 1), np.uint8)
    a = Req("a", 8)
    output = {"a": AuxRequestOutput(4, rows)}
    if case == "missing":
        output = {"b": AuxRequestOutput(0, rows)}
    elif case == "none":
        output = None
    elif case == "finished_empty":
        output = {"a": AuxRequestOutput(9, rows)}
        a.finished = True
    with pytest.raises(AssertionError, match=message):
        conn.take_output(a, output)


def test_reset_bumps_generation_releases_pins_and_resends_hashes():
    kv = FakeKV()
    conn = SchedulerConnector(kv)
    a, b = Req("a", 8), Req("b", 4)
    reqs = {"a": a}
    step(conn, reqs, a=8)
    b.num_computed_tokens = 4
    kv.gpu.add(b.block_hashes[1])
    step(conn, {"a": a, "b": b}, b=0)
    conn.request_finished(b)  # pin + terminal event
    kv.gpu.clear()  # the KV prefix cache was reset first
    conn.reset()
    meta = step(conn, reqs, a=1)
    assert meta.generation == 1
    assert meta.finished_requests == ()  # the reset dropped b's terminal event
    assert hashes(meta.retained_block_hashes) == b.block_hashes  # queued before the reset
    assert hashes(meta.released_block_hashes) == b.block_hashes
    assert hashes(meta.block_hashes["a"]) == a.block_hashes  # all hashes again
    assert conn.max_cache_hit(Req("p", 9, tag="b")) == 0
    conn.reset()
    assert step(conn, reqs).generation == 2


def test_shrinking_hash_history_is_an_error():
    conn = SchedulerConnector(FakeKV())
    a = Req("a", 8)
    step(conn, {"a": a}, a=8)
    a.block_hashes = a.block_hashes[:2]
    with pytest.raises(AssertionError, match="history shrank"):
        step(conn, {"a": a}, a=1)


def test_block_size_must_be_a_multiple_of_hash_block_size():
    with pytest.raises(ValueError, match="multiple of hash_block_size"):
        SchedulerConnector(FakeKV(block_size=6, hbs=4))


def test_group_id_from_coordinator():
    kv = FakeKV()
    kv.coordinator.full_attention_group_id = 1
    kv.coordinator.single_type_managers.append(kv.coordinator.single_type_managers[0])
    conn = SchedulerConnector(kv)
    conn.max_cache_hit(Req("a", 5))
    assert kv.lookups[0][1] == [1]


# ---------------------------------------------------------------- vLLM's own KV cache manager


@pytest.fixture(scope="module")
def vllm_kv():
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    init_none_hash(sha256)

    def make(num_blocks: int = 12, block_size: int = 8, hbs: int = 8):
        # vLLM's single-group coordinator requires hash_block_size == block_size.
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
        )
        cfg = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        manager = KVCacheManager(
            cfg, max_model_len=4096, scheduler_block_size=block_size, hash_block_size=hbs
        )
        return manager, get_request_block_hasher(hbs, sha256)

    return make


def _vllm_request(req_id, tokens, hasher, prompt_start=0):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=8, routed_experts_prompt_start=prompt_start)
    return Request(req_id, list(tokens), params, None, block_hasher=hasher)


def test_against_vllm_kv_cache_manager(vllm_kv):
    """Prefix reuse, pins, capacity and reset on vLLM's KVCacheManager and Request, with
    our connector and vLLM's fed the same calls and compared answer by answer."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from sim.compare import TeeSchedulerConnector

    manager, hasher = vllm_kv(num_blocks=6)
    conn = TeeSchedulerConnector(SchedulerConnector(manager), AuxOutputSchedulerConnector(manager))
    live = {}

    def run(req, n):
        blocks, hit, *_ = manager.get_computed_blocks(req, conn.max_cache_hit(req))
        assert manager.allocate_slots(req, n - hit, hit, blocks) is not None
        req.num_computed_tokens = hit
        live[req.request_id] = req
        meta = conn.build_connector_meta(sched(**{req.request_id: n - hit}), live)
        req.num_computed_tokens = n
        return hit, meta

    a = _vllm_request("a", range(20), hasher, prompt_start=3)
    hit, meta = run(a, 20)
    assert hit == 0 and meta.requests == {"a": 3}
    assert hashes(meta.block_hashes["a"]) == list(a.block_hashes[:2])
    conn.request_finished(a)
    manager.free(a)
    del live["a"]
    meta = conn.build_connector_meta(sched(), live)
    assert meta.finished_requests == ("a",)
    assert hashes(meta.retained_block_hashes) == list(a.block_hashes[:2])  # 2 full KV blocks

    b = _vllm_request("b", list(range(20)) + [7, 7, 7], hasher)
    hit, meta = run(b, 23)
    assert hit == 16 and meta.requests == {"b": 0}
    assert conn.cap_external_hit(b, 16, 0) == 0
    conn.request_finished(b)
    manager.free(b)
    del live["b"]
    # Push a's blocks off the GPU; pins beyond capacity (6) are released LRU first.
    released = []
    for i in range(4):
        c = _vllm_request(f"c{i}", range(100 + 50 * i, 140 + 50 * i), hasher)
        run(c, 40)
        conn.request_finished(c)
        manager.free(c)
        del live[c.request_id]
        released += hashes(conn.build_connector_meta(sched(), live).released_block_hashes)
    assert released[:2] == list(a.block_hashes[:2])
    assert conn.max_cache_hit(_vllm_request("p", range(20), hasher)) == 0
    assert manager.reset_prefix_cache()
    conn.reset()
    meta = conn.build_connector_meta(sched(), live)
    assert meta.generation == 1 and meta.retained_block_hashes is None
    assert conn.max_cache_hit(_vllm_request("p", range(20), hasher)) == 0
    assert conn.calls["max_cache_hit"] >= 8
