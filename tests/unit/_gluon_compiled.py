"""Compiles the Gluon kernels for sm_90 without a GPU (Triton's compiler and its ptxas), through
the launch functions the ops call: a Triton whose Gluon API changed fails here, not on a GPU.
Run by tests/unit/test_kernels.py in a process of its own (it replaces Triton's active driver).
Prints one line per kernel variant, then "ok"."""

from __future__ import annotations

import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class _Hopper:
    """Triton's driver as far as compiling needs it: an sm_90 target, device 0, stream 0."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


class _compile_only:
    """Stands in for a kernel's FastLaunch: compiles, keeps nothing."""

    def __init__(self, kernel, name: str) -> None:
        self.kernel, self.name = kernel, name

    def again(self, memo) -> bool:
        return False

    def __call__(self, grid, args, memo=None, **options):
        compiled = self.kernel.warmup(*args, grid=grid, **options)
        print(f"{self.name}: compiled, {compiled.metadata.shared} bytes of shared memory")


def main() -> None:
    driver.set_active(_Hopper())
    from asynctp.kernels import _ag_gluon, _rs_gluon, producer_mm
    from asynctp.kernels.async_input_mm import ChunkMap
    from asynctp.kernels.configs import Config

    aim = sys.modules["asynctp.kernels.async_input_mm"]  # (the package's async_input_mm is the function)
    for mod in (aim, producer_mm):
        mod._gluon_serves = lambda *args: True
        mod.sm_count = lambda device: 132
    world, m, n, k = 2, 1024, 384, 512  # (K-steps enough for a 4-stage ring)
    for dtype, scales in ((torch.bfloat16, None), (torch.float8_e4m3fn, "rowwise"), (torch.float8_e4m3fn, "tensorwise")):
        fp8 = scales is not None
        cfg = Config(128, 256, 128 if fp8 else 64, stages=3, warps=8, split=False)
        deep = Config(128, 256, 128 if fp8 else 64, stages=4, warps=8, split=False)  # half a tile staged
        rows = world * m if scales == "rowwise" else 1
        sa = torch.ones(rows, 1) if fp8 else None
        sb = torch.ones(1, n if scales == "rowwise" else 1) if fp8 else None
        b = torch.zeros(n, k).to(dtype).t()  # nn.Linear's weight.t()
        variants = [(True, cfg, b), (False, cfg, b), (True, deep, b)] + ([] if fp8 else [(True, deep, b.contiguous())])
        for store, c, b_ in variants:
            _ag_gluon._launch = _compile_only(_ag_gluon._ag_mm_kernel, f"all-gather {dtype} {scales} store {store} "
                                              f"stages {c.stages} b {'[K, N]' if b_.is_contiguous() else 'weight.t()'}")
            a = torch.zeros(world * m, k).to(dtype)
            out = torch.empty(world * m, n, dtype=torch.bfloat16 if fp8 else dtype)
            stored = aim.launch(a, b_, out, torch.zeros(4, dtype=torch.int32), (4, 1, world), m // 2, 0,
                                ChunkMap(blocks=2, local_src=0), a_local=a[:m] if store else None,
                                counters=torch.zeros(4, dtype=torch.int32), a_scale=sa, b_scale=sb,
                                bias=torch.zeros(n, dtype=torch.bfloat16) if store else None, config=c, gluon=True,
                                gathered=torch.empty(world * m, k).to(dtype) if store else None)
            assert stored == store
        _rs_gluon._launch = _compile_only(_rs_gluon._rs_mm_kernel, f"reduce-scatter {dtype} {scales}")
        a = torch.zeros(world * m, k).to(dtype)
        out = torch.empty(m, n, dtype=torch.bfloat16 if fp8 else dtype)
        producer_mm.launch_producer(a, b, torch.empty(world - 1, m, n, dtype=out.dtype),
                                    torch.empty(world, m, n, dtype=out.dtype), out, 0, world, 2, (m, m // 2),
                                    torch.zeros(4, dtype=torch.int32), (1, world),
                                    torch.zeros(world * 2 + 2, dtype=torch.int32), reduce_op="avg" if fp8 else "sum",
                                    a_scale=sa, b_scale=sb, bias=torch.zeros(n, dtype=torch.bfloat16) if fp8 else None,
                                    config=cfg, gluon=True)
    print("ok")


if __name__ == "__main__":
    main()
