"""What the Triton kernels need from the device: SM counts, raw pointers, Triton's presence."""

from __future__ import annotations

import functools

import torch

__all__ = ["sm_count", "triton_available", "RawPointer", "FastLaunch"]


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


class FastLaunch:
    """Launches one @triton.jit kernel without Triton's per-call binding of its arguments.

    Triton's `kernel[grid](...)` binds and specializes every argument and looks the compiled
    kernel up on each call: about 100 us of host time for the fused GEMMs' 35 arguments on
    2xH200, a fifth of a whole fused call. Here the first launch of each key goes through Triton
    (which compiles or finds the kernel); later launches of that key call the compiled kernel's
    launcher directly. The key is everything Triton specializes on, taken from the arguments:
    tensors (and RawPointer) by dtype and 16-byte alignment, tensor descriptors by dtype and block
    shape, every other argument by value. With a Triton launch hook set (a profiler's), every
    launch goes through Triton."""

    def __init__(self, fn) -> None:
        from triton import knobs

        self.fn, self._runtime = fn, knobs.runtime
        self.kernels: dict[tuple, object] = {}
        self.fast = True  # False once the compiled launcher refused its arguments (another Triton)

    @staticmethod
    def _spec(arg):
        if isinstance(arg, (torch.Tensor, RawPointer)):
            return arg.dtype, arg.data_ptr() % 16 == 0
        base = getattr(arg, "base", None)
        if base is not None:  # a TensorDescriptor
            return base.dtype, tuple(arg.block_shape)
        return arg

    def __call__(self, grid: tuple[int, ...], args: tuple, **options) -> None:
        """Launch on the current stream; args: every parameter in order, constexprs included."""
        key = (tuple(map(self._spec, args)), tuple(options.items()))
        kernel = self.kernels.get(key)
        hooked = _active(self._runtime.launch_enter_hook) or _active(self._runtime.launch_exit_hook)
        if kernel is None or hooked or not self.fast:
            kernel = self.fn[grid](*args, **options)
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            if not hooked:
                self.kernels[key] = kernel
            return
        stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
        try:
            kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                       kernel.function, kernel.packed_metadata, None, None, None, *args)
        except TypeError as exc:  # the launcher parses its arguments before it launches anything
            from asynctp.config import warn_once

            warn_once("fast-launch", f"asynctp: this Triton's kernel launcher refused a direct launch ({exc}); "
                      "launches go through Triton's binding (more host time per call)")
            self.fast = False
            self.fn[grid](*args, **options)


def _active(hook) -> bool:
    """Whether a Triton launch hook is set (None, or since Triton 3.5 an empty HookChain: not)."""
    return hook is not None and bool(getattr(hook, "calls", True))
