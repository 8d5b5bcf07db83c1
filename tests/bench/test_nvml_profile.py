"""bench.nvml_profile without a GPU: every provider's per-step work and its check run on a
CPU device (Triton interpreter) at tiny limits, and the profile's own step plans are built
at its real limits, so the GPU-only measurement cannot rot unseen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import nvml_profile as nv
from bench.kernel_bench import ring_width

TINY = nv.Limits(max_tokens=64, max_seqs=8, block=4)
U8 = (3, 2, 8)
U16 = (2, 3, 300)


def _steps(limits: nv.Limits):
    rng = np.random.default_rng(0)
    for step in nv.profile_steps(rng, limits):
        yield step, nv.plan_step(step, rng, limits)


@pytest.mark.parametrize("model", [U8, U16], ids=["u8", "u16"])
@pytest.mark.parametrize("provider", nv.PROVIDERS)
def test_provider_steps_pass_their_check_on_cpu(provider: str, model) -> None:
    state = nv.Provider(provider, model, TINY, "cpu")
    for i, (step, plan) in enumerate(_steps(TINY)):
        state.run(step, plan)
        assert state.check(step, plan) is None, f"step {i}"
        if provider.startswith("r3capture"):
            # The ring rows of the step's request indices hold the slots its blocks took.
            ring = state.side._ring.cpu().numpy()
            last_of = np.cumsum(plan.block_hi - plan.block_lo + 1) - 1
            entries = ring[plan.request_index, plan.block_hi % ring.shape[1]]
            assert (entries >> 32).tolist() == plan.block_hi.tolist()
            assert (entries & 0xFFFFFFFF).tolist() == plan.block_slots[last_of].tolist()


@pytest.mark.parametrize("limits", [TINY, nv.PROFILE], ids=["tiny", "profile"])
def test_plans_are_the_workers(limits: nv.Limits) -> None:
    width = ring_width(limits.max_tokens, limits.block)
    kinds = set()
    for step, plan in _steps(limits):
        rows, starts, B = step.rows, step.starts, limits.block
        kinds.add((len(rows), plan.num_rows, step.speculative))
        assert plan.num_rows <= limits.max_tokens and len(rows) <= limits.max_seqs
        assert plan.qsl.tolist() == [0, *np.cumsum(rows).tolist()]
        assert plan.positions.tolist() == [
            s + i for s, n in zip(starts.tolist(), rows.tolist()) for i in range(n)
        ]
        accepted = rows - step.rejected
        assert (plan.block_lo == starts // B).all()
        assert (plan.block_hi == (starts + accepted - 1) // B).all()
        assert (plan.block_hi - plan.block_lo < width).all()
        assert len(set(plan.request_index.tolist())) == len(rows)
        assert plan.request_index.max() < limits.max_seqs
        num_blocks = int((plan.block_hi - plan.block_lo + 1).sum())
        assert len(plan.block_slots) == num_blocks
        assert len(set(plan.block_slots.tolist())) == num_blocks  # distinct slots
        assert plan.block_slots.max() < limits.max_slots
        assert ((0 <= step.rejected) & (step.rejected < rows)).all()
    n = limits.max_seqs
    assert kinds == {(n, n, False), (4, limits.max_tokens, False), (n, 4 * n, True)}


def _flip(array) -> None:
    array.reshape(-1)[3] ^= 1


@pytest.mark.parametrize(
    ("provider", "corrupt", "message"),
    [
        ("r3capture-pinned", lambda s: _flip(s.arena.numpy()), "arena"),
        ("r3capture-pinned", lambda s: _flip(s.info_host.numpy()), "step_info"),
        ("r3capture-staging", lambda s: _flip(s.staging_host.numpy()), "staging"),
        ("vllm", lambda s: _flip(s.snapshot_host), "vllm snapshot"),
    ],
    ids=["arena", "step_info", "staging", "vllm"],
)
def test_check_reports_a_wrong_byte(provider: str, corrupt, message: str) -> None:
    state = nv.Provider(provider, U8, TINY, "cpu")
    step, plan = next(_steps(TINY))
    state.run(step, plan)
    assert state.check(step, plan) is None
    state.run(step, plan)
    corrupt(state)
    problem = state.check(step, plan)
    assert problem is not None and message in problem


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine measures instead")
def test_main_without_a_gpu_says_so_in_one_line(capsys) -> None:
    assert nv.main([]) in (nv.EXIT_NO_NVML, nv.EXIT_NO_TORCH_CUDA)
    out = capsys.readouterr().out.strip()
    assert out.startswith("nvml_profile:") and "nothing to measure" in out
    assert len(out.splitlines()) == 1
