"""Store benchmark: publish and materialize throughput, r3capture BlockStore vs vLLM 0.33.0.

Workload: routed-experts blocks of B=16 tokens x L=48 layers x K=8 experts, uint8 (6144 bytes
per block), batches of 1..512 blocks, keys shaped like vLLM's ``vllm-artifact/{gen}/{hash}``.
Every store is full before timing starts, so every publish evicts as many blocks as it adds:
the steady state of a serving worker.

Providers (same process, same keys, interleaved round-robin):
  publish
    r3capture.put_array   ``put_array(keys, blocks)`` from one ``[n, B, L, K]`` array.
    r3capture.bind        ``allocate(n)`` + ``bind(keys, slots)``. The producer's write into the
                          slots is the capture kernel's (on the GPU, direct to host) and is not
                          timed here.
    vllm.BlockObjectStore vLLM's ``publish_routed_experts`` (a ``BlockObject`` + ``tobytes`` per
                          block, then ``put``), from the same array.
    vllm.BackgroundBlockObjectStore  the same through vLLM's writer thread, up to the barrier
                          that makes the blocks readable (``get_concatenated([])``).
  materialize
    r3capture.get_array   ``get_array(keys)`` viewed as ``[n*B, L, K]``.
    vllm.*                vLLM's ``materialize_routed_experts`` (``get_concatenated`` +
                          ``frombuffer``).

Before any timing, every provider's blocks are read back through every reader and compared
byte-for-byte with the source; no ratio is reported unless all of them match. Ratios are the
vLLM median over ours (throughput ratio).

Then the key-row bookkeeping operations of ``bench/store_ops.py`` (bind with retains, bulk
retains, held lookups, releases, with key rows and key strings; ``--before SHA`` adds the store
of an earlier commit to the same run), behind their own state-equality gate.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Callable

import numpy as np

from bench.common import Result, make_result, run_interleaved, timed_ns, write_results
from bench.store_ops import plot_ops, print_ops, run_ops
from r3capture.store import BlockStore

B, L, K = 16, 48, 8
DTYPE = np.uint8
NBYTES = B * L * K * np.dtype(DTYPE).itemsize
CAPACITY = 4096  # blocks per store (25 MB)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TARGET = 5.0

OURS_PUT, OURS_BIND, OURS_GET = "r3capture.put_array", "r3capture.bind", "r3capture.get_array"
VLLM, VLLM_BG = "vllm.BlockObjectStore", "vllm.BackgroundBlockObjectStore"
COLORS = {
    OURS_PUT: "tab:blue",
    OURS_BIND: "tab:green",
    OURS_GET: "tab:purple",
    VLLM: "tab:red",
    VLLM_BG: "tab:orange",
}

_key_ids = itertools.count()


def fresh_keys(n: int) -> list[str]:
    return [f"vllm-artifact/0/{next(_key_ids):064x}" for _ in range(n)]


def repeats_for(n: int, quick: bool) -> int:
    return 10 if quick else int(np.clip(60000 // n, 100, 600))


class Stores:
    """One store per provider, each filled to capacity."""

    def __init__(self, vllm_store, vllm_experts) -> None:
        self.vllm_store, self.vllm_experts = vllm_store, vllm_experts
        self.ours = BlockStore(max_bytes=CAPACITY * NBYTES, object_nbytes=NBYTES)
        self.bound = BlockStore(
            max_bytes=CAPACITY * NBYTES, object_nbytes=NBYTES, reserve_slots=max(SIZES)
        )
        fill = fresh_keys(CAPACITY)
        zeros = np.zeros((CAPACITY, NBYTES), dtype=np.uint8)
        self.ours.put_array(fill, zeros)
        for start in range(0, CAPACITY, max(SIZES)):
            self.bound.bind(fill[start : start + max(SIZES)], self.bound.allocate(max(SIZES)))
        self.vllm = self.bg = None
        if vllm_store is not None:
            size = {"max_bytes": CAPACITY * NBYTES, "object_nbytes": NBYTES}
            self.vllm = vllm_store.BlockObjectStore(**size)
            self.bg = vllm_store.BackgroundBlockObjectStore(
                vllm_store.BlockObjectStore(**size),
                max_pending_batches=2 * max(SIZES),
            )
            objects = [vllm_store.BlockObject(key, bytes(NBYTES)) for key in fill]
            self.vllm.put(objects)
            self.bg.put(objects)

    def publishers(self, rows: np.ndarray) -> dict[str, Callable[[list[str]], int]]:
        """Publish ``rows`` (``[n*B, L, K]``) under the given keys; return the timed ns."""
        n = len(rows) // B
        blocks = rows.reshape(n, B, L, K)

        def put_array(keys):
            return timed_ns(lambda: self.ours.put_array(keys, blocks))

        def bind(keys):
            slots = np.empty(0)

            def allocate():
                nonlocal slots
                slots = self.bound.allocate(n)

            elapsed = timed_ns(allocate)
            self.bound.arena_np[slots] = blocks.reshape(n, NBYTES)  # the producer's write
            return elapsed + timed_ns(lambda: self.bound.bind(keys, slots))

        out = {OURS_PUT: put_array, OURS_BIND: bind}
        if self.vllm is not None:
            publish = self.vllm_experts.publish_routed_experts
            vllm_blocks = [(j * B, rows[j * B : (j + 1) * B]) for j in range(n)]

            def vllm(keys):
                return timed_ns(
                    lambda: publish(self.vllm, batches=[(keys, vllm_blocks)], block_size=B)
                )

            def vllm_bg(keys):
                def publish_and_wait():
                    publish(self.bg, batches=[(keys, vllm_blocks)], block_size=B)
                    self.bg.get_concatenated([])

                return timed_ns(publish_and_wait)

            out.update({VLLM: vllm, VLLM_BG: vllm_bg})
        return out

    def readers(self) -> dict[str, Callable[[list[str]], np.ndarray]]:
        """Materialize the rows ``[n*B, L, K]`` of the given keys."""

        def ours(keys, store=self.ours):
            return store.get_array(keys).reshape(-1, L, K)

        out = {OURS_GET: ours}
        if self.vllm is not None:
            materialize = self.vllm_experts.materialize_routed_experts
            for name, store in ((VLLM, self.vllm), (VLLM_BG, self.bg)):
                out[name] = lambda keys, s=store: materialize(
                    s, keys, shape_per_token=(L, K), dtype=np.dtype(DTYPE)
                )
        return out

    def verify(self, n: int, rng: np.random.Generator) -> None:
        """Publish fresh random blocks through every publisher, read them back through every
        reader of that store, compare bytes. Raises SystemExit on any difference."""
        rows = rng.integers(0, 256, size=(n * B, L, K), dtype=np.uint8)
        publishers = self.publishers(rows)
        readers = self.readers()
        pairs = [(OURS_PUT, OURS_GET, readers[OURS_GET])]
        pairs.append(
            (
                OURS_BIND,
                "r3capture.get_array(bind)",
                lambda k: readers[OURS_GET](k, store=self.bound),
            )
        )
        if self.vllm is not None:
            pairs += [(VLLM, VLLM, readers[VLLM]), (VLLM_BG, VLLM_BG, readers[VLLM_BG])]
        for writer, reader_name, read in pairs:
            keys = fresh_keys(n)
            publishers[writer](keys)
            got = read(keys)
            same = got.dtype == rows.dtype and got.shape == rows.shape
            if not same or got.tobytes() != rows.tobytes():
                raise SystemExit(
                    f"store bench: {writer} -> {reader_name} returned different bytes for "
                    f"n={n} blocks; refusing to report ratios"
                )

    def close(self) -> None:
        self.ours.close()
        self.bound.close()
        if self.vllm is not None:
            self.vllm.close()
            self.bg.close()


def measure(stores: Stores, n: int, quick: bool, rng: np.random.Generator) -> list[Result]:
    repeats, warmup = repeats_for(n, quick), 3
    rows = rng.integers(0, 256, size=(n * B, L, K), dtype=np.uint8)
    key_batches = [fresh_keys(n) for _ in range(warmup + repeats)]
    publishers = stores.publishers(rows)
    published = run_interleaved(
        {name: (lambda i, p=pub: p(key_batches[i])) for name, pub in publishers.items()},
        repeats=repeats,
        warmup=warmup,
    )
    # Read back recent batches (all still stored in every store), cycling so reads are not
    # all served from the same few cache-hot slots.
    recent = key_batches[-min(len(key_batches), CAPACITY // n // 2) :]
    read = run_interleaved(
        {
            name: (lambda i, r=reader: timed_ns(lambda: r(recent[i % len(recent)])))
            for name, reader in stores.readers().items()
        },
        repeats=repeats,
        warmup=warmup,
    )
    shape = [n, B, L, K]
    results = []
    for op, samples in (("publish", published), ("materialize", read)):
        for provider, ns in samples.items():
            result = make_result(
                "store",
                op,
                shape,
                np.dtype(DTYPE).name,
                provider,
                ns,
                n_blocks=n,
                block_nbytes=NBYTES,
                capacity_blocks=CAPACITY,
            )
            result.params["gbps_p50"] = n * NBYTES / (result.p50 * 1e3)
            results.append(result)
    return results


def ratios(results: list[Result]) -> list[dict]:
    by_key = {(r.op, r.params["n_blocks"], r.provider): r for r in results}
    out = []
    for (op, n, provider), result in by_key.items():
        if not provider.startswith("r3capture"):
            continue
        for baseline in (VLLM, VLLM_BG):
            if (op, n, baseline) in by_key:
                base = by_key[(op, n, baseline)]
                out.append(
                    {
                        "op": op,
                        "n_blocks": n,
                        "provider": provider,
                        "baseline": baseline,
                        "ratio_p50": base.p50 / result.p50,
                        "ratio_cpu_p50": base.params["cpu_p50"] / result.params["cpu_p50"],
                    }
                )
    return out


def figure(results: list[Result], table: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(23, 4.8))
    plot_ops(axes[3], [r for r in results if r.dtype == "key"])
    results = [r for r in results if r.dtype != "key"]
    for ax, op in zip(axes[:2], ("publish", "materialize")):
        providers = sorted({r.provider for r in results if r.op == op})
        for provider in providers:
            rows = sorted(
                (r for r in results if r.op == op and r.provider == provider),
                key=lambda r: r.params["n_blocks"],
            )
            ns = [r.params["n_blocks"] for r in rows]
            color = COLORS[provider]
            ax.plot(
                ns, [r.params["gbps_p50"] for r in rows], marker="o", label=provider, color=color
            )
            ax.fill_between(
                ns,
                [n * NBYTES / (r.p80 * 1e3) for n, r in zip(ns, rows)],
                [n * NBYTES / (r.p20 * 1e3) for n, r in zip(ns, rows)],
                alpha=0.2,
                color=color,
            )
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="blocks per batch",
            ylabel="GB/s (median; band p20-p80)",
            title=f"{op} throughput",
        )
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[2]
    for (_, provider, baseline), group in itertools.groupby(
        sorted(table, key=lambda t: (t["op"], t["provider"], t["baseline"], t["n_blocks"])),
        key=lambda t: (t["op"], t["provider"], t["baseline"]),
    ):
        group = list(group)
        ax.plot(
            [t["n_blocks"] for t in group],
            [t["ratio_cpu_p50"] for t in group],
            marker="o",
            color=COLORS[provider],
            linestyle="-" if baseline == VLLM else ":",
            label=f"{provider} vs {baseline.split('.')[1]}",
        )
    ax.axhline(TARGET, color="k", linestyle="--", linewidth=1, label=f"target {TARGET:g}x")
    ax.axvline(16, color="grey", linestyle=":", linewidth=1)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="blocks per batch",
        ylabel="vLLM median / ours (process CPU time)",
        title="speed-up over vLLM 0.33.0 (CPU time: robust to a shared machine)",
    )
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(
        f"BlockStore vs vLLM 0.33.0: blocks of [{B}, {L}, {K}] uint8 ({NBYTES} B), "
        f"store of {CAPACITY} blocks kept full"
    )
    return fig


SHORT = {
    OURS_PUT: "put_array",
    OURS_BIND: "bind",
    OURS_GET: "get_array",
    VLLM: "vllm",
    VLLM_BG: "vllm-bg",
}


def print_table(results: list[Result], table: list[dict]) -> None:
    p50 = {(r.op, r.params["n_blocks"], r.provider): r.p50 for r in results}
    ratio = {(t["op"], t["n_blocks"], t["provider"], t["baseline"]): t for t in table}
    for op in ("publish", "materialize"):
        names = [p for p in SHORT if any(k[0] == op and k[2] == p for k in p50)]
        pairs = [
            (o, b)
            for o in names
            if o.startswith("r3capture")
            for b in (VLLM, VLLM_BG)
            if any(k[0] == op and k[2:] == (o, b) for k in ratio)
        ]
        print(f"\n{op}: median wall us per batch | speed-up = vLLM median / ours, wall (CPU time)")
        print(
            f"{'blocks':>6s}"
            + "".join(f"{SHORT[p]:>10s}" for p in names)
            + " |"
            + "".join(f"{SHORT[o] + '/' + SHORT[b]:>22s}" for o, b in pairs)
        )
        for n in sorted({k[1] for k in p50 if k[0] == op}):
            cells = (ratio[(op, n, o, b)] for o, b in pairs)
            print(
                f"{n:>6d}"
                + "".join(f"{p50[(op, n, p)]:>10.1f}" for p in names)
                + " |"
                + "".join(f"{t['ratio_p50']:>13.2f}x ({t['ratio_cpu_p50']:.2f}x)" for t in cells)
            )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="few sizes and repeats, results not written (a smoke run)",
    )
    parser.add_argument(
        "--before",
        metavar="SHA",
        help="also time the key-row operations on the store of commit SHA (same run)",
    )
    parser.add_argument(
        "--ops-only", action="store_true", help="only the key-row bookkeeping operations"
    )
    args = parser.parse_args(argv)
    try:
        from vllm.distributed.aux_output_connector import routed_experts as vllm_experts
        from vllm.distributed.aux_output_connector import store as vllm_store
    except ImportError as error:
        print(f"vLLM 0.33.0 not importable ({error}); timing r3capture only, no ratios")
        vllm_store = vllm_experts = None
    sizes = () if args.ops_only else (1, 16, 128) if args.quick else SIZES
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()
    results: list[Result] = []
    if sizes:
        stores = Stores(vllm_store, vllm_experts)
        try:
            for n in sizes:
                stores.verify(n, rng)  # gate: no timing, let alone a ratio, on wrong bytes
                results += measure(stores, n, args.quick, rng)
                print(f"  measured {n} blocks/batch", flush=True)
        finally:
            stores.close()
    table = ratios(results)
    print_table(results, table)
    ops = run_ops(NBYTES, vllm_store, args.before, args.quick)
    print_ops(ops)
    if args.quick or args.ops_only:
        return 0
    results += ops
    workload = {
        "block": [B, L, K],
        "dtype": np.dtype(DTYPE).name,
        "block_nbytes": NBYTES,
        "capacity_blocks": CAPACITY,
        "sizes": list(sizes),
        "timer": "time.perf_counter_ns, providers interleaved round-robin",
        # a shared machine: the 1-minute load average says how noisy the run was
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "cpu_count": os.cpu_count(),
    }
    paths = write_results(
        "store",
        results,
        figure=figure(results, table),
        extra={
            "workload": workload,
            "verified_byte_equal": True,
            "target_ratio": TARGET,
            "ratios": table,
        },
    )
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0
