"""GPU tests: marked `gpu`, skipped where no NVIDIA GPU and cuda-python are present."""
from __future__ import annotations

import pytest


def _gpu_arch() -> int | None:
    try:
        from kiln.runtime.worker.cuda_driver import CudaContext

        return CudaContext().arch
    except Exception:  # no driver, no device, no cuda-python: not a GPU machine
        return None


ARCH = _gpu_arch()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if ARCH is None:
                item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU with cuda-python"))


@pytest.fixture(scope="session")
def gpu_target() -> str:
    return f"sm_{ARCH}"
