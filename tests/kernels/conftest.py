"""Every kernel test under the Triton interpreter runs with its memory accesses checked."""

import os

import pytest


@pytest.fixture(autouse=True)
def _interpreted_accesses_in_bounds():
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from interpreter_bounds import checked_memory_accesses

    with checked_memory_accesses():
        yield
