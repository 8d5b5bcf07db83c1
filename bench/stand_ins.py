"""Launch-cost stand-ins for the GPU work of each connector, the same for both.

On a GPU, each connector's GPU work costs its host thread one kernel launch: vLLM's
``RoutedExpertsCapturer.snapshot_routing_data`` launches one cast of every scheduled row,
r3capture's worker launches one ``gather_alloc`` kernel. On a CPU-only machine that work would
run on the host instead (vLLM's cast as a torch CPU cast, r3capture's kernel as its torch
reference), and its time says nothing about a GPU host. So neither side's emulation counts:

* vLLM: ``SnapshotStandIn`` replaces the capturer. The harness computes the cast with
  ``stage()`` before the timed ``prepare_output``; inside it, ``snapshot_routing_data``
  runs ``launch_stand_in()`` once and returns the cast already made, as a
  ``DeviceSnapshot``. ``enqueue_cpu_copy`` then moves it to the host with
  ``.to("cpu", non_blocking=True)``: on a GPU a device-to-host copy launch, on a CPU a
  no-op that would cost vLLM nothing, so ``DeviceSnapshot.to`` runs one
  ``launch_stand_in()`` too (r3capture's copies back run as real, tiny CPU copies).
* r3capture: ``KernelStandIn`` wraps the kernel's CPU emulation, the torch reference that
  ``GatherAllocLaunch.launch_checked`` runs in place of the Triton launch
  (``kernel_binding()``). The reference still runs (the outputs need its writes: the rows,
  ``step_info``, and the slots it takes from the free-slot queue into the device ring), but
  its wall and thread-CPU time are added to ``excluded_*``, which the harness subtracts
  from the enclosing call, and ``launch_stand_in()`` runs once per launch, inside the
  enclosing call's time. Everything the launch does on the host before the kernel (the
  per-step argument checks) counts. There is no other device work per step: the kernel
  takes its slots itself, so nothing is uploaded. r3capture's copies back
  (``enqueue_cpu_copy``) run as real, tiny CPU copies and count.

``launch_stand_in`` is one tiny torch op (a 64-element int32 -> uint8 copy): the fixed cost of
entering torch's dispatcher for one operation, which is what a launch costs the host thread
before any driver work. ``measure`` reports it; a real CUDA launch costs the host more (the
driver call, and for a Triton kernel its Python launcher), which neither side pays here.
"""

from __future__ import annotations

import importlib
import time
from types import ModuleType
from typing import Any

import numpy as np
import torch

_SRC = torch.zeros(64, dtype=torch.int32)
_DST = torch.empty(64, dtype=torch.uint8)


def launch_stand_in() -> None:
    """The one op that stands for one kernel launch, on either side."""
    _DST.copy_(_SRC)


def measure(calls: int = 5000) -> dict[str, float]:
    """Median wall and thread-CPU nanoseconds of one ``launch_stand_in()``."""
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    for _ in range(200):
        launch_stand_in()
    samples = np.empty((calls, 2), np.int64)
    for i in range(calls):
        w0, c0 = wall(), cpu()
        launch_stand_in()
        c1, w1 = cpu(), wall()
        samples[i] = (w1 - w0, c1 - c0)
    return {
        "wall_ns_p50": float(np.median(samples[:, 0])),
        "cpu_ns_p50": float(np.median(samples[:, 1])),
    }


# The kernel's CPU emulation, which GatherAllocLaunch imports when it is built without
# Triton and calls from launch_checked.
KERNEL_BINDINGS = (("r3capture.kernels.alloc_reference", "gather_alloc_reference_checked"),)


def kernel_binding() -> tuple[ModuleType, str]:
    """(module, attribute) of the function that emulates r3capture's kernel on a CPU."""
    for module_name, attr in KERNEL_BINDINGS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:
                continue
            raise
        if callable(getattr(module, attr, None)):
            return module, attr
    names = ", ".join(f"{m}.{a}" for m, a in KERNEL_BINDINGS)
    raise RuntimeError(f"r3capture's worker kernel not found under any of: {names}")


class KernelStandIn:
    """Context manager: r3capture's device work, its one kernel launch per step, runs with
    its time excluded, plus one stand-in launch per kernel launch.

    ``excluded_wall_ns`` / ``excluded_cpu_ns`` accumulate the wrapped calls' time;
    ``launches`` counts kernel launches.

    ``defer=True`` (a what-if): the emulation runs where a host would next wait for the
    device instead of inside the launching call, as a GPU runs the kernel while the host goes
    on: ``settle()`` runs the launches made since the last one, in order; the harness calls
    it before it writes the next step's rows and before each ``process_output``, and the
    worker's ``DeviceSide.wait_idle`` (a store about to replace its arena) calls it first.
    """

    def __init__(self, *, defer: bool = False) -> None:
        self.excluded_wall_ns = 0
        self.excluded_cpu_ns = 0
        self.launches = 0
        self.defer = defer
        self._deferred: list[tuple[Any, tuple, dict]] = []
        self._bindings: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> KernelStandIn:
        module, attr = kernel_binding()
        self._wrap(module, attr)
        if self.defer:
            from r3capture.aux_output.device_side import DeviceSide

            wait_idle = DeviceSide.wait_idle

            def settled_wait_idle(side: Any) -> None:
                self.settle()
                wait_idle(side)

            self._bindings.append((DeviceSide, "wait_idle", wait_idle))
            DeviceSide.wait_idle = settled_wait_idle
        return self

    def settle(self) -> None:
        """Run the deferred launches (``defer``), oldest first, with their time excluded."""
        wall, cpu = time.perf_counter_ns, time.thread_time_ns
        while self._deferred:
            original, args, kwargs = self._deferred.pop(0)
            w0, c0 = wall(), cpu()
            original(*args, **kwargs)
            c1, w1 = cpu(), wall()
            self.excluded_wall_ns += w1 - w0
            self.excluded_cpu_ns += c1 - c0

    def _wrap(self, module: ModuleType, attr: str) -> None:
        """Replace ``module.attr``, the kernel's emulation, by one stand-in launch: the
        emulation runs with its time excluded, now or (``defer``) at the next ``settle``."""
        original = getattr(module, attr)
        wall, cpu = time.perf_counter_ns, time.thread_time_ns
        deferred = self._deferred

        def stand_in(*args: Any, **kwargs: Any) -> Any:
            self.launches += 1
            if self.defer:
                # The launcher refills its dict of arguments at its next launch, which the
                # harness settles this one before (a copy here would cost the timed call
                # what no GPU launch costs): a launch still pending with the same dict is
                # an error, never a wrong emulation.
                if deferred and any(args[0] is pending[1][0] for pending in deferred):
                    raise RuntimeError(
                        "a deferred kernel launch was not settled before the next launch"
                    )
                deferred.append((original, args, kwargs))
                launch_stand_in()
                return None
            w0, c0 = wall(), cpu()
            try:
                return original(*args, **kwargs)
            finally:
                c1, w1 = cpu(), wall()
                self.excluded_wall_ns += w1 - w0
                self.excluded_cpu_ns += c1 - c0
                launch_stand_in()

        self._bindings.append((module, attr, original))
        setattr(module, attr, stand_in)

    def __exit__(self, *exc: object) -> None:
        self.settle()
        while self._bindings:
            module, attr, original = self._bindings.pop()
            setattr(module, attr, original)


# Ablations: parts of r3capture's host work that a what-if run counts as free, each as
# (module, attribute path) of the callables the worker calls by that name.
ABLATIONS = {
    # The argument checks of the three main-thread calls.
    "input-checks": (
        ("r3capture.aux_output.worker", "checked_emit_starts"),
        ("r3capture.aux_output.step_launcher", "checked_batch_arrays"),
        ("r3capture.aux_output.step_launcher", "step_tensors_pass"),
    ),
    # Publication: block hashes becoming keys, blocks bound to them, pins, teardown. Not
    # capturing opted-out requests' rows (issue 60) could save at most their share of it.
    "publication": (
        ("r3capture.aux_output.key_work", "KeyWorkQueue.apply"),
        ("r3capture.aux_output.publisher", "Publisher.publish"),
        ("r3capture.aux_output.publisher", "Publisher.flush"),
    ),
}


class FreeParts:
    """Context manager for a what-if run: the ``ABLATIONS`` named in ``parts`` still run (the
    outputs need them), but their whole wall and thread-CPU time, stand-in launches inside
    included, is added to ``exclusion``'s ``excluded_*`` (an entered ``KernelStandIn``), so
    the harness subtracts it from the enclosing call as if the parts cost nothing."""

    def __init__(self, exclusion: KernelStandIn, parts: list[str]) -> None:
        unknown = [part for part in parts if part not in ABLATIONS]
        if unknown:
            raise ValueError(f"unknown ablation {unknown}; known: {', '.join(ABLATIONS)}")
        self._exclusion = exclusion
        self._parts = parts
        self._bindings: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> FreeParts:
        for part in self._parts:
            for module_name, path in ABLATIONS[part]:
                owner: Any = importlib.import_module(module_name)
                *outer, attr = path.split(".")
                for name in outer:
                    owner = getattr(owner, name)
                original = getattr(owner, attr)
                self._bindings.append((owner, attr, original))
                setattr(owner, attr, self._free(original))
        return self

    def _free(self, original: Any) -> Any:
        exclusion = self._exclusion
        wall, cpu = time.perf_counter_ns, time.thread_time_ns

        def free(*args: Any, **kwargs: Any) -> Any:
            wall_before, cpu_before = exclusion.excluded_wall_ns, exclusion.excluded_cpu_ns
            w0, c0 = wall(), cpu()
            try:
                return original(*args, **kwargs)
            finally:
                c1, w1 = cpu(), wall()
                # The whole call: exclusions made inside it are part of its time.
                exclusion.excluded_wall_ns = wall_before + (w1 - w0)
                exclusion.excluded_cpu_ns = cpu_before + (c1 - c0)

        return free

    def __exit__(self, *exc: object) -> None:
        while self._bindings:
            owner, attr, original = self._bindings.pop()
            setattr(owner, attr, original)


class DeviceSnapshot:
    """vLLM's snapshot as its ``PendingAuxOutput`` holds it: ``.to(device, non_blocking)``
    (its only use) costs one stand-in launch, the device-to-host copy it is on a GPU, and
    returns the staged host tensor."""

    __slots__ = ("_staged",)

    def __init__(self, staged: torch.Tensor) -> None:
        self._staged = staged

    def to(self, device: Any, non_blocking: bool = False) -> torch.Tensor:
        launch_stand_in()
        return self._staged


class SnapshotStandIn:
    """vLLM's capturer for a replay: the snapshot cast is made by ``stage(num_rows)`` outside
    the timed region; ``snapshot_routing_data`` costs one stand-in launch."""

    def __init__(self, capturer: Any) -> None:
        self.shape_per_token = capturer.shape_per_token
        self.output_dtype_name = capturer.output_dtype_name
        self.output_dtype = capturer.output_dtype
        self.device_buffer = capturer.device_buffer
        self.launches = 0
        self._staged: torch.Tensor | None = None

    def stage(self, num_rows: int) -> None:
        """Make the cast ``snapshot_routing_data(num_rows)`` will return (vLLM's own
        expression: the first ``num_rows`` rows cast to the output dtype)."""
        self._staged = self.device_buffer[:num_rows].to(self.output_dtype)

    def snapshot_routing_data(self, num_tokens: int) -> DeviceSnapshot:
        staged, self._staged = self._staged, None
        if staged is None or staged.shape[0] != num_tokens:
            raise RuntimeError(f"no snapshot of {num_tokens} rows was staged before the call")
        launch_stand_in()
        self.launches += 1
        return DeviceSnapshot(staged)


__all__ = [
    "ABLATIONS",
    "KERNEL_BINDINGS",
    "DeviceSnapshot",
    "FreeParts",
    "KernelStandIn",
    "SnapshotStandIn",
    "kernel_binding",
    "launch_stand_in",
    "measure",
]
