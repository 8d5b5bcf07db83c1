#!/usr/bin/env bash
# Everything r3capture checks on a GPU, in one run, results in one folder.
#
#   bash bench/gpu_check.sh [OUT_DIR [STAGE...]]     (default bench/results/gpu, every stage)
#
# Made for the project's H200 image (python3.12, torch 2.11, triton 3.6.0, nvidia-ml-py,
# pytest; no vLLM, no internet): installs r3capture offline from this checkout, then runs
# the stages pytest_gpu (the gpu-marked tests), gpu_host_step (main-thread host cost of the
# real path against vLLM's GPU path), gpu_parts (where that time goes, and each device
# operation's host cost), kernel_bench (direct-to-pinned against staging + one copy, against
# vLLM's cast + copy) and nvml_profile (device memory); naming stages runs only those. Each
# stage has its own time limit so a whole run stays under 8 minutes; a failing stage does
# not stop the later ones. Exit status: 0 when every stage run passed, 1 when one failed, 2
# when there is no usable GPU or an unknown stage was named (checked first, in seconds;
# nothing is installed or written then).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results/gpu}"
PY="${PYTHON:-python3}"
ALL_STAGES="pytest_gpu gpu_host_step gpu_parts kernel_bench nvml_profile"
STAGES="${*:2}"
for name in $STAGES; do
    case " $ALL_STAGES " in
    *" $name "*) ;;
    *) echo "gpu_check: unknown stage '$name'; known: $ALL_STAGES" >&2; exit 2 ;;
    esac
done
STAGES="${STAGES:-$ALL_STAGES}"

gpu=$(timeout 60 "$PY" -c 'import sys
try:
    import torch
except ImportError as exc:
    sys.exit(f"{sys.executable} cannot import torch ({exc})")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device")
print(torch.cuda.get_device_name())' 2>&1)
if [ $? -ne 0 ]; then
    echo "gpu_check: no usable GPU: ${gpu:-probe timed out}" >&2
    echo "gpu_check: nothing was run; run this on a CUDA machine (CPU checks: pytest tests)" >&2
    exit 2
fi
echo "gpu_check: on $gpu"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
status=0

stage() {  # stage NAME LIMIT_SECONDS COMMAND...
    local name="$1" limit="$2"
    shift 2
    case " install imports $STAGES " in
    *" $name "*) ;;
    *) echo "$name: not run (not named)" | tee -a "$SUMMARY"; return 0 ;;
    esac
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local verdict=ok
    if [ "$rc" -ne 0 ]; then verdict="FAILED (exit $rc)"; status=1; fi
    echo "$name: $verdict in $((SECONDS - t0)) s" | tee -a "$SUMMARY"
    return "$rc"
}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    # A copy of the tree may carry an older .git; the source digest names the tree that ran
    # (the same command in a checkout gives the same line: bash bench/tree_digest.sh).
    echo "git: $(git rev-parse HEAD 2>/dev/null || echo 'no .git in this copy')"
    echo "source digest: $(bash bench/tree_digest.sh)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
        --format=csv 2>&1
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)' 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"

stage install 40 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . &&
    stage imports 20 "$PY" -c 'import r3capture.kernels, r3capture.store, r3capture.aux_output
from r3capture.kernels import can_write_host_directly
print("direct host writes:", can_write_host_directly("cuda"))'
# Only the suites with gpu tests: others need vLLM or hypothesis, which this image lacks.
stage pytest_gpu 100 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    tests/kernels tests/bench tests/aux_output/test_worker_gpu.py \
    --junitxml="$OUT/pytest_gpu.xml" -rs
stage gpu_host_step 200 env PYTHONUNBUFFERED=1 "$PY" -m bench.gpu_host_step --rounds 2 --out "$OUT"
stage gpu_parts 60 env PYTHONUNBUFFERED=1 "$PY" -m bench.gpu_parts --out "$OUT"
stage kernel_bench 90 env PYTHONUNBUFFERED=1 "$PY" -m bench.kernel_bench --out "$OUT"
stage nvml_profile 150 "$PY" -m bench.nvml_profile --out "$OUT"

[ -f "$OUT/pytest_gpu.log" ] && tail -n 3 "$OUT/pytest_gpu.log" | sed 's/^/pytest: /' | tee -a "$SUMMARY"
exit "$status"
