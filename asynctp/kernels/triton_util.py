"""What the Triton kernels need from the device: SM counts, raw pointers, Triton's presence."""

from __future__ import annotations

import functools

import torch

__all__ = ["sm_count", "triton_available", "RawPointer", "FastLaunch", "memo_key"]


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
    launch goes through Triton.

    Where the compiled launcher is the one this module knows (_Direct: Triton 3.6's CUDA launcher,
    no scratch memory), later launches also skip its Python wrapper: the C launcher is called with
    the final arguments, each tensor descriptor encoded once per address, shape and strides; and a
    launch given a `memo` (everything its arguments were made from: memo_key) is
    kept as those final arguments, so that `again(memo)` repeats it without making them again
    (its tensors as their addresses, which the launcher takes without asking the driver)."""

    MAX_MEMO = 256  # launches kept per kernel; all are forgotten when more come (a loop's come back)
    MAX_KERNELS = 1024  # compiled kernels kept per kernel function, likewise (keys of shapes that do not come back)

    def __init__(self, fn) -> None:
        from triton import knobs

        self.fn, self._runtime = fn, knobs.runtime
        self.kernels: dict[tuple, object] = {}
        self.fast = True  # False once the compiled launcher refused its arguments (another Triton)
        self.memo: dict[tuple, tuple] = {}

    def _hooked(self) -> bool:
        return _active(self._runtime.launch_enter_hook) or _active(self._runtime.launch_exit_hook)

    def again(self, memo: tuple) -> bool:
        """Repeat the launch kept under `memo` on the current stream; False where none is kept (or
        a Triton launch hook is set: the launch must go through Triton)."""
        kept = self.memo.get(memo)
        if kept is None or self._hooked():
            return False
        launch, grid, rest = kept
        launch(*grid, torch._C._cuda_getCurrentRawStream(torch.cuda.current_device()), *rest)
        return True

    @staticmethod
    def _spec(arg):
        kind = type(arg)
        if kind is int or kind is bool or arg is None:
            return arg
        if isinstance(arg, (torch.Tensor, RawPointer)):
            return arg.dtype, arg.data_ptr() % 16 == 0
        base = getattr(arg, "base", None)
        if base is not None:  # a TensorDescriptor
            return base.dtype, tuple(arg.block_shape)
        return arg

    def __call__(self, grid: tuple[int, ...], args: tuple, memo: tuple | None = None, **options) -> None:
        """Launch on the current stream; args: every parameter in order, constexprs included;
        memo: the key under which again() repeats this launch (None: not kept)."""
        key = (tuple(map(self._spec, args)), tuple(options.items()))
        kernel = self.kernels.get(key)
        hooked = self._hooked()
        if kernel is None or hooked or not self.fast:
            kernel = self.fn[grid](*args, **options)
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            if not hooked:
                if len(self.kernels) >= self.MAX_KERNELS:
                    self.kernels.clear()
                self.kernels[key] = _Direct.of(kernel)
            return
        stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
        try:
            if type(kernel) is _Direct:
                final = kernel.final(grid, stream, args)
                kernel.launch(*final)
                if memo is not None:
                    if len(self.memo) >= self.MAX_MEMO:
                        self.memo.clear()
                    self.memo[memo] = (kernel.launch, tuple(final[:3]), tuple(
                        a.data_ptr() if isinstance(a, (torch.Tensor, RawPointer)) else a for a in final[4:]))
            else:
                kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                           kernel.function, kernel.packed_metadata, None, None, None, *args)
        except TypeError as exc:  # the launcher parses its arguments before it launches anything
            from asynctp.config import warn_once

            warn_once("fast-launch", f"asynctp: this Triton's kernel launcher refused a direct launch ({exc}); "
                      "launches go through Triton's binding (more host time per call)")
            self.fast = False
            self.fn[grid](*args, **options)


def memo_key(*args) -> tuple:
    """A FastLaunch memo key of a launch function's arguments: each tensor by what a launch reads
    of it (address, dtype, shape, strides), a RawPointer by address and dtype, the rest as they
    are (hashable: ints, bools, strings, tuples, frozen configs)."""
    return tuple(_memo_part(x) for x in args)


def _memo_part(x):
    if isinstance(x, torch.Tensor):
        return x.data_ptr(), x.dtype, x.shape, x.stride()
    if type(x) is RawPointer:
        return x.address, x.dtype
    return x


def _active(hook) -> bool:
    """Whether a Triton launch hook is set (None, or since Triton 3.5 an empty HookChain: not)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class _Direct:
    """A compiled kernel launched by its C launcher (`launch`) without the Python wrapper around
    it (triton.backends.nvidia.driver: CudaLauncher.__call__ and wrap_handle_tensordesc, which
    encodes every tensor descriptor argument at every launch). The same final arguments: the
    base ones, then each kernel argument, a descriptor expanded by Triton's own
    make_tensordesc_arg, kept per (position, address, shape, strides, padding): the encoded
    descriptor holds no tensor and equal keys encode equal descriptors. `of(kernel)` returns the
    kernel itself where its launcher is not of that form (scratch memory; another launcher, or
    another layout of Triton's CUDA one: a warning says so, once)."""

    MAX_ENCODED = 1024  # descriptors kept per kernel; all are forgotten when more come

    __slots__ = ("kernel", "launch", "head", "descs", "expand", "encoded")  # kernel: its module stays loaded

    @classmethod
    def of(cls, kernel):
        run = getattr(kernel, "run", None)
        if not hasattr(run, "launch"):  # Triton's interpreter
            return kernel
        try:
            from triton.backends.nvidia import driver

            if type(run).__name__ != "CudaLauncher":
                raise TypeError(f"a {type(run).__name__}")
            if run.global_scratch_size or run.profile_scratch_size or getattr(run, "num_ctas", 1) != 1:
                return kernel  # scratch memory: Triton's launcher allocates it at each launch
            wrapper = run.launch
            if not hasattr(wrapper, "__code__"):  # the C launcher itself (no descriptor arguments): run() is as short
                return kernel
            closure = dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in wrapper.__closure__ or ())))
            launch, indices = closure["launcher"], closure["tensordesc_indices"]
            meta = list(closure["tensordesc_meta"])
            if driver._BASE_ARGS_FORMAT_LEN != 13 or not callable(launch) or None in meta or len(meta) != len(indices):
                raise TypeError("the arguments are laid out otherwise")
        except (AttributeError, KeyError, TypeError, ImportError) as exc:
            from asynctp.config import warn_once

            warn_once("fast-launch-direct", f"asynctp: this Triton's kernel launcher is not the CUDA one asynctp calls "
                      f"directly ({exc!r}); launches go through its Python wrapper (more host time per call)")
            return kernel
        self = cls()
        self.kernel, self.launch, self.expand, self.encoded = kernel, launch, driver.make_tensordesc_arg, {}
        self.head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata,
                     None, None, None)
        self.descs = {i: m for i, m in zip(sorted(indices), meta)}
        return self

    def final(self, grid: tuple[int, ...], stream: int, args: tuple) -> list:
        """The C launcher's arguments of a launch."""
        final = [grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, *self.head]
        descs, encoded = self.descs, self.encoded
        for i, arg in enumerate(args):
            meta = descs.get(i)
            if meta is None:
                final.append(arg)
                continue
            key = (i, arg.base.data_ptr(), *arg.shape, *arg.strides, arg.padding)
            parts = encoded.get(key)
            if parts is None:
                if len(encoded) >= self.MAX_ENCODED:
                    encoded.clear()
                parts = encoded[key] = self.expand(arg, meta)
            final.extend(parts)
        return final
