"""SlotPool's free stack against a plain-list model: push runs, take the most recent first."""

from __future__ import annotations

import numpy as np
import pytest

from r3capture.store.slot_pool import SlotPool


def test_take_hands_out_the_latest_pushed_run_first_in_push_order() -> None:
    pool = SlotPool(physical=10)
    assert pool.take(4).tolist() == [0, 1, 2, 3]  # never used, in order
    pool.push([2, 0])
    pool.push([3])
    assert pool.num_free == 3
    # [2, 0, 3] on the stack: the top two in the order they were pushed, then new slots.
    assert pool.take(2).tolist() == [0, 3]
    assert pool.take(3).tolist() == [2, 4, 5]
    assert pool.num_free == 0


@pytest.mark.parametrize("seed", range(5))
def test_random_pushes_and_takes_match_a_list_model(seed: int) -> None:
    rng = np.random.default_rng(seed)
    physical = 5000
    pool = SlotPool(physical)
    held: list[int] = []  # slots handed out and not yet pushed back
    free: list[int] = []  # the model's free stack
    next_slot = 0
    for _ in range(400):
        if held and rng.random() < 0.5:
            # Free a random run of held slots (evictions free runs larger than 1,024 too).
            k = int(rng.integers(1, min(len(held), 1500) + 1))
            picks = rng.choice(len(held), size=k, replace=False).tolist()
            run = [held[i] for i in picks]
            picked = set(picks)
            held = [s for i, s in enumerate(held) if i not in picked]
            pool.push(run)
            free += run
        else:
            n = int(rng.integers(0, 800))
            if next_slot + max(0, n - len(free)) > physical:
                continue
            got = pool.take(n)
            reused = min(n, len(free))
            want = free[len(free) - reused :] + list(range(next_slot, next_slot + n - reused))
            del free[len(free) - reused :]
            next_slot += n - reused
            assert got.dtype == np.int64 and got.tolist() == want
            held += want
        assert pool.num_free == len(free)
