"""``python -m sim.sweep``: random traces of random engine shapes, r3capture against vLLM 0.33.0.

Each seed draws, deterministically, an engine shape (hash and KV block sizes, depth, drafts,
batch and token budgets, CUDA-graph padding, a KV connector that must deliver), a
``random_trace`` of that shape, and how
r3capture runs it: destination, whether rejected counts reach the launch on the device,
the order ``process_output`` takes against the step thread's calls, and the tuning
constants that choose between a loop over Python ints and the vector pass of each
operation (slot lookahead, the rows a request may reattach below the scheduler's start,
the per-request thresholds of the commit, the emit, slot taking and window reads). Every
alternative of an operation must give the same bytes, so drawing the constants checks the
paths against each other as well as against vLLM.

A seed passes when r3capture's outputs and errors equal vLLM's step by step, and both give
the routing oracle's rows. vLLM's worker must run the trace clean, except at depth 3, where
an error it raises passes when r3capture raises the same at the same step. Where only vLLM's
worker fails (an error, or rows off the oracle) and r3capture's rows are the oracle's
(``sim.compare.only_reference_fails``), the seed passes and is counted apart: with
``kv_delivery`` (a KV connector whose hand-off must be delivered) the scheduler may resume
a preempted request while its earlier run is in flight, which vLLM's worker gets wrong
(``tests/aux_output/test_resumed_requests.py``). The first failure of each seed is printed
with the line that repeats it (``--seeds S:S+1``); the exit status is 1 when any seed
failed.

    python -m sim.sweep [--seeds A:B] [--stop-first]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

from sim.compare import diff_results, only_reference_fails
from sim.engine import SimResult, run_trace
from sim.trace import ROLLOUTS, random_trace
from sim.workers import make_vllm_worker, r3capture_worker_factory

# The module of each tuning constant a seed draws; each reads its constant at call time.
_KNOB_HOMES = {
    "REATTACH_TOKENS": "r3capture.aux_output.sizing",
    "PER_REQUEST_MAX": "r3capture.aux_output.small_step",
    "PER_ROW_MAX": "r3capture.aux_output.publisher",
    "EMIT_LIST_MAX": "r3capture.aux_output.call_checks",
    "REMOVE_PER_ROW_MAX": "r3capture.aux_output.request_table",
}


@dataclass(frozen=True)
class SweepCase:
    """What one seed runs: ``shape`` (``random_trace`` overrides), r3capture's options and
    the tuning constants patched for its run (``knobs``, name -> value)."""

    seed: int
    shape: dict[str, int]
    destination: str
    pass_num_rejected: bool
    interleave_seed: int | None
    knobs: dict[str, int] = field(default_factory=dict)
    rollout: str | None = None

    def describe(self) -> str:
        knobs = " ".join(f"{k}={v}" for k, v in sorted(self.knobs.items()))
        return (
            f"seed {self.seed}: shape {self.shape}, destination {self.destination}, "
            f"device rejections {self.pass_num_rejected}, interleave {self.interleave_seed}, "
            f"rollout {self.rollout}, {knobs}"
        )


def draw_case(seed: int) -> SweepCase:
    """The shape, options and tuning constants of ``seed`` (the same on every machine)."""
    r = random.Random(f"sim.sweep/{seed}")
    hash_block = r.choice([1, 2, 3, 5, 8, 16])
    depth = r.choice([1, 2, 2, 3])
    drafts = r.choice([0, 0, 1, 3, 5])
    shape = {
        "hash_block_size": hash_block,
        "block_size": hash_block * r.choice([1, 2]),
        "max_concurrent_batches": depth,
        "num_spec_tokens": drafts,
        "max_num_seqs": r.choice([1, 2, 8, 32, 128]),
        "max_num_batched_tokens": r.choice([8, 16, 64, 512, 2048]),
        "pad_tokens_to": r.choice([0, 0, 8]),
        "kv_delivery": r.random() < 0.25,
    }
    # At depth 3 auto picks staging, and an explicit direct refuses a step scheduled over
    # rows of a step still in flight (step_commit.check_not_overwritten); the draws leave
    # direct out there.
    destinations = ["auto", "staging"] if depth >= 3 else ["auto", "staging", "direct"]
    # The factory refuses a device ring too narrow for the drafts a request may reattach by.
    min_reattach = max(depth - 1, 1) * drafts
    knobs = {
        "REATTACH_TOKENS": max(min_reattach, r.choice([0, 3, 8, 256])),
        "PER_REQUEST_MAX": r.choice([0, 1, 32, 1000]),
    }
    # A draw that chose a knob since removed (the emitted rows' own small form): kept, so
    # every later draw of a seed is what it was.
    r.choice([0, 1, 8, 1000])
    destination = r.choice(destinations)
    pass_num_rejected = r.random() < 0.5
    interleave_seed = r.randrange(2**31) if r.random() < 0.5 else None
    # Drawn last, so every earlier draw of a seed is what it was before this knob.
    knobs["PER_ROW_MAX"] = r.choice([0, 1, 8, 1000])
    # Drawn after that for the same reason: half the seeds reshaped as RL rollouts.
    rollout = r.choice([None, None, *ROLLOUTS])
    # A retired knob's draw (the key objects' second form), kept so later draws stay.
    r.choice([0, 1, 32, 1000])
    # And after that: the emit starts' Python-int form (0: always the array).
    knobs["EMIT_LIST_MAX"] = r.choice([0, 1, 32, 1000])
    # And after that: the request table's per-row removal (0: always the vector form).
    knobs["REMOVE_PER_ROW_MAX"] = r.choice([0, 1, 8, 1000])
    return SweepCase(
        seed=seed,
        shape=shape,
        destination=destination,
        pass_num_rejected=pass_num_rejected,
        interleave_seed=interleave_seed,
        knobs=knobs,
        rollout=rollout,
    )


@contextlib.contextmanager
def patched_knobs(knobs: dict[str, int]) -> Iterator[None]:
    """The tuning constants set to ``knobs`` for the duration."""
    with contextlib.ExitStack() as stack:
        for name, value in knobs.items():
            module = importlib.import_module(_KNOB_HOMES[name])
            stack.enter_context(mock.patch.object(module, name, value))
        yield


# What run_case returns for a seed whose trace the simulator's scheduler never finishes (a
# KV connector that must deliver makes preempted requests resume at once and, with very
# little KV, preempt each other for ever): there is nothing to compare.
SIM_UNFINISHED = "the simulator did not finish the trace"
# What run_case returns for a seed where vLLM's worker fails (an error, or rows off the
# routing oracle) and r3capture's runs clean with the oracle's rows.
VLLM_WRONG = "vLLM 0.33.0's worker fails; r3capture's rows are the routing oracle's"


def run_case(case: SweepCase) -> str | None:
    """Run one case; None when it passes, ``VLLM_WRONG`` when only vLLM's worker fails,
    ``SIM_UNFINISHED`` when the simulator could not finish the trace, else what failed
    first."""
    trace = random_trace(case.seed, rollout=case.rollout, **case.shape)
    ref = run_trace(
        trace, make_vllm_worker, interleave_seed=case.interleave_seed, catch_errors=True,
        check=False,
    )  # fmt: skip
    factory = r3capture_worker_factory(
        kernel_impl="reference",
        destination=case.destination,
        pass_num_rejected=case.pass_num_rejected,
    )
    with patched_knobs(case.knobs):
        got = run_trace(
            trace, factory, interleave_seed=case.interleave_seed, catch_errors=True, check=False
        )
    difference = diff_results(ref, got)
    if difference is not None and _unfinished(got):
        return SIM_UNFINISHED
    if difference is not None:
        return VLLM_WRONG if only_reference_fails(ref, got) else difference
    if ref.error is not None:
        if case.shape["max_concurrent_batches"] >= 3:
            return None  # vLLM's own assertion, raised alike by both workers
        return f"vLLM's worker failed (r3capture alike): {ref.error}"
    try:
        ref.check_ground_truth()
        got.check_ground_truth()
    except AssertionError as exc:
        return f"rows differ from the routing oracle: {exc}"
    return None


def _unfinished(result: SimResult) -> bool:
    """Whether the run ended at the simulator's step limit (no worker call failed)."""
    error = result.error
    return (
        error is not None
        and error.phase == "engine"
        and isinstance(error.exc, RuntimeError)
        and "did not finish" in str(error.exc)
    )


def _seed_range(text: str) -> range:
    try:
        first, _, last = text.partition(":")
        seeds = range(int(first), int(last)) if last else range(int(first), int(first) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes A:B or A, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"--seeds {text!r} names no seed")
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.sweep", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--seeds", type=_seed_range, default=range(0, 200), help="A:B (default 0:200)"
    )
    parser.add_argument("--stop-first", action="store_true", help="stop at the first failing seed")
    args = parser.parse_args(argv)
    failed = vllm_wrong = unfinished = 0
    started = time.perf_counter()
    for done, seed in enumerate(args.seeds, 1):
        case = draw_case(seed)
        problem = run_case(case)
        if problem == SIM_UNFINISHED:
            unfinished += 1
            print(f"not finished by the simulator: {case.describe()}", flush=True)
        elif problem == VLLM_WRONG:
            vllm_wrong += 1
            print(f"vLLM fails, r3capture right: {case.describe()}", flush=True)
        elif problem is not None:
            failed += 1
            print(f"FAILED {case.describe()}\n  {problem}\n  repeat: python -m sim.sweep "
                  f"--seeds {seed}:{seed + 1}", flush=True)  # fmt: skip
            if args.stop_first:
                break
        if done % 100 == 0:
            elapsed = time.perf_counter() - started
            print(f"{done} seeds, {failed} failed, {elapsed:.0f} s", flush=True)
    print(f"{done} seeds ({args.seeds.start}:{seed + 1}), {failed} failed, {vllm_wrong} where "
          f"only vLLM fails, {unfinished} the simulator did not finish, "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
