"""Checks on scenario answers; each returns a list of failures (empty: passed).

Shared by the demo (which prints them) and the end-to-end tests (which assert on them).
"""

from __future__ import annotations

import numpy as np

from demo.scenario import ScenarioRun, host_rows


def check_shapes(run: ScenarioRun, shape_per_token: tuple[int, int], dtype) -> list[str]:
    """Every request returned ``[len(sequence) - 1 - prompt_start, L, K]`` rows of ``dtype``."""
    failures = []
    for r in run.results.values():
        expected = (len(r.sequence) - 1 - r.prompt_start, *shape_per_token)
        if r.rows.shape != expected or r.rows.dtype != np.dtype(dtype):
            failures.append(
                f"{run.backend}/{r.name}: rows {r.rows.shape} {r.rows.dtype}, "
                f"expected {expected} {np.dtype(dtype)}"
            )
    return failures


def check_same_as(run: ScenarioRun, reference: ScenarioRun) -> list[str]:
    """Same tokens and byte-identical routed experts as ``reference`` for every request."""
    failures = []
    for name, ref in reference.results.items():
        got = run.results.get(name)
        if got is None:
            failures.append(f"{run.backend}/{name}: missing")
        elif got.output != ref.output:
            failures.append(f"{run.backend}/{name}: tokens differ from {reference.backend}")
        elif got.rows.dtype != ref.rows.dtype or got.rows.shape != ref.rows.shape:
            failures.append(
                f"{run.backend}/{name}: rows {got.rows.shape} {got.rows.dtype} vs "
                f"{reference.backend} {ref.rows.shape} {ref.rows.dtype}"
            )
        elif got.rows.tobytes() != ref.rows.tobytes():
            bad = np.argwhere((got.rows != ref.rows).any(axis=(1, 2))).ravel()
            failures.append(
                f"{run.backend}/{name}: rows differ from {reference.backend} at token rows "
                f"{(bad + got.prompt_start).tolist()[:10]}"
            )
    return failures


def check_router(run: ScenarioRun, router) -> list[str]:
    """Rows equal the HF router's top-k for every (token, layer) (``router``: HFRouter)."""
    failures = []
    for r in run.results.values():
        expected = router.topk(r.sequence)[r.prompt_start : len(r.sequence) - 1]
        if r.rows.shape != expected.shape:
            failures.append(f"{run.backend}/{r.name}: rows {r.rows.shape} vs HF {expected.shape}")
            continue
        bad = np.argwhere(r.rows.astype(np.int64) != expected)
        if len(bad):
            token, layer = (int(x) for x in bad[0][:2])
            failures.append(
                f"{run.backend}/{r.name}: {len(bad)} expert ids differ from HF transformers, "
                f"first at token {token + r.prompt_start}, layer {layer}"
            )
    return failures


def check_prefix_hit(run: ScenarioRun) -> list[str]:
    """Turn 2 was served from the prefix cache and still returned the cached prefix's rows."""
    turn2 = run.results["turn2"]
    if not turn2.cached_tokens:
        return [f"{run.backend}/turn2: no prefix-cache hit (cached_tokens={turn2.cached_tokens})"]
    if len(turn2.rows) != len(turn2.sequence) - 1:
        return [f"{run.backend}/turn2: {len(turn2.rows)} rows for {len(turn2.sequence)} tokens"]
    return []


def check_speculative(run: ScenarioRun) -> list[str]:
    """Drafts were both accepted and rejected, and only accepted tokens have rows."""
    drafts = run.metrics.get("spec_draft_tokens", 0)
    accepted = run.metrics.get("spec_accepted_tokens", 0)
    if not 0 < accepted < drafts:
        return [f"{run.backend}: expected accepted and rejected drafts, got {accepted}/{drafts}"]
    r = run.results["speculative"]
    if len(r.rows) != len(r.sequence) - 1:
        return [f"{run.backend}/speculative: {len(r.rows)} rows for {len(r.sequence)} tokens"]
    return []


def check_row_accounting(run: ScenarioRun) -> list[str]:
    """The server's counters agree with the rows the client saw computed (no cached rows)."""
    _, accepted = host_rows(run.metrics)
    computed = sum(len(r.sequence) - 1 - (r.cached_tokens or 0) for r in run.results.values())
    if accepted != computed:
        return [f"{run.backend}: counters give {accepted} accepted rows, requests {computed}"]
    return []
