"""bench.kernel_bench without a GPU: its worker-style inputs and its correctness gate run on
tiny steps under the Triton interpreter (tests/conftest.py), so neither rots between GPU
runs; the timing path itself is gpu-marked."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from bench import kernel_bench as kb
from bench.models import QWEN3_30B_A3B, ModelShape

TINY = kb.Sizes(
    max_tokens=64, max_seqs=8, decode_reqs=(1, 5), prefill_chunks=2, spec_reqs=6, max_start=300
)
U8 = ModelShape("tiny-u8", 3, 2, 8)
U8_ALL_IDS = ModelShape("tiny-u8-256", 2, 2, 256)  # every uint8 value is an expert id
U16 = ModelShape("tiny-u16", 2, 3, 300)
CASES = [
    (model, block, kind)
    for model, block in ((U8, 16), (U16, 16), (U8_ALL_IDS, 5))
    for kind in kb.step_kinds(TINY)
]


def _case_id(case) -> str:
    model, block, kind = case
    return f"{model.name}-B{block}-{kind}"


def check_worker_inputs(step: kb.Step, sizes: kb.Sizes) -> None:
    """The inputs the worker would pass: a distinct request index per request (below
    max_num_seqs), each row's position on the device, and a queue of distinct arena slots,
    one per block of the step's accepted rows (every request new to its index)."""
    host = {k: v.cpu() for k, v in step.inputs.items() if v is not None}
    reqs, block = step.reqs, step.block
    rows = np.array([r.rows for r in reqs])
    starts = np.array([r.start for r in reqs])
    accepted = rows - np.array([r.rejected for r in reqs])
    qsl = host["query_start_loc"].numpy()
    assert qsl.tolist() == [0, *np.cumsum(rows).tolist()]
    assert step.num_rows <= sizes.max_tokens and len(reqs) <= sizes.max_seqs

    capture = host["capture"]
    assert capture.shape == (sizes.max_tokens, step.model.num_layers, step.model.top_k)
    assert capture.dtype == torch.int32
    assert 0 <= int(capture.min()) and int(capture.max()) < step.model.num_experts
    assert not (capture == kb.DEST_SENTINEL[step.model.dtype]).any()

    positions = host["positions"].numpy()
    expected = np.full(sizes.max_tokens, -1)
    for r, req in enumerate(reqs):
        expected[qsl[r] : qsl[r + 1]] = np.arange(req.start, req.start + req.rows)
    assert positions.tolist() == expected.tolist()

    index = host["request_index"].numpy()
    assert len(set(index.tolist())) == len(reqs)
    assert ((0 <= index) & (index < sizes.max_seqs)).all()
    assert step.num_indices == sizes.max_seqs
    assert step.ring_width == kb.ring_width(sizes.max_tokens, block)
    blocks = (starts + accepted - 1) // block - starts // block + 1
    assert (blocks <= step.ring_width).all()
    queue = step.queue_slots.numpy()
    assert queue.dtype == np.int32 and len(queue) == blocks.sum() == step.queue_size
    assert len(set(queue.tolist())) == len(queue), "two blocks of the step share a slot"
    assert ((0 <= queue) & (queue < step.num_slots)).all()

    rejected = host.get("num_rejected")
    if step.kind.startswith("spec"):
        assert rejected.tolist() == [r.rejected for r in reqs]
        assert all(0 <= r.rejected < r.rows for r in reqs)
    else:
        assert rejected is None and all(r.rejected == 0 for r in reqs)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_tiny_step_has_the_worker_inputs(case) -> None:
    model, block, kind = case
    check_worker_inputs(kb.build_step(model, kind, sizes=TINY, device="cpu", seed=7, block=block),
                        TINY)  # fmt: skip


@pytest.mark.parametrize("kind", kb.step_kinds(kb.GPU_SIZES))
def test_gpu_sized_step_has_the_worker_inputs(kind: str) -> None:
    # Built on the CPU at the GPU's sizes: what the GPU run will feed the kernel.
    step = kb.build_step(QWEN3_30B_A3B, kind, sizes=kb.GPU_SIZES, device="cpu", seed=1)
    check_worker_inputs(step, kb.GPU_SIZES)
    if kind == "prefill":
        assert step.num_rows == 8192
    if kind.startswith("decode"):
        assert step.num_rows == len(step.reqs) == int(kind.removeprefix("decode-"))


def test_gpu_sizes_cover_the_step_kinds_asked_for() -> None:
    assert kb.step_kinds(kb.GPU_SIZES) == [
        "decode-1", "decode-16", "decode-128", "decode-512", "prefill", "spec-k3",
    ]  # fmt: skip
    assert kb.GPU_SIZES.max_tokens == 8192


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gate_passes_on_tiny_steps(case) -> None:
    model, block, kind = case
    step = kb.build_step(model, kind, sizes=TINY, device="cpu", seed=3, block=block)
    assert kb.gate(step) is None
    # The expectation itself holds exactly the accepted rows, in both layouts.
    expected = kb.expected_outputs(step, kb.vllm_host_rows(step))
    sentinel = kb.DEST_SENTINEL[model.dtype]
    for what in ("slots", "rows"):
        written = expected[what].reshape(-1, model.row_elems) != sentinel
        assert written.all(axis=1).sum() == written.any(axis=1).sum() == step.accepted_rows


@pytest.mark.parametrize("kind", ["decode-5", "prefill", "spec-k3"])
def test_launcher_leaves_the_gates_bytes_launch_after_launch(kind: str) -> None:
    # bench_step times step.launcher (GatherAllocLaunch) and checks what the timed launches
    # left against the gate's expectation: that holds only if every launch writes the same
    # (each takes the same slots from the refilled queue).
    step = kb.build_step(U16, kind, sizes=TINY, device="cpu", seed=9)
    expected = kb.expected_outputs(step, kb.vllm_host_rows(step))
    for layout in ("slots", "rows"):
        dest, info = step.new_output(layout, "cpu"), step.new_output("info", "cpu")
        launch = step.launcher(dest, info)
        for _ in range(3):
            launch()
            assert kb.compare(expected, {"launcher": {layout: dest, "info": info}}) == []
    dest = step.new_output("slots", "cpu")
    step.launcher(dest, step.new_output("info", "cpu"))()
    dest.view(-1)[-1] = 0  # one uint16 id: two bytes
    size = 2 * dest.numel()
    assert kb.compare(expected, {"launcher": {"slots": dest}}) == [
        f"launcher slots: 2 of {size} bytes differ, first at byte {size - 2}"
    ]


def _spec_step() -> kb.Step:
    return kb.build_step(U8, "spec-k3", sizes=TINY, device="cpu", seed=5)


def test_gate_names_a_wrong_byte_in_the_kernel_arena(monkeypatch) -> None:
    real = kb.gather_alloc

    def flips_a_byte(**args):
        real(**args)
        if args["dest"].dim() == 4:
            args["dest"].view(-1)[0] ^= 1

    monkeypatch.setattr(kb, "gather_alloc", flips_a_byte)
    problem = kb.gate(_spec_step())
    assert problem is not None and "r3capture-kernel slots" in problem
    assert "reference" not in problem


def test_gate_names_a_missing_staging_row(monkeypatch) -> None:
    real = kb.gather_alloc

    def drops_row_0(**args):
        real(**args)
        if args["dest"].dim() == 3:
            args["dest"][0] = kb.DEST_SENTINEL[args["dest"].dtype]

    monkeypatch.setattr(kb, "gather_alloc", drops_row_0)
    problem = kb.gate(_spec_step())
    assert problem is not None and problem.startswith("r3capture-staging rows")


def test_gate_checks_placement_against_the_hosts_positions() -> None:
    # A device position off by one moves a request's rows: every implementation follows
    # the device, so only an expectation from the scheduler's view can see it.
    step = kb.build_step(U8, "prefill", sizes=TINY, device="cpu", seed=2)
    step.inputs["positions"][: step.reqs[0].rows] += 1
    problem = kb.gate(step)
    assert problem is not None and "reference" in problem


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, run() times every step")
def test_run_without_cuda_gates_every_kind_and_times_nothing(capsys) -> None:
    rows, failures = kb.run(models=(U8,), sizes=TINY)
    assert rows == [] and failures == []
    out = capsys.readouterr().out
    assert out.count("byte-equal") == len(kb.step_kinds(TINY))
    assert "timings need a GPU" in out


def test_host_cost_times_the_calling_threads_work_per_call() -> None:
    calls = []
    cheap = kb.host_cost(lambda: calls.append(None), torch.device("cpu"), calls=300)
    assert len(calls) == kb.HOST_WARMUP + 300
    # Sorting 200k floats costs this thread far more than appending to a list.
    values = torch.rand(200_000)
    costly = kb.host_cost(lambda: torch.sort(values), torch.device("cpu"), calls=30)
    for p50, p20, p80 in (cheap, costly):
        assert 0 <= p20 <= p50 <= p80
    assert costly[0] > 10 * cheap[0] and costly[0] > 0


def test_host_cost_does_not_count_time_the_thread_sleeps() -> None:
    # Thread CPU time: a wait (for the device, or here a sleep) costs the thread nothing.
    p50, _, _ = kb.host_cost(lambda: time.sleep(0.002), torch.device("cpu"), calls=20)
    assert p50 < 1000  # us; the wall time of each call is >= 2000 us


@pytest.mark.gpu
def test_bench_step_times_every_provider_on_gpu() -> None:
    sizes = kb.Sizes(512, 32, (32,), 2, 32, 5_000)
    peaks = {"hbm_gbps": 1.0, "pcie_gbps": 1.0}
    for kind in kb.step_kinds(sizes):
        step = kb.build_step(U16, kind, sizes=sizes, device="cuda", seed=11)
        assert kb.gate(step) is None
        rows, problem = kb.bench_step(step, peaks)
        assert problem is None
        providers = [r.provider for r in rows]
        assert providers[0] == "r3capture-kernel"
        assert providers[-5:] == [
            "vllm-cast", "vllm", "r3capture-launch", "vllm-cast-launch", "launch-stand-in"
        ]  # fmt: skip
        assert {r.params["timing"] for r in rows[-3:]} == {"host"}
        assert "r3capture-staging" in providers
        for r in rows:
            assert r.p20 <= r.p50 <= r.p80 and r.p50 > 0
            assert math.isfinite(r.params["speedup_vs_vllm"])
            assert r.params["gate"] == "byte-equal"
