"""Dispatch: ``python -m bench.run NAME [ARGS...]``, ``python -m bench.run all``, ``--list``."""

from __future__ import annotations

import importlib
import sys

from bench import BENCHMARKS

# bench/nvml_profile.py: 3 = no NVIDIA driver, 4 = NVML works but torch sees no CUDA.
NO_GPU_EXIT_CODES = (3, 4)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: python -m bench.run {" + ",".join([*BENCHMARKS, "all"]) + "} [ARGS...]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "all":
        names = list(BENCHMARKS)
    elif name in BENCHMARKS:
        names = [name]
    else:
        print(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    status = 0
    for each in names:
        print(f"== {each}", flush=True)
        code = importlib.import_module(BENCHMARKS[each]).main(rest)
        if name == "all" and code in NO_GPU_EXIT_CODES:
            # A GPU-only benchmark on a machine without one: it said so; not a failure.
            continue
        status |= code
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
