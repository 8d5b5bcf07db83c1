"""Trace-driven capture demo: one scenario through vLLM 0.33.0's worker connector and
r3capture's, with a short report (requests, rows, bytes vLLM copies vs accepted bytes,
host time in the worker calls, agreement)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from sim.compare import diff_results
from sim.engine import SimResult, run_trace
from sim.trace import SCENARIOS, make_trace
from sim.workers import make_vllm_worker, r3capture_worker_factory


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def run_demo_trace(
    scenario: str = "async_spec",
    *,
    seed: int = 0,
    size: str = "small",
    workers: tuple[str, ...] = ("vllm", "r3capture"),
    kernel_impl: str = "reference",
    print_report: bool = True,
) -> dict[str, Any]:
    """Run ``scenario`` through each worker in ``workers`` ("vllm", "r3capture"), check
    every run against the routing oracle, compare the runs step by step, print a report
    and return it as a dict (``runs``: per worker stats; ``agree``: None or the first
    difference)."""
    trace = make_trace(scenario, seed, size)
    factories = {
        "vllm": make_vllm_worker,
        "r3capture": r3capture_worker_factory(kernel_impl=kernel_impl),
    }
    results: dict[str, SimResult] = {}
    wall: dict[str, float] = {}
    for name in workers:
        t0 = time.perf_counter()
        results[name] = run_trace(trace, factories[name], catch_errors=True, check=False)
        wall[name] = time.perf_counter() - t0
    report: dict[str, Any] = {"scenario": scenario, "seed": seed, "size": size, "runs": {}}
    for name, result in results.items():
        checked: int | str | None = None
        if result.error is None:
            try:
                checked = result.check_ground_truth()
            except AssertionError as exc:
                checked = f"FAILED: {exc}"
        st = result.stats
        report["runs"][name] = {
            "requests": len(result.final_tokens),
            "steps": st.steps,
            "rows_scheduled": st.rows_scheduled,
            "rows_accepted": st.rows_accepted,
            "rows_returned": st.emitted_rows,
            "rows_checked": checked,
            "bytes_copied_by_vllm": st.bytes_copied_vllm,
            "bytes_accepted": st.bytes_accepted,
            "worker_seconds": st.worker_seconds,
            "wall_seconds": wall[name],
            "error": None if result.error is None else f"{result.error.kind}: {result.error.exc}",
        }
    names = list(results)
    report["agree"] = (
        diff_results(results[names[0]], results[names[1]]) if len(names) == 2 else None
    )
    if print_report:
        _print(report, trace, results[names[0]])
    return report


def _print(report: dict[str, Any], trace: Any, first: SimResult) -> None:
    model, cfg, st = trace.model, trace.config, first.stats
    print(
        f"r3capture trace demo: scenario={report['scenario']} seed={report['seed']} "
        f"size={report['size']}  rows [L={model.num_layers}, K={model.top_k}] "
        f"{model.dtype.name}  max_concurrent_batches={cfg.max_concurrent_batches} "
        f"num_spec_tokens={cfg.num_spec_tokens}"
    )
    print(
        f"  exercised: preemptions={st.preemptions} prefix_hit_tokens={st.prefix_hit_tokens} "
        f"external_hit_tokens={st.external_hit_tokens} rejected_drafts={st.rejected_drafts} "
        f"reattached_rows={st.reattach_rows} resets={st.resets} aborts={st.aborts}"
    )
    copied, accepted = st.bytes_copied_vllm, st.bytes_accepted
    print(
        f"  requests={len(first.final_tokens)} steps={st.steps} rows scheduled="
        f"{st.rows_scheduled} accepted={st.rows_accepted}; bytes vLLM copies to the host "
        f"(every scheduled row) {_mib(copied)}, accepted rows {_mib(accepted)} "
        f"({100 * accepted / max(copied, 1):.0f}%)"
    )
    for name, run in report["runs"].items():
        print(
            f"  {name:10s} rows returned={run['rows_returned']} oracle-checked="
            f"{run['rows_checked']} host time in worker calls "
            f"{1e3 * run['worker_seconds']:.1f} ms"
            + (f"; ERROR {run['error']}" if run["error"] else "")
        )
    if len(report["runs"]) == 2:
        verdict = "byte-identical" if report["agree"] is None else report["agree"]
        print(f"  outputs vLLM vs r3capture: {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim")
    parser.add_argument("scenario", nargs="?", default="async_spec", choices=sorted(SCENARIOS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", default="small", choices=["tiny", "small", "medium", "large"])
    parser.add_argument("--workers", default="vllm,r3capture")
    parser.add_argument("--kernel-impl", default="reference")
    args = parser.parse_args(argv)
    report = run_demo_trace(
        args.scenario,
        seed=args.seed,
        size=args.size,
        workers=tuple(w for w in args.workers.split(",") if w),
        kernel_impl=args.kernel_impl,
    )
    ok = report["agree"] is None and all(
        r["error"] is None and isinstance(r["rows_checked"], int) for r in report["runs"].values()
    )
    return 0 if ok else 1


__all__ = ["main", "run_demo_trace"]
