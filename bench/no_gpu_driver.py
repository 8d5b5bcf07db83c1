"""A Triton driver for a machine without a GPU: kernels compile for a real target, launches
run nothing.

With it active, ``kernel[grid](...)`` does all of Triton's host-side launch work (binding
and specializing the arguments, the variant cache, compiling a new variant for sm_XX with
the ptxas in the Triton wheel, the launch metadata) and then hands the driver's launcher
its arguments, which this launcher records (when asked) instead of launching. So the CPU
can time what a launch costs the launching thread before the driver's C launcher, and a
test can check that two ways of launching hand the launcher the same arguments.

Use it in a process where TRITON_INTERPRET is unset: under the interpreter
``@triton.jit`` makes interpreter functions, which never reach a driver.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from triton.backends.compiler import GPUTarget
from triton.runtime import driver as driver_config

# Device properties the launch path reads (the H100's, for the launch-time resource checks).
_PROPERTIES = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536}


class NoGpuDriver:
    """The active-driver interface ``JITFunction.run`` and ``CompiledKernel`` use.

    ``launches``: the arguments of every recorded launch, ``(grid_0, grid_1, grid_2,
    stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``.
    """

    def __init__(self, arch: int = 90, *, record: bool = False) -> None:
        self.target = GPUTarget("cuda", arch, 32)
        self.record = record
        self.launches: list[tuple] = []
        self.utils = _Utils()
        driver = self

        class Launcher:
            def __init__(self, src: object, metadata: object) -> None:
                pass

            def __call__(self, *args: object) -> None:
                if driver.record:
                    driver.launches.append(args)

        self.launcher_cls = Launcher

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


class _Utils:
    def __init__(self) -> None:
        self._loaded = 0

    def load_binary(self, name, kernel, shared, device):
        # (module, function, registers, spills, max threads per block). Each compiled
        # variant gets its own handles, so a recorded launch says which variant it ran.
        self._loaded += 1
        return (self._loaded, self._loaded, 0, 0, 1024)

    def get_device_properties(self, device):
        return dict(_PROPERTIES)


@contextmanager
def no_gpu_driver(arch: int = 90, *, record: bool = False) -> Iterator[NoGpuDriver]:
    """``NoGpuDriver`` as Triton's active driver inside the block; the one before after it."""
    before = driver_config._active
    driver = NoGpuDriver(arch, record=record)
    driver_config.set_active(driver)
    try:
        yield driver
    finally:
        driver_config.set_active(before)
