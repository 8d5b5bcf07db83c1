"""Random steps for the commit tests: a request table and one step of its requests."""

from __future__ import annotations

import random

import numpy as np

from r3capture.aux_output.request_table import NO_CURSOR, RequestTable
from r3capture.aux_output.step_commit import StepLayout

B = 4


def setup(cursors, scheduled=None, emits=None, ring_width=8):
    table = RequestTable(ring_width=ring_width)
    names = [f"r{i}" for i in range(len(cursors))]
    for i, name in enumerate(names):
        row = table.add(name, 0 if emits is None else emits[i])
        table.cursor[row] = cursors[i]
        table.scheduled[row] = 0 if scheduled is None else scheduled[i]
    return table, names


def layout(table, names, starts, counts):
    qsl = np.zeros(len(names) + 1, np.int64)
    np.cumsum(counts, out=qsl[1:])
    return StepLayout(names, table.rows(names), np.asarray(starts, np.int64), qsl)


def info(starts, written, taken=None):
    """The kernel's ``step_info``: start, rows written, status 0 and slots taken (which the
    commit does not check: the request book hands them to the table first)."""
    zeros = np.zeros(len(starts))
    taken = zeros if taken is None else taken
    return np.stack([starts, written, zeros, taken], axis=1).astype(np.int32)


def random_step(rng: random.Random, num_reqs: int, valid: bool):
    """A table and a step for it: mostly well-formed requests (decode; reattach after a
    rejected suffix, with rows returned up to or past its new end; first capture; a first
    step off a block boundary whose rows are all rejected; prefix hits; nothing sampled);
    with ``valid`` False, one field of one request is corrupted."""
    cursors, scheduled, emits, starts, counts, rejected, sampled = ([] for _ in range(7))
    for _ in range(num_reqs):
        kind = rng.choice(["decode", "reattach", "fresh", "fresh-all-rejected", "hit"])
        cursor = rng.randrange(0, 64)
        n = rng.randrange(1, 6)
        if kind == "fresh":
            start, cur, sched = rng.randrange(0, 16) * B, NO_CURSOR, 0
            emit = rng.choice([start, 0])
        elif kind == "fresh-all-rejected":
            start, cur, sched = rng.randrange(0, 16) * B + rng.randrange(1, B), NO_CURSOR, 0
            emit = rng.choice([start, 0])
        elif kind == "reattach":
            start, cur, sched = cursor + rng.randrange(1, 3), cursor, cursor + 3
            # The rows it returned may reach past what this step accepts (async drafts).
            emit = rng.choice([cursor, cursor + 8])
        else:
            start, cur, sched = cursor, cursor, cursor
            emit = cursor if kind == "decode" else rng.randrange(0, cursor + 1)
        cursors.append(cur), scheduled.append(sched), emits.append(emit)
        starts.append(start), counts.append(n)
        rejected.append(n if kind == "fresh-all-rejected" else rng.randrange(0, n + 1))
        sampled.append(rng.choice([0, 1, 1, 2]))
    if not valid:
        i = rng.randrange(num_reqs)
        field, value = rng.choice(
            [
                ("counts", 0),
                ("rejected", -1),
                ("rejected", counts[i] + 1),
                ("starts", starts[i] - 1),
                ("starts", starts[i] + 5),
                ("starts", starts[i] + 1),
            ]
        )
        {"counts": counts, "rejected": rejected, "starts": starts}[field][i] = value
    table, names = setup(cursors, scheduled=scheduled, emits=emits)
    step = layout(table, names, starts, counts)
    cursor = np.where(np.array(cursors) < 0, starts, cursors)
    capture = np.minimum(starts, cursor)
    accepted = np.array(counts) - np.array(rejected)
    # Without the device's rejected counts the kernel writes every scheduled row.
    written = accepted if rng.random() < 0.5 else np.array(counts)
    # Slots taken: whatever the launch opened (0 to 2 blocks here); the commit ignores them.
    placed = info(capture, written, [rng.randrange(3) for _ in range(num_reqs)])
    if not valid and rng.random() < 0.5:
        i = rng.randrange(num_reqs)
        placed[i, rng.randrange(3)] += rng.choice([-1, 1, 2])
    return table, step, np.array(sampled), np.array(rejected), placed
