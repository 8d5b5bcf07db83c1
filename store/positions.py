"""``arange(n)`` without an allocation per call (numpy's fixed cost dominates small batches)."""

from __future__ import annotations

import numpy as np

_POSITIONS = np.arange(1024, dtype=np.int64)
_POSITIONS.flags.writeable = False


def positions(n: int) -> np.ndarray:
    """``arange(n)`` as a read-only view of a shared array (grown on demand)."""
    global _POSITIONS
    if n > len(_POSITIONS):
        grown = np.arange(max(n, 2 * len(_POSITIONS)), dtype=np.int64)
        grown.flags.writeable = False
        _POSITIONS = grown
    return _POSITIONS[:n]
