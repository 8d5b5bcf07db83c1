"""r3capture's host time per call at two revisions, in one process, replay by replay.

``host_step`` compares two different connectors, each in its own fresh process. Between two
versions of r3capture that method cannot see a change of a few microseconds on the VMs this
project gets: an A/A run (the same code in both process slots, 8 alternated rounds) measured
the second process of each pair 15 % faster on every call. Here both versions live in one
process and are replayed alternately on the same recordings, the order flipping every
round (ABBA), so slow drifts of the machine hit both alike; each call's figure is the
median over the rounds of the ratio between the two replays of one round.

How two versions coexist: the base revision's ``kernels/``, ``store/`` and ``aux_output/``
are exported (``git archive``) and imported as a second ``r3capture`` package under its own
set of ``sys.modules`` entries (``load_package``); a replay installs one set at a time, so
the lazy imports of the simulator and the stand-ins resolve to that version. The bench and
simulator code is the working tree's for both. Both versions must give the recording's
outputs (digests) on every replay, or the run stops.

Both versions' GPU work is replaced by the working tree's stand-in (``bench/stand_ins.py``):
one kernel launch per step, ``GatherAllocLaunch``'s, whose torch reference is excluded. A
base from before the kernel took its slots itself (its worker launched the retired
host-planned kernel after planning slots and uploading them) has device work that stand-in
does not cover: no A/B against it is fair, and the run stops when a version's replay made no
stand-in launch (or, before ``kernels/alloc_reference.py`` existed, when the stand-in finds no
kernel).

    python -m bench.run host_ab --base REV [--families A,B] [--model M] [--depth D]
        [--rounds N] [--out-dir DIR] [--shadow]

``--shadow`` replays as ``host_step`` does (vLLM's connector makes every call first, the
kernel's emulation deferred), so each call meets the cold caches that a cut in its cold cost
shows in; without it each call follows the same version's previous one.

Writes ``host_ab.json`` (+ ``.png``): per family and call, each version's median over the
rounds and the median ratio working tree / base (< 1: the working tree is cheaper).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from bench.common import QUANTILES, RESULTS_DIR, Result, make_result, write_results
from bench.host_step_bench import CACHE, ROOT
from bench.host_step_replay import CALLS, WARMUP_EVENTS, ensure_recording, replay

PACKAGE = "r3capture"
SUBPACKAGES = ("kernels", "store", "aux_output")  # pyproject.toml's package-dir
# Per replay: each call's p50 over the steps, the main thread's p50 (the three main-thread
# calls of a step together), both threads' whole-trace totals, process_output's 90th and
# 99th percentiles (the steps that complete blocks or finish requests) and the main thread's
# 99th (steps that add requests): what a busy neighbour turns into the p99.
METRICS = (*CALLS, "main", "main_total", "output_total", "output_p90", "output_p99", "main_p99")
DEFAULT_FAMILIES = ("decode-1", "decode-8", "decode-256", "multi-turn-short", "mixed", "prefill")


def _package_names() -> list[str]:
    """The ``sys.modules`` names of the ``r3capture`` package imported now."""
    return [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]


def _take_package_modules() -> dict[str, ModuleType]:
    """Remove and return every ``sys.modules`` entry of the ``r3capture`` package."""
    return {name: sys.modules.pop(name) for name in _package_names()}


def load_package(root: Path) -> dict[str, ModuleType]:
    """A second, complete ``r3capture`` imported from ``root`` (a tree holding
    ``SUBPACKAGES``), as its own ``sys.modules`` entries; the current ones are restored."""
    current = _take_package_modules()
    try:
        package = ModuleType(PACKAGE)
        package.__path__ = []
        sys.modules[PACKAGE] = package
        for sub in SUBPACKAGES:
            spec = importlib.util.spec_from_file_location(
                f"{PACKAGE}.{sub}",
                root / sub / "__init__.py",
                submodule_search_locations=[str(root / sub)],
            )
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            setattr(package, sub, module)
            spec.loader.exec_module(module)
        return installed_package()
    finally:
        _take_package_modules()
        sys.modules.update(current)


def installed_package() -> dict[str, ModuleType]:
    """The ``sys.modules`` entries of the ``r3capture`` imported now, with what a replay
    imports lazily (the worker, and the kernel's CPU emulation) imported first."""
    from bench.stand_ins import kernel_binding

    importlib.import_module(f"{PACKAGE}.aux_output.worker")
    kernel_binding()  # imports it
    return {name: sys.modules[name] for name in _package_names()}


def export_revision(revision: str, dest: Path) -> Path:
    """``SUBPACKAGES`` of ``revision`` written under ``dest`` (``git archive``)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", revision, *SUBPACKAGES],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


class Version:
    """One version of the package: its modules, its kernel stand-in and its recordings'
    sizing (``WorkerSizing`` is checked by type, so each version gets its own)."""

    def __init__(self, label: str, modules: dict[str, ModuleType], *, defer: bool = False) -> None:
        from bench.stand_ins import KernelStandIn

        self.label = label
        self.modules = modules
        with self.installed():
            self.stand_in = KernelStandIn(defer=defer).__enter__()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        current = _take_package_modules()
        sys.modules.update(self.modules)
        try:
            yield
        finally:
            _take_package_modules()
            sys.modules.update(current)

    def recording(self, recording: Any) -> Any:
        sizing_type = self.modules[f"{PACKAGE}.aux_output.sizing"].WorkerSizing
        fields = {
            f.name: getattr(recording.sizing, f.name) for f in dataclasses.fields(sizing_type)
        }
        return dataclasses.replace(recording, sizing=sizing_type(**fields))

    def close(self) -> None:
        with self.installed():
            self.stand_in.__exit__(None, None, None)


def replay_metrics(
    version: Version, recording: Any, metadata_types: Any, shadow: bool = False
) -> np.ndarray:
    """One replay of ``recording`` through ``version`` (``shadow``: host_step's, with vLLM's
    connector making every call first): float ``[len(METRICS)]`` in us (thread CPU). Raises
    when the outputs differ from the recording's."""
    with version.installed():
        times = replay(
            recording,
            "r3capture",
            exclusion=version.stand_in,
            metadata_types=metadata_types,
            shadow=shadow,
        )
    if times.error is not None or times.digests != recording.digests:
        raise RuntimeError(
            f"{version.label} did not reproduce {recording.name}'s outputs: "
            f"{times.error or 'digests differ'}"
        )
    forward_steps = sum(1 for event in recording.events if event[0] == "prepare_output")
    if forward_steps and not times.launches:
        raise RuntimeError(
            f"{version.label}: no stand-in launch in {forward_steps} forward steps of "
            f"{recording.name}: its kernel is not the one bench/stand_ins.py stands in for "
            "(a revision from before the kernel took its slots itself?)"
        )
    cpu = times.calls[:, :, 1] / 1e3
    main = cpu[0] + cpu[1] + cpu[2]
    return np.array(
        [
            *np.median(cpu, axis=1),
            np.median(main),
            main.sum() / 1e3,
            cpu[3].sum() / 1e3,
            *np.percentile(cpu[3][cpu[3] > 0], (90, 99)),
            np.percentile(main[main > 0], 99),
        ]
    )


def compare(
    versions: tuple[Version, Version],
    recordings: dict[str, Any],
    rounds: int,
    shadow: bool = False,
) -> dict[str, np.ndarray]:
    """Per family, float ``[2, rounds, len(METRICS)]``: every round replays each recording
    once per version, the order flipping every round, after one warm-up replay each."""
    from sim.recording import vllm_metadata_types

    metadata_types = vllm_metadata_types()
    own = {v.label: {f: v.recording(r) for f, r in recordings.items()} for v in versions}
    for version in versions:
        for recording in own[version.label].values():
            with version.installed():
                replay(
                    recording,
                    "r3capture",
                    exclusion=version.stand_in,
                    metadata_types=metadata_types,
                    max_events=WARMUP_EVENTS,
                    shadow=shadow,
                )
    out = {family: np.zeros((2, rounds, len(METRICS))) for family in recordings}
    for i in range(rounds):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for family in recordings:
            for v in order:
                gc.collect()
                version = versions[v]
                out[family][v, i] = replay_metrics(
                    version, own[version.label][family], metadata_types, shadow
                )
    return out


def result_rows(
    times: dict[str, np.ndarray], labels: tuple[str, str], model: str, depth: int
) -> list[Result]:
    rows = []
    for family, values in times.items():
        ratios = values[1] / values[0]
        for m, metric in enumerate(METRICS):
            for v, label in enumerate(labels):
                params: dict[str, Any] = {"family": family, "model": model, "depth": depth}
                if v == 1:
                    r50, r20, r80 = np.quantile(ratios[:, m], QUANTILES)
                    params.update(ratio_p50=float(r50), ratio_p20=float(r20), ratio_p80=float(r80))
                # make_result takes ns samples: one per round.
                rows.append(
                    make_result("host_ab", metric, [], "", label, values[v, :, m] * 1e3, **params)
                )
    return rows


def figure(rows: list[Result], labels: tuple[str, str]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if r.provider == labels[1] and r.op in (*CALLS, "main")]
    families = list(dict.fromkeys(r.params["family"] for r in ours))
    metrics = list(dict.fromkeys(r.op for r in ours))
    fig, ax = plt.subplots(figsize=(1.6 * len(families) + 2, 4))
    width = 0.8 / len(metrics)
    for j, metric in enumerate(metrics):
        cells = [
            next(r for r in ours if r.op == metric and r.params["family"] == f) for f in families
        ]
        mid = [c.params["ratio_p50"] for c in cells]
        err = [
            [m - c.params["ratio_p20"] for m, c in zip(mid, cells)],
            [c.params["ratio_p80"] - m for m, c in zip(mid, cells)],
        ]
        x = np.arange(len(families)) + (j - (len(metrics) - 1) / 2) * width
        ax.bar(x, mid, width, yerr=err, capsize=2, label=metric)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(families)), families, rotation=20)
    ax.set_ylabel(f"thread CPU, {labels[1]} / {labels[0]}")
    ax.set_title("r3capture at two versions, one process, alternated (p20-p80 over rounds)")
    ax.legend(fontsize=8, ncol=len(metrics))
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="git revision to compare against")
    parser.add_argument("--families", default=",".join(DEFAULT_FAMILIES))
    parser.add_argument("--model", default="Qwen3-30B-A3B")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--shadow",
        action="store_true",
        help="as host_step: vLLM's connector makes every call first, the kernel emulation "
        "deferred (cold caches; what cuts a call's cold cost shows)",
    )
    args = parser.parse_args(argv)
    import torch

    from sim.recording import Recording

    torch.set_num_threads(1)  # as in host_step: thread CPU covers all of a call's torch work
    base_sha = subprocess.run(
        ["git", "rev-parse", "--short", args.base],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    labels = (f"base {base_sha}", "working tree")
    recordings = {
        family: Recording.load(ensure_recording(CACHE, family, args.model, args.depth, args.seed))
        for family in args.families.split(",")
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        base = Version(
            labels[0], load_package(export_revision(args.base, Path(tmp))), defer=args.shadow
        )
        tree = Version(labels[1], installed_package(), defer=args.shadow)
        try:
            times = compare((base, tree), recordings, args.rounds, args.shadow)
        finally:
            base.close()
            tree.close()
    rows = result_rows(times, labels, args.model, args.depth)
    for family in recordings:
        cells = [
            f"{r.op} {r.params['ratio_p50']:.2f}"
            for r in rows
            if r.provider == labels[1] and r.params["family"] == family
        ]
        print(f"{family:18s} working tree / {labels[0]}: " + ", ".join(cells))
    write_results(
        "host_ab",
        rows,
        figure=figure(rows, labels),
        extra={
            "base": base_sha,
            "rounds": args.rounds,
            "shadow": args.shadow,
            "seconds": round(time.perf_counter() - t0),
        },
        out_dir=args.out_dir,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
