"""Test-wide setup: the Triton interpreter on CPU-only machines (every interpreted load and
store checked against its launch's tensors), and the `gpu` marker."""

import os

import pytest
import torch

# Must precede the import of any module that defines @triton.jit kernels: triton.jit
# decides at decoration time whether a kernel is compiled or interpreted.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _interpreted_accesses_in_bounds():
    """On a GPU an access outside a kernel's tensors is an illegal address; under the
    interpreter it silently reads or writes host memory, so every test checks them."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from interpreter_bounds import checked_memory_accesses

    with checked_memory_accesses():
        yield
