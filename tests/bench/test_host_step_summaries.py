"""The host-step benchmark's arithmetic, on per-call times made up so every term differs.

``bench/host_step_bench._summaries`` turns replays into the rows ``bench/RESULTS.md``
quotes. Here every call, step, repeat and clock gets its own time, and the expected
figures are computed independently, one step at a time. The arithmetic: main thread =
``begin_step`` + ``prepare_output`` + ``enqueue_cpu_copy``; output side = ``process_output``
+ background threads; all = both. Per step, the median over the repeats. p50 and p90 are
over the trace's steps, and only the steps with a ``process_output`` for the output side.
Totals are over every step. Ratios are vLLM / r3capture.
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from bench.host_step_bench import _ratio, _same_outputs, _summaries
from bench.host_step_replay import CALLS

VLLM, OURS = "vllm-0.33.0", "r3capture"
KINDS = ["empty", "decode", "prefill-chunk", "decode", "decode", "finish-only", "decode"]
# Steps 0 and 5 run no forward: no process_output, and no prepare or enqueue either.
PROCESSED = [1, 2, 3, 4, 6]
REPEATS = 3


def _replay(rng: np.random.Generator) -> dict:
    steps = len(KINDS)
    calls = rng.integers(20_000, 400_000, size=(len(CALLS), steps, 2)).astype(np.int64)
    idle = [s for s in range(steps) if s not in PROCESSED]
    calls[1:, idle] = 0
    return {
        "calls": calls,
        # Background CPU also lands on steps without a process_output (vLLM's writer).
        "background": rng.integers(10_000, 300_000, size=steps).astype(np.int64),
        "digests": [[s, f"d{s}"] for s in PROCESSED],
        "error": None,
    }


def _metric(replay: dict, metric: str, step: int, clock: int) -> float:
    c = replay["calls"]
    main = c[0, step, clock] + c[1, step, clock] + c[2, step, clock]
    output = c[3, step, clock] + replay["background"][step]
    return float({"main": main, "output": output, "all": main + output}[metric])


def _per_step(replays: list[dict], metric: str, clock: int) -> list[float]:
    return [
        statistics.median(_metric(r, metric, s, clock) for r in replays) for s in range(len(KINDS))
    ]


def _expected(replays: list[dict], metric: str, steps: list[int]) -> dict[str, float]:
    """p50/p90 (µs) over ``steps``, totals (ms) over every step, both clocks."""
    out = {}
    for prefix, clock in (("", 0), ("cpu_", 1)):
        per_step = _per_step(replays, metric, clock)
        chosen = [per_step[s] for s in steps]
        out[prefix + "p50"] = statistics.median(chosen) / 1e3
        out[prefix + "p90"] = float(np.percentile(chosen, 90)) / 1e3
        out[prefix + "total_ms"] = sum(per_step) / 1e6
    return out


def _meta(kinds: list[str], processed: list[int]) -> dict:
    """A recording's ``meta.json`` for steps of ``kinds``, ``processed`` ones digested."""
    return {
        "family": "f",
        "model": "m",
        "depth": 2,
        "shape": [2, 2],
        "dtype": "uint8",
        "kinds": kinds,
        "digests": [[s, f"d{s}"] for s in processed],
    }


@pytest.fixture(scope="module")
def summary():
    rng = np.random.default_rng(7)
    runs = {VLLM: [_replay(rng) for _ in range(REPEATS)]}
    runs[OURS] = [_replay(rng) for _ in range(REPEATS)]
    rows, pairs = _summaries(_meta(KINDS, PROCESSED), runs, True)
    return runs, rows, pairs


def _row_stats(row) -> dict[str, float]:
    p = row.params
    return {
        "p50": row.p50,
        "p90": p["p90"],
        "total_ms": p["total_ms"],
        "cpu_p50": p["cpu_p50"],
        "cpu_p90": p["cpu_p90"],
        "cpu_total_ms": p["cpu_total_ms"],
    }


@pytest.mark.parametrize("metric", ["main", "output", "all"])
def test_each_metric_sums_its_calls_and_takes_quantiles_over_its_steps(summary, metric):
    runs, _, pairs = summary
    steps = PROCESSED if metric == "output" else list(range(len(KINDS)))
    for provider, row in zip((VLLM, OURS), pairs[metric]):
        assert row.params["steps"] == len(steps)
        assert row.params["trace_steps"] == len(KINDS)
        assert _row_stats(row) == pytest.approx(_expected(runs[provider], metric, steps), 2e-3)
        for name, clock in (("total_ms_repeats", 0), ("cpu_total_ms_repeats", 1)):
            totals = [
                sum(_metric(r, metric, s, clock) for s in range(len(KINDS))) / 1e6
                for r in runs[provider]
            ]
            assert row.params[name] == pytest.approx(totals, 2e-3)


@pytest.mark.parametrize("metric", ["main", "output", "all"])
def test_ratios_are_vllm_over_r3capture(summary, metric):
    runs, _, pairs = summary
    steps = PROCESSED if metric == "output" else list(range(len(KINDS)))
    theirs = _expected(runs[VLLM], metric, steps)
    ours = _expected(runs[OURS], metric, steps)
    params = pairs[metric][1].params
    for prefix in ("", "cpu_"):
        for stat, name in (("p50", "p50"), ("p90", "p90"), ("total_ms", "total")):
            expected = theirs[prefix + stat] / ours[prefix + stat]
            assert params[f"{prefix}ratio_{name}"] == pytest.approx(expected, 2e-3)
    assert not any("ratio" in key for key in pairs[metric][0].params)
    # r3capture starts no background thread: that metric gets no ratio.
    assert not any("ratio" in key for key in pairs["background"][1].params)


@pytest.mark.parametrize("metric", ["main", "output", "all"])
def test_tail_is_each_repeats_own_p99_and_max_then_their_median(summary, metric):
    """A run's tail: a spike on one repeat's step counts there, where the per-step median over
    the repeats would hide it."""
    runs, _, pairs = summary
    steps = PROCESSED if metric == "output" else list(range(len(KINDS)))
    for provider, row in zip((VLLM, OURS), pairs[metric]):
        for prefix, clock in (("", 0), ("cpu_", 1)):
            own = [[_metric(r, metric, s, clock) for s in steps] for r in runs[provider]]
            p99 = statistics.median(float(np.percentile(v, 99)) for v in own) / 1e3
            peak = statistics.median(max(v) for v in own) / 1e3
            assert row.params[prefix + "p99"] == pytest.approx(p99, 2e-3)
            assert row.params[prefix + "max"] == pytest.approx(peak, 2e-3)
    theirs, ours = pairs[metric]
    assert ours.params["cpu_ratio_p99"] == pytest.approx(
        theirs.params["cpu_p99"] / ours.params["cpu_p99"], 2e-3
    )
    assert ours.params["ratio_max"] == pytest.approx(
        theirs.params["max"] / ours.params["max"], 2e-3
    )


def test_per_kind_statistics_cover_the_kinds_steps_only(summary):
    runs, _, pairs = summary
    for metric in ("main", "output"):
        kinds = pairs[metric][1].params["kinds"]
        sampled = PROCESSED if metric == "output" else range(len(KINDS))
        expected_kinds = {KINDS[s] for s in sampled}
        assert set(kinds) == expected_kinds
        for kind, stats in kinds.items():
            steps = [s for s in sampled if KINDS[s] == kind]
            assert stats["steps"] == len(steps)
            ours = _expected(runs[OURS], metric, steps)
            theirs = _expected(runs[VLLM], metric, steps)
            for prefix in ("", "cpu_"):
                assert stats[prefix + "p50"] == pytest.approx(ours[prefix + "p50"], 2e-3)
                assert stats[prefix + "p90"] == pytest.approx(ours[prefix + "p90"], 2e-3)
                ratio = theirs[prefix + "p50"] / ours[prefix + "p50"]
                assert stats[prefix + "ratio_p50"] == pytest.approx(ratio, 2e-3)


def test_main_thread_calls_are_reported_one_by_one(summary):
    runs, _, pairs = summary
    for provider, row in zip((VLLM, OURS), pairs["main"]):
        calls = row.params["calls"]
        assert list(calls) == list(CALLS[:3])
        for index, name in enumerate(CALLS[:3]):
            # begin_step runs on every step, the other two on the steps with a forward.
            steps = range(len(KINDS)) if name == "begin_step" else PROCESSED
            for prefix, clock in (("", 0), ("cpu_", 1)):
                per_step = [
                    statistics.median(int(r["calls"][index, s, clock]) for r in runs[provider])
                    for s in steps
                ]
                assert calls[name][prefix + "p50"] == pytest.approx(
                    statistics.median(per_step) / 1e3, 2e-3
                )
                all_steps = [
                    statistics.median(int(r["calls"][index, s, clock]) for r in runs[provider])
                    for s in range(len(KINDS))
                ]
                assert calls[name][prefix + "total_ms"] == pytest.approx(sum(all_steps) / 1e6, 2e-3)


def test_no_ratio_when_either_side_took_no_time():
    assert _ratio(3.0, 1.5) == 2.0
    assert _ratio(0.0, 1.5) is None
    assert _ratio(3.0, 0.0) is None


def test_a_replay_that_failed_or_returned_too_much_is_not_identical():
    meta = {"digests": [[s, f"d{s}"] for s in PROCESSED]}
    good = {"error": None, "digests": [[s, f"d{s}"] for s in PROCESSED]}
    failed = {"error": (3, "process_output", "KeyError"), "digests": good["digests"][:2]}
    identical, reason = _same_outputs(meta, {VLLM: [good], OURS: [good, failed]})
    assert not identical and reason == f"{OURS} run 1: error {failed['error']}"
    longer = {"error": None, "digests": [*good["digests"], [7, "d7"]]}
    identical, reason = _same_outputs(meta, {VLLM: [good, longer], OURS: [good]})
    assert not identical and reason == f"{VLLM} run 1: outputs differ from step end"


def test_no_ratio_when_outputs_differ():
    steps = 4
    meta = _meta(["decode"] * steps, list(range(steps)))

    def run(digests, scale):
        calls = np.full((len(CALLS), steps, 2), 1000 * scale, np.int64)
        return {
            "calls": calls,
            "background": np.zeros(steps, np.int64),
            "digests": digests,
            "error": None,
        }

    good = [[s, f"d{s}"] for s in range(steps)]
    bad = [[s, f"d{s}" if s != 2 else "x"] for s in range(steps)]
    runs = {"vllm-0.33.0": [run(good, 3)] * 3, "r3capture": [run(good, 1)] * 3}
    identical, _ = _same_outputs(meta, runs)
    rows, _ = _summaries(meta, runs, identical)
    ours = [r for r in rows if r.provider == "r3capture" and r.op == "main"][0]
    assert identical and ours.params["cpu_ratio_p50"] == pytest.approx(3.0)
    assert ours.params["kinds"]["decode"]["cpu_ratio_p90"] == pytest.approx(3.0)
    assert ours.params["cpu_total_ms"] == pytest.approx(3 * steps * 1000 / 1e6)
    assert ours.params["calls"]["prepare_output"]["cpu_ratio_total"] == pytest.approx(3.0)
    runs["r3capture"] = [run(good, 1), run(bad, 1), run(good, 1)]
    identical, reason = _same_outputs(meta, runs)
    assert not identical and "step 2" in reason
    rows, _ = _summaries(meta, runs, identical)
    assert not any("ratio_p50" in r.params for r in rows)
    assert not any("ratio_p50" in k for r in rows for k in r.params["kinds"].values())
