"""Routing oracle: the expert ids a deterministic "model" routes each token to.

A row depends only on the token prefix up to and including its position, on the position
and on the layer, so a prefix-cache hit must reproduce exactly the rows a recompute would,
and a rejected speculative token (a different token at that position) gives different rows.

Prefix hashes are a polynomial rolling hash over uint64 (wrapping arithmetic):
``H[p] = H[p-1] * B + (tok[p] + 1)``, ``H[-1] = SEED``; vectorized as
``H[p] = B^(p+1) * (SEED + sum_{j<=p} (tok[j] + 1) * B^-(j+1))`` with B odd (invertible).
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_BASE = 0x100000001B3
_BASE_INV = pow(_BASE, -1, 1 << 64)
SEED = 0xCBF29CE484222325
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer, elementwise on uint64 (wraps)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


class _Powers:
    """Cached B^(i+1) and B^-(i+1) (uint64, wrapping) for i < n, grown on demand."""

    def __init__(self) -> None:
        self.fwd = np.empty(0, np.uint64)
        self.inv = np.empty(0, np.uint64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if n > len(self.fwd):
            size = max(n, 2 * len(self.fwd), 1024)
            self.fwd = np.cumprod(np.full(size, _BASE, np.uint64))
            self.inv = np.cumprod(np.full(size, _BASE_INV, np.uint64))
        return self.fwd[:n], self.inv[:n]


_POWERS = _Powers()


def prefix_hashes(tokens: np.ndarray, h_prev: int = SEED) -> np.ndarray:
    """uint64 [n]: rolling prefix hash after each of ``tokens`` (int [n]), continuing from
    ``h_prev`` (the hash after the tokens before them; SEED at position 0)."""
    toks = np.asarray(tokens, dtype=np.int64).astype(np.uint64) + np.uint64(1)
    fwd, inv = _POWERS.get(len(toks))
    acc = np.cumsum(toks * inv, dtype=np.uint64) + np.uint64(h_prev & _MASK)
    return fwd * acc


class RoutingOracle:
    """Expert ids ``[n, L, K]`` int32 in ``[0, num_experts)`` for token positions.

    ``num_dense_layers`` leading layers are dense (all-zero rows), as vLLM's capturer leaves
    them. Ids of one (token, layer) are ``(base + k * step) % E`` with an odd ``step``, so
    they are distinct whenever E is a power of two.
    """

    def __init__(
        self, num_layers: int, top_k: int, num_experts: int, num_dense_layers: int = 0
    ) -> None:
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts]; got {top_k}, {num_experts}")
        if not 0 <= num_dense_layers <= num_layers:
            raise ValueError(
                f"num_dense_layers must be in [0, {num_layers}]; got {num_dense_layers}"
            )
        self.num_layers = num_layers
        self.top_k = top_k
        self.num_experts = num_experts
        self.num_dense_layers = num_dense_layers
        self._layer_salt = _splitmix(np.arange(1, num_layers + 1, dtype=np.uint64) * _MIX1)
        self._k = np.arange(top_k, dtype=np.uint64)

    @property
    def dtype(self) -> np.dtype:
        """Output dtype vLLM uses for this expert count."""
        return np.dtype(np.uint8 if self.num_experts <= 256 else np.uint16)

    def rows_from_hashes(self, hashes: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """int32 [n, L, K] from prefix hashes (uint64 [n]) and positions (int [n])."""
        h = np.asarray(hashes, np.uint64)
        pos = np.asarray(positions, np.int64).astype(np.uint64)
        x = _splitmix(h ^ _splitmix(pos * _MIX2))
        mixed = _splitmix(x[:, None] ^ self._layer_salt[None, :])  # [n, L]
        experts = np.uint64(self.num_experts)
        base = mixed % experts
        half = max(self.num_experts // 2, 1)
        step = (mixed >> np.uint64(32)) % np.uint64(half) * np.uint64(2) + np.uint64(1)
        ids = (base[:, :, None] + self._k[None, None, :] * step[:, :, None]) % experts
        rows = ids.astype(np.int32)
        rows[:, : self.num_dense_layers] = 0
        return rows

    def rows(self, tokens: np.ndarray, start: int, end: int) -> np.ndarray:
        """int32 [end - start, L, K]: rows of positions ``start..end-1`` of ``tokens``."""
        if not 0 <= start <= end <= len(tokens):
            raise ValueError(f"need 0 <= start <= end <= {len(tokens)}; got {start}, {end}")
        hashes = prefix_hashes(np.asarray(tokens)[:end])[start:end]
        return self.rows_from_hashes(hashes, np.arange(start, end))

    def expected(self, tokens: np.ndarray, start: int, end: int) -> np.ndarray:
        """The rows vLLM returns for positions ``start..end-1``: ``rows`` cast to ``dtype``."""
        return self.rows(tokens, start, end).astype(self.dtype)


__all__ = ["RoutingOracle", "SEED", "prefix_hashes"]
