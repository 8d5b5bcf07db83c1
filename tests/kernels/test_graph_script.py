"""The CUDA-graph replay script of test_gather_alloc_gpu.py, run on the CPU without the
graph: one set of static tensors, each launch's inputs, state and poisoned outputs loaded
into them, the same launch repeated with the host-side values (serial, queue tail, counts)
fixed at capture. A graph replays exactly that."""

from __future__ import annotations

import pytest
from gather_alloc_cases import (
    STEP_INPUTS,
    assert_state,
    build,
    clone_args,
    graph_script,
    load_step,
    prepared_launch,
)

from r3capture.kernels import gather_alloc


def _launcher(static: dict, via: str):
    """gather_alloc over ``static``: one-shot, or the worker's GatherAllocLaunch built once."""
    if via == "prepared":
        return prepared_launch(static, impl="triton")
    return lambda: gather_alloc(**static, impl="triton")


@pytest.mark.parametrize("via", ["one-shot", "prepared"])
@pytest.mark.parametrize("rows_layout", [False, True], ids=["slots", "rows"])
def test_steps_replayed_through_static_tensors(rows_layout: bool, via: str) -> None:
    (case, seed), *replays = graph_script(rows_layout)
    static = clone_args(build(case, seed=seed)["args"])
    launch = _launcher(static, via)
    launch()  # the launch a graph would capture
    for case, seed in replays:
        fresh = build(case, seed=seed)
        load_step(static, fresh["args"])
        launch()
        assert_state(case.id, static, fresh["expected"])


def test_every_replay_changes_every_input_the_kernel_reads() -> None:
    # Otherwise a replay that read a stale captured value could still pass.
    (case, seed), *replays = graph_script()
    static = clone_args(build(case, seed=seed)["args"])
    for case, seed in replays:
        changed = load_step(static, build(case, seed=seed)["args"])
        assert set(STEP_INPUTS) <= changed, f"{case.id}: {set(STEP_INPUTS) - changed}"


def test_load_step_refuses_a_step_the_graph_cannot_replay() -> None:
    (first, _), (second, _), *_ = graph_script()
    static, other = build(first)["args"], build(second)["args"]
    with pytest.raises(AssertionError, match="num_reqs"):
        load_step(static, dict(other, num_reqs=2))
    with pytest.raises(AssertionError, match="dest"):
        load_step(static, dict(other, dest=other["dest"][:-1]))
    with pytest.raises(AssertionError, match="launch"):
        load_step(static, dict(other, launch=other["launch"] + 1))
