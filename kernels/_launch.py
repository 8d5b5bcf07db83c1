"""Host-side launch machinery of the capture kernel: tile sizes, the Triton releases whose
compiled variants the launcher may launch itself, and that direct launch.

The launcher (``gather_alloc.GatherAllocLaunch``) sends the first launch of each per-step
type combination through Triton's JIT, which binds and specializes every argument, compiles
or finds the variant and launches it; later launches call that variant directly with the
same arguments, skipping most of the JIT's host CPU per launch (``bench.run triton_launch``).
Nothing that changes from step to step specializes the kernel, so the JIT's choice cannot
differ; a Triton knob that changes how it compiles (such as ``debug``) is read by each
variant's first launch only.
"""

from __future__ import annotations

import triton

# Row tiles of at most 8 rows x ~4096 elements keep every specialization's registers in
# check (ptxas -v); the request tiles mirror the row tiles, and the scans use tiles of the
# same shape.
_TILE_ELEMS = 4096
_MAX_BLOCK_ROWS = 8
_MAX_SCAN = 512
_NUM_WARPS = 4

# Triton releases whose compiled-kernel launch interface (``CompiledKernel.run`` with
# ``packed_metadata`` and the two launch hooks) the direct launch is tested on: the pinned
# 3.7 and the GPU image's 3.6. Any other release launches through Triton's JIT.
DIRECT_LAUNCH_TRITON = ("3.6", "3.7")


def _tile_config(row_elems: int) -> dict[str, int]:
    """Compile-time block sizes for rows of ``row_elems`` = L*K elements: ``BLOCK_ROWS``
    rows (and ``BLOCK_REQS`` requests) per program, ``BLOCK_COLS`` columns (the row padded
    to a power of two), and ``SCAN_ROWS``, the widest scan tile of the same register size."""
    block_cols = triton.next_power_of_2(row_elems)
    block_rows = max(1, min(_MAX_BLOCK_ROWS, _TILE_ELEMS // block_cols))
    return {
        "BLOCK_ROWS": block_rows,
        "BLOCK_COLS": block_cols,
        "BLOCK_REQS": block_rows,
        "SCAN_ROWS": min(_MAX_SCAN, _TILE_ELEMS // block_rows),
    }


def direct_launch_supported(version: str | None = None) -> bool:
    """Whether the launcher may launch compiled variants itself on Triton ``version``
    (default: the installed one); elsewhere every launch goes through Triton's JIT."""
    version = triton.__version__ if version is None else version
    return ".".join(version.split(".")[:2]) in DIRECT_LAUNCH_TRITON


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1, as Triton reads it)."""
    return bool(triton.knobs.runtime.interpret)


def _hooked(hook: object) -> bool:
    """Whether a Triton launch hook (a ``HookChain``, or a callable or None in older Triton)
    has anything to call."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_variant(variant: object, grid_0: int, stream: int, args: list) -> None:
    """Launch compiled ``variant`` on ``(grid_0, 1, 1)`` programs: what Triton's runner
    (``CompiledKernel.__getitem__``) does, minus the launch metadata and hook calls when no
    launch hook is set. The runner builds that metadata on every launch and its C launcher
    calls both hook chains, empty or not (measured on a GPU by ``bench.run gpu_parts``)."""
    runtime = triton.knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    metadata = None
    if _hooked(enter) or _hooked(leave):
        metadata = variant.launch_metadata((grid_0, 1, 1), stream, *args)
    else:
        enter = leave = None
    variant.run(
        grid_0, 1, 1, stream, variant.function, variant.packed_metadata, metadata, enter, leave,
        *args,
    )  # fmt: skip
