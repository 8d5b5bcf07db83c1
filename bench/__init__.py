"""r3capture benchmarks. Run one with ``python -m bench.run NAME`` (``all`` runs every one).

A benchmark is a module with ``main(argv: list[str]) -> int`` that writes its rows with
``bench.common.write_results``. Register it here by name.
"""

BENCHMARKS: dict[str, str] = {
    "store": "bench.store_bench",
    "host_step": "bench.host_step_bench",
    "host_ab": "bench.host_ab",
    "kernel": "bench.kernel_bench",
    "nvml": "bench.nvml_profile",
    "gpu_host_step": "bench.gpu_host_step",
    "gpu_parts": "bench.gpu_parts",
    "device_memory": "bench.device_memory",
    "triton_launch": "bench.triton_launch",
}
