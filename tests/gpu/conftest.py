"""tests/gpu: >= 2 CUDA GPUs, one rank per GPU over NCCL, the cuda symmetric backend.
Skipped where there are fewer GPUs (CI has none); run them on the GPU machine with `pytest tests/gpu`."""

import os

import pytest
import torch

from tests.multiprocess import RankPool

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

# never use NVLink multicast (it can take a shared host's GPUs down)
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


# modules that run in one process on one GPU (the kernels alone)
_ONE_GPU = ("test_kernels.py", "test_producer.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu" not in str(item.fspath):
            continue
        needed = 1 if item.fspath.basename in _ONE_GPU else 2
        if NUM_GPUS < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs >= {needed} CUDA GPUs, found {NUM_GPUS}"))


@pytest.fixture(scope="module")
def pool():
    p = RankPool(NUM_GPUS, backend="nccl", call_timeout=600)
    yield p
    p.close()
