"""What the Triton kernels need from the device: SM counts, raw pointers, Triton's presence."""

from __future__ import annotations

import functools

import torch

__all__ = ["sm_count", "triton_available", "RawPointer", "Launcher", "pointer_key"]


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


def pointer_key(*tensors) -> tuple:
    """What Triton specializes on in (possibly None) pointer arguments: dtype and 16-byte alignment."""
    return tuple(None if t is None else (t.dtype, t.data_ptr() % 16 == 0) for t in tensors)


class Launcher:
    """Launches one Triton kernel with little host time: the first launch of a `key` goes through
    Triton's JIT (binding, specialization, compile), later ones call the compiled kernel directly
    (the JIT's per-call binding costs tens of microseconds). `key` must determine everything the
    JIT specializes on: the constexprs, the arguments' dtypes, which integer arguments are 1 or
    multiples of 16 (or beyond 32 bits), which pointers are 16-byte aligned. `args` are the
    kernel's runtime arguments in order, `constexprs` the rest of its parameters in order."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self._compiled: dict = {}

    def __call__(self, key, grid: tuple[int], args: tuple, constexprs: dict, num_warps: int, num_stages: int) -> None:
        kernel = self._compiled.get(key)
        if kernel is None or _launch_hooks():
            kernel = self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
            if hasattr(kernel, "packed_metadata") and list(constexprs) == self.fn.arg_names[len(args):]:
                self._compiled[key] = kernel
            return
        stream = torch.cuda.current_stream().cuda_stream
        kernel.run(grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args,
                   *constexprs.values())


def _launch_hooks() -> bool:
    """Whether a profiler hooked Triton's launches (then every launch goes through the JIT). An
    empty hook chain (Triton 3.4+ always has one) is no hook."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)
