"""Store bookkeeping benchmark: the key-row operations a serving worker makes every step.

Operations (n keys each, on a store of ``CAPACITY`` blocks kept full, blocks of the store
benchmark's size):

  bind+retain   bind n keys that were retained earlier and retain the next n new keys (a
                decode step: n=4; a prefill chunk: n=512). Untimed afterwards: release the
                bound keys, so the store stays full of evictable keys.
  bind          bind n fresh keys, no references (the store benchmark's publish).
  retain        retain n stored, unreferenced keys at once (a multi-turn prefix hit: n=4000);
                released again untimed.
  lookup_held   ``lookup_slots(keys, held=True)`` of n retained keys (materializing that hit).
  release       release the n keys a finishing request held (n=100), retained and published
                untimed before.

Providers (interleaved round-robin, each on its own store with the same keys):
  r3capture.objects   the array API with key objects (``KeyObjects``), made once per key and
                      handed back call after call, as the worker does.
  r3capture.rows      the same calls with key rows (``uint64 [n, 5]``), converted every call.
  r3capture.strings   the same calls with vLLM's key strings (parsed at the boundary).
  vllm.BlockObjectStore  vLLM 0.33.0's ``put`` (payload objects for the keys to publish; it has
                      no bind and no slot lookup).
  r3capture@SHA       with ``--before SHA``: the store of an earlier commit, loaded from git
                      (string keys), for a before/after comparison in one run.

Correctness gate: before timing, every provider replays the same rounds of every operation on
fresh stores and must end with the same keys, reference counts and eviction order as vLLM's
store (read from its tables); otherwise nothing is timed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import Result, make_result, run_interleaved, timed_ns
from r3capture.store import BlockStore, KeyObjects, key_objects, key_rows, key_string

CAPACITY = 16384
OBJECTS, ROWS, STRINGS = "r3capture.objects", "r3capture.rows", "r3capture.strings"
VLLM = "vllm.BlockObjectStore"
GATE_ROUNDS = 6


@dataclass(frozen=True)
class Op:
    name: str
    n: int
    repeats: int


OPS = (
    Op("bind+retain", 4, 600),
    Op("bind+retain", 512, 60),
    Op("bind", 4, 600),
    Op("bind", 512, 60),
    Op("retain", 4000, 60),
    Op("lookup_held", 4000, 60),
    Op("release", 100, 300),
)
QUICK_OPS = tuple(Op(op.name, op.n, 10) for op in OPS)


class Keys:
    """Fresh 32-byte hash keys as rows, as vLLM strings and as key objects."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def take(self, n: int) -> tuple[np.ndarray, list[str], KeyObjects]:
        rows = key_rows(0, self._rng.bytes(32 * n), 32)
        return rows, [key_string(row) for row in rows], key_objects(rows)


def part(batch: tuple, start: int, stop: int) -> tuple:
    """Keys ``start .. stop - 1`` of a ``Keys.take`` batch, in all three forms."""
    rows, strings, objects = batch
    return rows[start:stop], strings[start:stop], KeyObjects(objects[start:stop])


class Provider:
    """One store and how to drive it: ``keys(rows, strings, objects)`` picks the key form."""

    def __init__(self, name: str, nbytes: int, vllm_store, before_module) -> None:
        self.name = name
        self.nbytes = nbytes
        self.vllm = vllm_store
        size = {"max_bytes": CAPACITY * nbytes, "object_nbytes": nbytes}
        if name == VLLM:
            self.store = vllm_store.BlockObjectStore(**size)
        elif name in (OBJECTS, ROWS, STRINGS):
            self.store = BlockStore(**size, reserve_slots=1024)
        else:
            self.store = before_module.BlockStore(**size, reserve_slots=1024)
        self.zeros = np.zeros((4096, nbytes), np.uint8)  # the largest batch published

    def keys(self, rows: np.ndarray, strings: list[str], objects: KeyObjects):
        return {OBJECTS: objects, ROWS: rows}.get(self.name, strings)

    def publish(self, rows, strings, objects, *, retain=None, release=None) -> Callable[[], None]:
        """A call publishing (zeroed) blocks under the keys, with optional references."""
        refs = {}
        if retain is not None:
            refs["retain_keys"] = self.keys(*retain)
        if release is not None:
            refs["release_keys"] = self.keys(*release)
        if self.name == VLLM:
            payload = bytes(self.nbytes)
            objects = [self.vllm.BlockObject(key, payload) for key in strings]
            return lambda: self.store.put(objects, **refs)
        keys, blocks = self.keys(rows, strings, objects), self.zeros[: len(rows)]
        return lambda: self.store.put_array(keys, blocks, **refs)

    def bind(self, rows, strings, objects, *, retain=None) -> Callable[[], None]:
        """allocate (now, untimed) and a call binding the keys to those slots."""
        if self.name == VLLM:
            return self.publish(rows, strings, objects, retain=retain)
        slots = self.store.allocate(len(rows))
        refs = {} if retain is None else {"retain_keys": self.keys(*retain)}
        keys = self.keys(rows, strings, objects)
        return lambda: self.store.bind(keys, slots, **refs)

    def refs(self, *, retain=None, release=None) -> Callable[[], None]:
        refs = {}
        if retain is not None:
            refs["retain_keys"] = self.keys(*retain)
        if release is not None:
            refs["release_keys"] = self.keys(*release)
        return lambda: self.store.put([], **refs)

    def lookup_held(self, rows, strings, objects) -> Callable[[], None] | None:
        if self.name == VLLM:
            return None
        keys = self.keys(rows, strings, objects)
        return lambda: self.store.lookup_slots(keys, held=True)

    def state(self, keys: list[str]) -> tuple[list[str], list[int], int]:
        """(eviction order, reference counts of ``keys``, stored keys), read without
        touching recency (vLLM's from its tables)."""
        if self.name == VLLM:
            refs = [self.store._references.get(key, 0) for key in keys]
            return list(self.store._lru), refs, len(self.store._slots)
        refs = [self.store.ref_count(key) for key in keys]
        return self.store.eviction_order(), refs, len(self.store)

    def close(self) -> None:
        self.store.close()


class Workload:
    """The rounds of one operation: ``round(i)`` returns (untimed setup, timed call,
    untimed cleanup) per provider for round ``i``, all providers on the same keys."""

    def __init__(self, op: Op, providers: list[Provider], seed: int, rounds: int) -> None:
        self.op, self.providers = op, providers
        keys = Keys(seed)
        n = op.n
        fill = keys.take(CAPACITY)
        for p in providers:
            for start in range(0, CAPACITY, 4096):
                p.publish(*part(fill, start, start + 4096))()
        if op.name == "bind+retain":
            self.batches = [keys.take(n) for _ in range(rounds + 1)]
            for p in providers:
                p.refs(retain=self.batches[0])()
        elif op.name == "bind":
            self.batches = [keys.take(n) for _ in range(rounds)]
        elif op.name in ("retain", "lookup_held"):
            self.batches = [keys.take(n) for _ in range(2)]
            for p in providers:
                for batch in self.batches:
                    p.publish(*batch)()
        else:
            self.batches = [keys.take(n) for _ in range(rounds)]

    def round(self, p: Provider, i: int):
        """(setup, timed, cleanup) callables for provider ``p`` in round ``i``."""
        name, b = self.op.name, self.batches
        nothing = lambda: None  # noqa: E731
        if name == "bind+retain":
            return nothing, p.bind(*b[i], retain=b[i + 1]), p.refs(release=b[i])
        if name == "bind":
            return nothing, p.bind(*b[i]), nothing
        if name == "retain":
            batch = b[i % 2]
            return nothing, p.refs(retain=batch), p.refs(release=batch)
        if name == "lookup_held":
            batch = b[i % 2]
            return p.refs(retain=batch), p.lookup_held(*batch), p.refs(release=batch)
        batch = b[i]  # release
        return p.publish(*batch, retain=batch), p.refs(release=batch), nothing


def load_store_at(sha: str) -> object:
    """The ``store/block_store.py`` of commit ``sha`` as a module (it must not import other
    r3capture modules)."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{sha}:store/block_store.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "from r3capture" in source:
        raise SystemExit(f"--before {sha}: that store imports other r3capture modules")
    path = Path(tempfile.mkdtemp()) / f"block_store_{sha}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def provider_names(vllm_store, before: str | None) -> list[str]:
    names = [OBJECTS, ROWS, STRINGS]
    if vllm_store is not None:
        names.append(VLLM)
    if before:
        names.append(f"r3capture@{before}")
    return names


def verify(op: Op, names, nbytes, vllm_store, before_module) -> None:
    """Replay ``GATE_ROUNDS`` rounds on fresh stores; every provider must end in the same
    state as vLLM's store (the key-rows provider's without vLLM). Raises SystemExit
    otherwise."""
    providers = [Provider(name, nbytes, vllm_store, before_module) for name in names]
    try:
        work = Workload(op, providers, seed=1, rounds=GATE_ROUNDS)
        for i in range(GATE_ROUNDS):
            for p in providers:
                for call in work.round(p, i):
                    if call is not None:
                        call()
        keys = [key for _, strings, _ in work.batches for key in strings]
        reference = providers[names.index(VLLM if VLLM in names else ROWS)]
        want = reference.state(keys)
        for p in providers:
            if p.state(keys) != want:
                raise SystemExit(
                    f"store bench: {p.name} ended {op.name} (n={op.n}) in a different state "
                    f"from {reference.name}; refusing to time it"
                )
    finally:
        for p in providers:
            p.close()


def measure(op: Op, names, nbytes, vllm_store, before_module) -> list[Result]:
    providers = [Provider(name, nbytes, vllm_store, before_module) for name in names]
    warmup = 3
    try:
        work = Workload(op, providers, seed=2, rounds=warmup + op.repeats)
        # vLLM's store has no slot lookup.
        timed = {p.name: p for p in providers if not (p.name == VLLM and op.name == "lookup_held")}

        def run(p: Provider) -> Callable[[int], np.ndarray]:
            def one(i: int) -> np.ndarray:
                setup, call, cleanup = work.round(p, i)
                setup()
                elapsed = timed_ns(call)
                cleanup()
                return elapsed

            return one

        samples = run_interleaved(
            {name: run(p) for name, p in timed.items()}, repeats=op.repeats, warmup=warmup
        )
    finally:
        for p in providers:
            p.close()
    return [
        make_result(
            "store",
            op.name,
            [op.n],
            "key",
            name,
            ns,
            n_keys=op.n,
            capacity_blocks=CAPACITY,
            block_nbytes=nbytes,
        )
        for name, ns in samples.items()
    ]


def run_ops(nbytes: int, vllm_store, before: str | None, quick: bool) -> list[Result]:
    before_module = load_store_at(before) if before else None
    names = provider_names(vllm_store, before)
    results: list[Result] = []
    for op in QUICK_OPS if quick else OPS:
        verify(op, names, nbytes, vllm_store, before_module)
        results += measure(op, names, nbytes, vllm_store, before_module)
        print(f"  measured {op.name} n={op.n}", flush=True)
    return results


def print_ops(results: list[Result]) -> None:
    names = list(dict.fromkeys(r.provider for r in results))
    ops = list(dict.fromkeys((r.op, r.params["n_keys"]) for r in results))
    p50 = {(r.op, r.params["n_keys"], r.provider): r.p50 for r in results}
    print("\nkey-row bookkeeping: median wall us per call (- = no such call)")
    print(f"{'op':>12s}{'n':>6s}" + "".join(f"{name:>24s}" for name in names))
    for op, n in ops:
        cells = (p50.get((op, n, name)) for name in names)
        print(
            f"{op:>12s}{n:>6d}"
            + "".join(f"{c:>24.1f}" if c is not None else f"{'-':>24s}" for c in cells)
        )


def plot_ops(ax, results: list[Result]) -> None:
    names = list(dict.fromkeys(r.provider for r in results))
    ops = list(dict.fromkeys((r.op, r.params["n_keys"]) for r in results))
    by = {(r.op, r.params["n_keys"], r.provider): r for r in results}
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for j, (op, n) in enumerate(ops):
            r = by.get((op, n, name))
            if r is not None:
                xs.append(j + k * width)
                ys.append(r.p50)
                lo.append(r.p50 - r.p20)
                hi.append(r.p80 - r.p50)
        ax.bar(xs, ys, width, yerr=[lo, hi], label=name, capsize=2)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ops))])
    ax.set_xticklabels([f"{op}\nn={n}" for op, n in ops], fontsize=6)
    ax.set(
        yscale="log",
        ylabel="us per call (median; p20-p80)",
        title=f"key-row bookkeeping ({CAPACITY}-block store)",
    )
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", which="both", alpha=0.3)
