"""Host time per engine step, by thread: vLLM 0.33.0's worker connector vs r3capture's.

Every host microsecond a connector spends, per step, on the thread it runs on:

* main thread: ``begin_step`` + ``prepare_output`` + ``enqueue_cpu_copy`` (in Model Runner V2
  they run on the thread that launches the next forward: the critical path);
* output thread: ``process_output``;
* background threads: CPU time of threads the connector started (vLLM's store writer,
  ``vllm-aux-output-writer``), counted on the output side;
* all host work: the three together.

Method (details in ``bench/host_step_replay.py`` and ``bench/stand_ins.py``):

1. Each trace family (``bench/host_step_families.py``) runs once through the simulator with
   vLLM's scheduler and worker connectors; every worker call is recorded in order
   (``sim/recording.py``) and cached under ``bench/.cache/host_step/``.
2. Each connector replays the recordings in its own fresh process (one process per
   connector, model and depth replays every family, a fresh connector per trace),
   processes alternating vLLM, r3capture, vLLM, ... for ``--repeats`` rounds. This process
   only orchestrates and aggregates.
3. GPU work is replaced by the same launch stand-in on both sides; outputs are digested per
   step; a trace whose digests differ between connectors (or from the simulator's) gets no
   ratio. The other connector shadows the timed one: it makes every call too, untimed,
   just before the timed one's, so both sides' calls follow the same CPU work (r3capture's
   kernel emulation included; ``bench/host_step_replay.py`` says why). ``--alone``
   replays each connector by itself instead (``host_step_alone.json``).
4. Per step and metric, the median over the repeats; then p50/p20/p80/p90 over the trace's
   steps and whole-trace totals, for all steps and per step kind. Both clocks are kept;
   the headline is thread CPU time (see ``bench/RESULTS.md``).

    python -m bench.run host_step [--quick] [--repeats N] [--families A,B] [--models A,B]
        [--max-num-seqs N]

A what-if run, ``--free input-checks`` (``bench/stand_ins.ABLATIONS``),
times r3capture as if those parts of its host work cost nothing; it is written as
``host_step_free_<parts>.json`` so the measured run stays apart. ``--max-num-seqs 1024``
(vLLM's serve default on H100/H200-class GPUs) replaces every family's own, which sizes
both connectors and caps the requests run at once; written as ``host_step_seqs<N>.json``.
r3capture's kernel emulation runs where the host would next wait for the device (before the
step's ``process_output``, before the next step's rows, before the store replaces its
arena), as a GPU runs the kernel while the host goes on; ``--inline-kernel`` runs it inside
``prepare_output`` instead, off the clock (``host_step_inline.json``).
``--busy`` runs every replay beside one busy process (a Python loop that never sleeps), as
a worker shares its cores with the engine's busy loop, tokenizers and other ranks; the
tail (p99, max per step) is what it moves; ``host_step_busy.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS_DIR, Result, make_result, write_results
from bench.host_step_families import FAMILIES, QUICK_FAMILIES
from bench.host_step_families import family as named_family
from bench.host_step_replay import CALLS
from bench.models import MODELS as MODEL_SHAPES
from bench.stand_ins import ABLATIONS

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(__file__).resolve().parent / ".cache" / "host_step"
VLLM, OURS = PROVIDERS = ("vllm-0.33.0", "r3capture")
# The headline's two models; ``--models`` takes any shape of ``bench.models``.
MODELS = ("Qwen3-30B-A3B", "Kimi-K2")
KNOWN_MODELS = tuple(shape.name for shape in MODEL_SHAPES)
DEPTHS = (2, 1)
METRICS = ("main", "process", "background", "output", "all")
KIND_METRICS = ("main", "output", "all")  # per-kind statistics for these
# Index of the headline clock in (wall, cpu) pairs, and its name.
HEADLINE, HEADLINE_NAME = 1, "thread CPU"


def _child(args: list[str]) -> str:
    """Run ``python -m bench.host_step_replay ARGS`` from the repository root; its stdout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.host_step_replay", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    for line in proc.stderr.splitlines():
        if line.startswith("  "):
            print(line, flush=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise RuntimeError(f"child process failed ({proc.returncode}): {' '.join(args[:6])}")
    return proc.stdout


# ---------------------------------------------------------------------------- aggregation


def _per_step(trace: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per-step (wall, cpu) ns of every metric for one replay: float ``[steps, 2]``."""
    calls = trace["calls"].astype(np.float64)
    background = trace["background"].astype(np.float64)
    main = calls[0] + calls[1] + calls[2]
    process = calls[3]
    # A background thread's CPU time is its only clock: it stands for wall time too.
    bg = np.stack([background, background], axis=1)
    output = process + bg
    return {"main": main, "process": process, "background": bg, "output": output,
            "all": main + output}  # fmt: skip


def _same_outputs(meta: dict, runs: dict[str, list[dict]]) -> tuple[bool, str]:
    expected = [tuple(d) for d in meta["digests"]]
    for provider, replays in runs.items():
        for index, trace in enumerate(replays):
            if trace["error"] is not None:
                return False, f"{provider} run {index}: error {trace['error']}"
            if [tuple(d) for d in trace["digests"]] != expected:
                got = [tuple(d) for d in trace["digests"]]
                first = next(
                    (i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                    min(len(got), len(expected)),
                )
                step = expected[first][0] if first < len(expected) else "end"
                return False, f"{provider} run {index}: outputs differ from step {step}"
    return True, ""


def _ratio(theirs: float, ours: float) -> float | None:
    return theirs / ours if ours > 0 and theirs > 0 else None


def _stats(values: np.ndarray) -> dict[str, float]:
    """p50/p90/total of per-step (wall, cpu) ns values ``[n, 2]``, in us and ms."""
    p50 = np.median(values, axis=0) / 1e3
    p90 = np.percentile(values, 90, axis=0) / 1e3
    total = values.sum(axis=0) / 1e6
    return {"p50": round(float(p50[0]), 2), "p90": round(float(p90[0]), 2),
            "total_ms": round(float(total[0]), 4), "cpu_p50": round(float(p50[1]), 2),
            "cpu_p90": round(float(p90[1]), 2),
            "cpu_total_ms": round(float(total[1]), 4)}  # fmt: skip


def _tail(repeats: list[np.ndarray]) -> dict[str, float]:
    """p99 and max per step of each repeat's own steps (``[n, 2]`` (wall, cpu) ns each),
    in us, the median over the repeats: a run's tail, which the per-step median over repeats
    would smooth away (a descheduled thread, a collection, a busy neighbour)."""
    p99 = np.median([np.percentile(values, 99, axis=0) for values in repeats], axis=0) / 1e3
    peak = np.median([values.max(axis=0) for values in repeats], axis=0) / 1e3
    return {"p99": round(float(p99[0]), 2), "max": round(float(peak[0]), 2),
            "cpu_p99": round(float(p99[1]), 2), "cpu_max": round(float(peak[1]), 2)}  # fmt: skip


def _add_ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """``ratio_p50``... ``cpu_ratio_total`` = vLLM / r3capture, into ``ours``."""
    for clock in ("", "cpu_"):
        for stat in ("p50", "p90", "p99", "step_p99", "max", "total_ms"):
            if clock + stat not in ours or clock + stat not in theirs:
                continue
            name = f"{clock}ratio_{stat.removesuffix('_ms')}"
            ratio = _ratio(theirs[clock + stat], ours[clock + stat])
            ours[name] = None if ratio is None else round(ratio, 4)


def _summaries(
    meta: dict, runs: dict[str, list[dict]], identical: bool
) -> tuple[list[Result], dict[str, tuple[Result, Result]]]:
    """One Result row per (provider, metric) of one trace, with per-kind statistics in
    ``params["kinds"]``, and ``{metric: (vLLM row, r3capture row)}``.

    Per step, the median over the repeats. p50/p20/p80/p90 are over the trace's steps (for
    ``process``/``output``: the steps with a ``process_output``); totals over all steps;
    p99 and max over each repeat's steps, then the median over the repeats (``_tail``).
    ``step_p99``: the p99 over the trace's steps of each step's median, the tail that the
    trace's own steps make (a block's publication, a finishing request) without the
    repeats' one-off spikes; beside ``p99``, which keeps them.
    """
    kinds = np.array(meta["kinds"])
    processed = np.zeros(len(kinds), bool)
    processed[[step for step, _ in meta["digests"]]] = True
    kind_names = list(dict.fromkeys(meta["kinds"]))
    per_provider = {}
    per_call = {}
    for provider, replays in runs.items():
        steps = [_per_step(trace) for trace in replays]
        per_provider[provider] = {
            metric: (
                np.median(np.stack([s[metric] for s in steps]), axis=0),
                np.stack([s[metric].sum(axis=0) for s in steps]) / 1e6,
                [s[metric] for s in steps],
            )
            for metric in METRICS
        }
        # The main thread's calls one by one: begin_step on every step, the other two on
        # the steps with a forward (every one of which is processed).
        calls = np.median(np.stack([t["calls"].astype(np.float64) for t in replays]), axis=0)
        per_call[provider] = {
            name: _stats(calls[i][processed if i else np.ones(len(kinds), bool)])
            for i, name in enumerate(CALLS[:3])
        }
    rows: list[Result] = []
    pairs: dict[str, tuple[Result, Result]] = {}
    for metric in METRICS:
        sampled = processed if metric in ("process", "output") else np.ones(len(kinds), bool)
        pair = []
        for provider in PROVIDERS:
            per_step, repeat_totals, repeat_steps = per_provider[provider][metric]
            values = per_step[sampled]
            kind_stats = {}
            for kind in kind_names if metric in KIND_METRICS else ():
                mask = (kinds == kind) & sampled
                if mask.any():
                    kind_stats[kind] = {"steps": int(mask.sum()), **_stats(per_step[mask])}
            whole = _stats(per_step)
            tail = _tail([steps[sampled] for steps in repeat_steps])
            row = make_result(
                "host_step",
                metric,
                meta["shape"],
                meta["dtype"],
                provider,
                values,
                family=meta["family"],
                model=meta["model"],
                depth=meta["depth"],
                metric=metric,
                steps=int(sampled.sum()),
                trace_steps=len(kinds),
                repeats=len(replays),
                p90=round(float(np.percentile(values[:, 0], 90)) / 1e3, 2),
                cpu_p90=round(float(np.percentile(values[:, 1], 90)) / 1e3, 2),
                step_p99=round(float(np.percentile(values[:, 0], 99)) / 1e3, 2),
                cpu_step_p99=round(float(np.percentile(values[:, 1], 99)) / 1e3, 2),
                **tail,
                total_ms=whole["total_ms"],
                cpu_total_ms=whole["cpu_total_ms"],
                total_ms_repeats=[round(float(t), 3) for t in repeat_totals[:, 0]],
                cpu_total_ms_repeats=[round(float(t), 3) for t in repeat_totals[:, 1]],
                identical=identical,
                kinds=kind_stats,
            )
            if metric == "main":
                row.params["calls"] = per_call[provider]
            pair.append(row)
        theirs, ours = pair
        if identical and metric != "background":
            top = {"p50": ours.p50, **ours.params}
            _add_ratios(top, {"p50": theirs.p50, **theirs.params})
            ours.params.update({k: v for k, v in top.items() if "ratio_" in k})
            for kind, stats in ours.params["kinds"].items():
                if kind in theirs.params["kinds"]:
                    _add_ratios(stats, theirs.params["kinds"][kind])
            for name, stats in ours.params.get("calls", {}).items():
                _add_ratios(stats, theirs.params["calls"][name])
        rows.extend(pair)
        pairs[metric] = (theirs, ours)
    return rows, pairs


def _fmt_ratio(value: float | None) -> str:
    return "  --  " if value is None else f"{value:5.2f}x"


def _print_trace(meta: dict, pairs: dict, identical: bool, reason: str) -> None:
    h = "cpu_" if HEADLINE == 1 else ""
    name = f"{meta['model']:14s} d{meta['depth']} {meta['family']:17s}"
    if not identical:
        print(f"{name} OUTPUTS DIFFER ({reason}): no ratio", flush=True)
        return
    cells = []
    for metric in ("main", "output", "all"):
        theirs, ours = pairs[metric]
        p50_v = theirs.params["cpu_p50"] if HEADLINE else theirs.p50
        p50_o = ours.params["cpu_p50"] if HEADLINE else ours.p50
        cells.append(
            f"{metric} p50 {p50_v:7.0f}/{p50_o:6.0f} us {_fmt_ratio(ours.params[h + 'ratio_p50'])}"
            f" total {_fmt_ratio(ours.params[h + 'ratio_total'])}"
        )
    worst = []
    for metric in ("main", "output"):
        for kind, stats in pairs[metric][1].params["kinds"].items():
            for q in ("p50", "p90"):
                ratio = stats.get(f"{h}ratio_{q}")
                if ratio is not None:
                    worst.append((ratio, f"{kind} {metric} {q}"))
    low = min(worst) if worst else None
    tail = f" | worst kind: {low[1]} {low[0]:.2f}x" if low else ""
    print(f"{name} " + " | ".join(cells) + tail, flush=True)


# ---------------------------------------------------------------------------- figure


def _figure(summaries: dict[tuple[str, str, int], dict], free: list[str] | None = None):
    """Main-thread and output-side ratios per family: bars = whole-trace totals (from 1,
    up = r3capture cheaper), ticks = p50 step; both models; one column per depth. ``free``:
    the ablations of a what-if run, named in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    h = "cpu_" if HEADLINE == 1 else ""
    depths = sorted({d for _, _, d in summaries}, reverse=True)
    models = list(dict.fromkeys(key[1] for key in summaries))
    families = list(dict.fromkeys(key[0] for key in summaries))
    panels = (
        ("main", "main thread (begin + prepare + enqueue)", 2.0),  # decode, prefill
        ("output", "output thread (process_output) + vLLM's writer", 5.0),
    )
    fig, axes = plt.subplots(
        len(panels), len(depths), figsize=(7.5 * len(depths), 4.4 * len(panels)), squeeze=False
    )
    width = 0.8 / max(len(models), 1)
    x = np.arange(len(families))
    ticks = [0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50]
    for col, depth in enumerate(depths):
        for row, (metric, label, target) in enumerate(panels):
            ax = axes[row][col]
            values = []
            for i, model in enumerate(models):
                totals, p50s = [], []
                for family in families:
                    entry = summaries.get((family, model, depth))
                    ours = entry["pairs"][metric][1] if entry else None
                    totals.append((ours and ours.params.get(h + "ratio_total")) or np.nan)
                    p50s.append((ours and ours.params.get(h + "ratio_p50")) or np.nan)
                offset = (i - (len(models) - 1) / 2) * width
                totals_arr = np.array(totals, dtype=float)
                ax.bar(x + offset, totals_arr - 1, bottom=1, width=width,
                       label=f"{model}: whole trace")  # fmt: skip
                ax.plot(x + offset, p50s, "k_", markersize=9, mew=2,
                        label="p50 step" if i == 0 else None)  # fmt: skip
                for xi, value in zip(x + offset, totals_arr):
                    if np.isfinite(value):
                        ax.annotate(f"{value:.2g}", (xi, value), ha="center",
                                    va="bottom" if value >= 1 else "top", fontsize=6)  # fmt: skip
                values.extend(v for v in totals + p50s if np.isfinite(v))
            ax.axhline(1.0, color="gray", lw=1)
            goal = f"target {target:g}x" + (" (decode, prefill)" if metric == "main" else "")
            ax.axhline(target, color="tab:green", lw=1, ls="--", label=goal)
            ax.set_yscale("log")
            low = min([0.5, *values]) / 1.5
            high = max([target, *values]) * 1.5
            ax.set_ylim(low, high)
            ax.yaxis.set_major_locator(FixedLocator([t for t in ticks if low <= t <= high]))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xticks(x, families, rotation=45, ha="right", fontsize=8)
            ax.set_ylabel(f"vLLM / r3capture ({HEADLINE_NAME})")
            ax.set_title(f"{label}, depth {depth}", fontsize=10)
            ax.legend(fontsize=7)
    title = "Host time per step, vLLM 0.33.0 / r3capture (> 1: r3capture cheaper)"
    if free:
        title += f"\nwhat-if: r3capture with {' and '.join(free)} counted as free"
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------- driver


def run(
    *,
    families: list[str],
    models: list[str],
    depths: list[int],
    repeats: int,
    seed: int = 0,
    free: list[str] | None = None,
    max_num_seqs: int | None = None,
    inline_kernel: bool = False,
    busy: bool = False,
    alone: bool = False,
) -> tuple[list[Result], dict[str, Any]]:
    started = time.perf_counter()
    groups = [(model, depth) for depth in depths for model in models]
    dirs: dict[tuple[str, int], list[str]] = {}
    for model, depth in groups:
        t0 = time.perf_counter()
        out = _child(
            [
                "record",
                "--cache",
                str(CACHE),
                "--model",
                model,
                "--depth",
                str(depth),
                "--seed",
                str(seed),
                *(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []),
                *families,
            ]
        )
        dirs[(model, depth)] = json.loads(out.strip().splitlines()[-1])
        print(f"recordings {model} d{depth}: {time.perf_counter() - t0:.0f} s", flush=True)
    record_seconds = time.perf_counter() - started

    replays: dict[tuple[str, int, str], list[dict]] = {}
    processes = []
    neighbour = _busy_process() if busy else None
    with tempfile.TemporaryDirectory(prefix="host_step_") as tmp:
        for repeat in range(repeats):
            for model, depth in groups:
                for provider in PROVIDERS:
                    out_path = Path(tmp) / f"{provider}-{model}-{depth}-{repeat}.pkl"
                    t0 = time.perf_counter()
                    _child(
                        [
                            "replay",
                            "--connector",
                            provider,
                            "--out",
                            str(out_path),
                            *(["--free", ",".join(free)] if free and provider == OURS else []),
                            *(["--inline-kernel"] if inline_kernel else []),
                            *(["--alone"] if alone else []),
                            *dirs[(model, depth)],
                        ]
                    )
                    with open(out_path, "rb") as f:
                        result = pickle.load(f)
                    replays.setdefault((model, depth, provider), []).append(result)
                    processes.append(
                        {
                            "provider": provider,
                            "model": model,
                            "depth": depth,
                            "repeat": repeat,
                            "seconds": round(time.perf_counter() - t0, 1),
                            "stand_in": result["stand_in"],
                            "timer": result["timer"],
                        }
                    )
                    print(
                        f"round {repeat + 1}/{repeats} {model} d{depth} {provider}: "
                        f"{time.perf_counter() - t0:.0f} s",
                        flush=True,
                    )
    if neighbour is not None:
        neighbour.kill()
        neighbour.wait()

    rows: list[Result] = []
    summaries: dict[tuple[str, str, int], dict] = {}
    recordings = {}
    what_if = f", r3capture with {' and '.join(free)} counted as free" if free else ""
    if inline_kernel:
        what_if += ", r3capture's kernel emulation inside prepare_output"
    if busy:
        what_if += ", one busy process beside each replay"
    if alone:
        what_if += ", each connector alone (no shadow)"
    print(
        f"\nratios vLLM / r3capture ({HEADLINE_NAME}; > 1 = r3capture cheaper{what_if}); "
        "p50 columns: vLLM/r3capture us",
        flush=True,
    )
    for model, depth in groups:
        for directory in dirs[(model, depth)]:
            meta = json.loads((Path(directory) / "meta.json").read_text())
            key = Path(directory).name
            runs = {p: [r["traces"][key] for r in replays[(model, depth, p)]] for p in PROVIDERS}
            identical, reason = _same_outputs(meta, runs)
            trace_rows, pairs = _summaries(meta, runs, identical)
            rows.extend(trace_rows)
            summaries[(meta["family"], model, depth)] = {
                "pairs": pairs,
                "identical": identical,
                "reason": reason,
            }
            recordings[key] = {
                "notes": meta["notes"],
                "steps": len(meta["kinds"]),
                "kinds": {k: meta["kinds"].count(k) for k in dict.fromkeys(meta["kinds"])},
                "record_seconds": meta["record_seconds"],
                **meta["info"],
            }
            _print_trace(meta, pairs, identical, reason)

    stand_in = {
        clock: float(np.median([p["stand_in"][clock] for p in processes]))
        for clock in ("wall_ns_p50", "cpu_ns_p50")
    }
    timer = {
        clock: float(np.median([p["timer"][clock] for p in processes]))
        for clock in ("wall_ns_p50", "cpu_ns_p50")
    }
    print(
        f"\nlaunch stand-in: {stand_in['cpu_ns_p50'] / 1e3:.1f} us CPU, "
        f"{stand_in['wall_ns_p50'] / 1e3:.1f} us wall per launch (median of "
        f"{len(processes)} processes); clock reads per timed call: "
        f"{timer['cpu_ns_p50'] / 1e3:.1f} us CPU, {timer['wall_ns_p50'] / 1e3:.1f} us wall",
        flush=True,
    )
    extra = {
        "headline_clock": HEADLINE_NAME,
        "free": {part: [".".join(target) for target in ABLATIONS[part]] for part in free or []},
        # None: each family's own (bench/host_step_families.py).
        "max_num_seqs": max_num_seqs,
        "method": (
            "Recorded simulator traces (vLLM 0.33.0 scheduler + worker call order) replayed "
            "through each connector in separate processes, alternating, a fresh connector per "
            "trace; per-step median over repeats; main = begin_step + prepare_output + "
            "enqueue_cpu_copy, process = process_output, background = CPU of connector threads "
            "(vLLM's store writer, drained outside timed calls), output = process + "
            "background, all = main + output. GPU work replaced by one launch stand-in per "
            "launch on both sides (bench/stand_ins.py). Unless --alone, the other connector "
            "makes every call untimed just before the timed one's (the shadow), so both "
            "sides' calls follow the same CPU work, r3capture's kernel emulation included."
        ),
        "busy_neighbour": busy,
        "shadow": not alone,
        "launch_stand_in_ns": stand_in,
        "timer_overhead_ns": timer,
        "repeats": repeats,
        "processes": processes,
        "families": {f: named_family(f).description for f in families},
        "recordings": recordings,
        "record_seconds": round(record_seconds, 1),
        "run_seconds": round(time.perf_counter() - started, 1),
    }
    return rows, {"extra": extra, "summaries": summaries}


def _busy_process() -> subprocess.Popen:
    """A process that keeps one core busy until killed (``--busy``)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _is_family(name: str) -> bool:
    try:
        named_family(name)
    except KeyError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{MODELS[0]}, depth 2, {len(QUICK_FAMILIES)} families"
    )
    parser.add_argument("--repeats", type=int, default=3, help="processes per connector (>= 3)")
    parser.add_argument(
        "--families",
        help="comma-separated, of: " + ",".join(FAMILIES) + "; or decode-N, spec-kN at any size",
    )
    parser.add_argument(
        "--models",
        help=f"comma-separated subset of: {','.join(KNOWN_MODELS)} (default: {','.join(MODELS)})",
    )
    parser.add_argument("--depths", help="comma-separated subset of: 2,1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR / "host_step")
    parser.add_argument(
        "--free", help="what-if: r3capture's parts counted as free, of: " + ",".join(ABLATIONS)
    )
    parser.add_argument(
        "--inline-kernel",
        action="store_true",
        help="r3capture's kernel emulation runs inside prepare_output (off the clock), not "
        "where the host would next wait for the device (bench/stand_ins.KernelStandIn)",
    )
    parser.add_argument(
        "--alone",
        action="store_true",
        help="each connector replays alone, without the other as its untimed shadow "
        "(written as host_step_alone.json)",
    )
    parser.add_argument(
        "--busy",
        action="store_true",
        help="run every replay beside one busy process (written as host_step_busy.json)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        help="every trace's max_num_seqs (default: each family's own; vLLM serves with 1024 "
        "on H100/H200-class GPUs)",
    )
    args = parser.parse_args(argv)
    families = list(QUICK_FAMILIES) if args.quick else list(FAMILIES)
    models = [MODELS[0]] if args.quick else list(MODELS)
    depths = [2] if args.quick else list(DEPTHS)
    if args.families:
        families = args.families.split(",")
    if args.models:
        models = args.models.split(",")
    if args.depths:
        depths = [int(d) for d in args.depths.split(",")]
    free = args.free.split(",") if args.free else []
    unknown = [f for f in families if not _is_family(f)]
    unknown += [m for m in models if m not in KNOWN_MODELS]
    unknown += [part for part in free if part not in ABLATIONS]
    if unknown:
        parser.error(f"unknown families, models or ablations: {unknown}")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        parser.error(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    import torch

    # The replays run with one torch thread (host_step_replay); the results' machine label,
    # made here, names this process's count.
    torch.set_num_threads(1)
    rows, info = run(
        families=families,
        models=models,
        depths=depths,
        repeats=args.repeats,
        seed=args.seed,
        free=free,
        max_num_seqs=args.max_num_seqs,
        inline_kernel=args.inline_kernel,
        busy=args.busy,
        alone=args.alone,
    )
    identical = all(s["identical"] for s in info["summaries"].values())
    seqs = [f"seqs{args.max_num_seqs}"] if args.max_num_seqs else []
    inline = ["inline"] if args.inline_kernel else []
    busy = ["busy"] if args.busy else []
    alone = ["alone"] if args.alone else []
    name = "_".join(
        ["host_step", *seqs, *busy, *alone, *inline, *(["free", *free] if free else [])]
    )
    write_results(
        name,
        rows,
        figure=_figure(info["summaries"], free),
        extra=info["extra"],
        out_dir=args.out_dir,
    )
    print(f"wrote {args.out_dir / (name + '.json')} ({info['extra']['run_seconds']:.0f} s)")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
