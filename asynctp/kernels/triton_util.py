"""What the Triton kernels need from the device: SM counts, raw pointers, Triton's presence."""

from __future__ import annotations

import functools

import torch

__all__ = ["sm_count", "triton_available", "RawPointer"]


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a persistent grid has at most this many programs);
    4 for a CPU device (Triton's interpreter runs the programs one after another)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class RawPointer:
    """A device address that Triton takes as a pointer argument (it reads data_ptr() and dtype):
    flags in a signal pad are not torch tensors."""

    def __init__(self, address: int, dtype: torch.dtype = torch.int32) -> None:
        self.address, self.dtype = int(address), dtype

    def data_ptr(self) -> int:
        return self.address
