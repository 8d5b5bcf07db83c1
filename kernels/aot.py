"""Ahead-of-time compilation of the kernel specializations r3capture launches.

Compiles ttir -> ttgir -> llir -> ptx -> cubin for real GPU targets with no GPU and no
libcuda (ptxas ships in the Triton wheel), which catches code that the Triton interpreter
accepts but the GPU compiler rejects. Must run in a process where TRITON_INTERPRET is unset
(under the interpreter ``@triton.jit`` yields interpreter functions, not compilable ones):

    python -m r3capture.kernels.aot [--arch 80 --arch 90 --arch 100 --arch 120] [--out DIR]

prints one JSON object per (specialization, arch) and exits 1 if any compile failed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from r3capture.kernels._launch import _NUM_WARPS, _tile_config
from r3capture.kernels.gather_alloc import _ALLOC_SCAN, _PLAN_CHUNK, _gather_alloc_kernel

# A100 (sm_80), H100/H200 (sm_90), B200/GB200 (sm_100) and RTX/RTX PRO Blackwell (sm_120).
ARCHS = (80, 90, 100, 120)


@dataclass(frozen=True)
class GatherAllocSpec:
    """One compiled variant of the capture kernel (``gather_alloc``), as the launcher would
    specialize it."""

    name: str
    num_layers: int
    top_k: int
    hash_block: int
    capture: str = "i32"
    dest: str = "u8"
    index: str = "i32"  # query_start_loc, num_rejected
    request_index: str = "i64"  # MRV2's input_batch.idx_mapping
    positions: str = "i64"
    has_rejected: bool = True
    has_fresh: bool = False
    rows_layout: bool = False

    def source(self) -> ASTSource:
        fn = _gather_alloc_kernel
        signature = {
            "capture_ptr": f"*{self.capture}",
            "qsl_ptr": f"*{self.index}",
            "pos_ptr": f"*{self.positions}",
            "idx_ptr": f"*{self.request_index}",
            "rejected_ptr": f"*{self.index}",
            "fresh_ptr": "*u8",
            "ring_ptr": "*i64",
            "record_ptr": "*i64",
            "queue_ptr": "*i32",
            "heads_ptr": "*i64",
            "dest_ptr": f"*{self.dest}",
            "info_ptr": "*i32",
        }
        signature.update({name: "i32" for name in _ALLOC_I32_ARGS})
        signature.update({name: "i64" for name in ("launch", "queue_tail")})
        tiles = _tile_config(self.num_layers * self.top_k)
        constexprs = {
            "ROW_ELEMS": self.num_layers * self.top_k,
            "HASH_BLOCK": self.hash_block,
            "HAS_REJECTED": self.has_rejected,
            "HAS_FRESH": self.has_fresh,
            "ROWS_LAYOUT": self.rows_layout,
            "BLOCK_ROWS": tiles["BLOCK_ROWS"],
            "BLOCK_COLS": tiles["BLOCK_COLS"],
            "BLOCK_REQS": tiles["BLOCK_REQS"],
            "SCAN": min(_ALLOC_SCAN, tiles["SCAN_ROWS"]),
            "CHUNK": min(_PLAN_CHUNK, tiles["SCAN_ROWS"]),
        }
        signature.update({name: "constexpr" for name in constexprs})
        missing = set(fn.arg_names) - set(signature)
        if missing:
            raise AssertionError(f"AOT signature lacks kernel arguments {sorted(missing)}")
        return ASTSource(fn=fn, signature=signature, constexprs=constexprs)


_ALLOC_I32_ARGS = (
    "num_reqs", "row_limit", "num_slots", "num_indices", "ring_width", "queue_size",
    "num_steps", "stride_ring", "stride_dest", "stride_info",
)  # fmt: skip

GATHER_ALLOC_SPECS = (
    GatherAllocSpec("alloc-tiny-L1K1-B16-u8", 1, 1, 16),
    GatherAllocSpec("alloc-qwen3-30b-a3b-48x8-B16-u8", 48, 8, 16),
    GatherAllocSpec("alloc-qwen3-30b-a3b-48x8-B16-u8-norej", 48, 8, 16, has_rejected=False),
    GatherAllocSpec("alloc-qwen3-30b-a3b-48x8-B16-u8-fresh", 48, 8, 16, has_fresh=True),
    GatherAllocSpec("alloc-kimi-k2-61x8-B16-u16", 61, 8, 16, dest="u16"),
    GatherAllocSpec("alloc-kimi-k2-61x8-B16-u16-norej", 61, 8, 16, dest="u16", has_rejected=False),
    GatherAllocSpec("alloc-qwen3-30b-a3b-48x8-B16-u8-rows", 48, 8, 16, rows_layout=True),
    GatherAllocSpec("alloc-kimi-k2-61x8-B16-u16-rows", 61, 8, 16, dest="u16", rows_layout=True),
    GatherAllocSpec("alloc-deepseek-v3-61x8-B32-i64idx-u8", 61, 8, 32, index="i64"),
    GatherAllocSpec("alloc-narrow-capture-36x4-B16-u16-u16", 36, 4, 16, capture="u16", dest="u16"),
    GatherAllocSpec("alloc-mixtral-32x2-B16-u8", 32, 2, 16),
    # Rows of more than 4,096 elements: tiles of one row and one request.
    GatherAllocSpec("alloc-wide-row-65x64-B16-u16", 65, 64, 16, dest="u16"),
)


def _ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spill bytes per thread, from the ptxas that ships with Triton."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(arch).path
    except (ImportError, AttributeError, RuntimeError):
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        # Triton targets the arch-specific name from sm_90 on (sm_90a, sm_100a, sm_120a):
        # ptxas accepts the PTX only under the target it names.
        named = re.search(r"^\.target\s+(sm_\w+)", ptx, re.MULTILINE)
        target = named.group(1) if named else f"sm_{arch}"
        proc = subprocess.run(
            [ptxas, f"-arch={target}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True,
        )  # fmt: skip
    regs = re.search(r"Used (\d+) registers", proc.stderr)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", proc.stderr)
    if proc.returncode != 0 or regs is None:
        return {}
    return {"registers": int(regs.group(1)), "spill_bytes": sum(int(x) for x in spills)}


def compile_spec(spec: GatherAllocSpec, arch: int) -> dict:
    """Compile one spec for sm_<arch>; returns a JSON-able record (cubin size, registers)."""
    t0 = time.perf_counter()
    kernel = triton.compile(
        spec.source(), target=GPUTarget("cuda", arch, 32), options={"num_warps": _NUM_WARPS}
    )
    cubin = kernel.asm.get("cubin", b"")
    return {
        "kernel": "gather_alloc",
        "spec": spec.name,
        "arch": f"sm_{arch}",
        "cubin_bytes": len(cubin),
        "ptx_bytes": len(kernel.asm.get("ptx", "")),
        "shared_bytes": int(kernel.metadata.shared),
        **_ptxas_usage(kernel.asm.get("ptx", ""), arch),
        "seconds": round(time.perf_counter() - t0, 3),
        "triton": triton.__version__,
        "_cubin": cubin,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", type=int, action="append", help=f"SM version (default: {list(ARCHS)})"
    )
    parser.add_argument("--out", type=Path, help="also write <spec>.sm_<arch>.cubin files here")
    args = parser.parse_args(argv)
    if triton.knobs.runtime.interpret:
        print("aot: unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
        return 2
    failed = 0
    for arch in args.arch or ARCHS:
        for spec in GATHER_ALLOC_SPECS:
            try:
                record = compile_spec(spec, arch)
            except Exception as exc:  # noqa: BLE001 - report every failing spec, then exit 1
                failed += 1
                record = {"spec": spec.name, "arch": f"sm_{arch}", "error": repr(exc)[:2000]}
            cubin = record.pop("_cubin", b"")
            if args.out is not None and cubin:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{spec.name}.{record['arch']}.cubin").write_bytes(cubin)
            print(json.dumps(record), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
