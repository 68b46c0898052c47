"""The registry of benchmarked ops: per op, how to build its inputs and every way to compute it.

Adding an op is one `@register(name, kind)` builder that returns a `Problem`: the inputs live in
the builder's closure, and the Problem's callables are what the harness times and compares. The
harness (measure.py) knows nothing op-specific. Shape legend: see shapes.py ("gather" rows:
a_shard [M / R, K] @ b [K, N]; "scatter" rows: a [M, N] @ b [N, K] -> out [M / R, K]).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import asynctp
from asynctp.bench.shapes import KINDS, Shape
from asynctp.runtime.collective import all_gather_rows, reduce_scatter_rows

__all__ = [
    "Problem", "OpCase", "CASES", "register", "dtype_name", "randn", "check_close", "check_sqnr", "call_torch_symm",
]


@dataclass
class Problem:
    """One op at one shape on this rank, inputs built; every callable is collective."""

    op: str  # the op's name in asynctp's tuning cache
    shape_key: tuple  # what the op passes to the tuning cache: (dtype, M, N, K) of its full matmul
    workspace_bytes: int  # a generous asynctp.reserve() size for CUDA-graph capture
    compute_bound: Callable[[], Any]  # the full local matmul (same FLOPs as the op), no communication
    comm_bound: Callable[[], Any]  # the op's NCCL/gloo collective alone, no matmul
    asynctp: Callable[[str], Any]  # strategy -> the op's result ("serial" is the reference)
    torch_fused: Callable[[], Any]  # torch.ops.symm_mem's fused op (may raise: unsupported here)
    check: Callable[[Any, Any], None]  # (got, serial's result): AssertionError naming what differs


@dataclass(frozen=True)
class OpCase:
    """A registry entry: which shape rows an op uses and how to build it."""

    name: str  # registry key: `--op` value, results file prefix
    kind: str  # "gather" or "scatter": which rows of each shape set it runs
    build: Callable[[Shape, torch.dtype, dist.ProcessGroup, torch.device, int], Problem]
    requires: Callable[[], str | None]  # why it cannot run in this installation (None: it can)
    strategies: Callable[[], Sequence[str]]  # every strategy the op takes, "auto" and "serial" too


CASES: dict[str, OpCase] = {}


def _always() -> str | None:
    return None


def _strategies() -> Sequence[str]:
    """The bf16/fp16/fp32 ops' strategies, read when asked: a new one is benchmarked at once."""
    from asynctp.ops.validate import STRATEGIES

    return STRATEGIES


def register(name: str, kind: str, requires: Callable[[], str | None] = _always,
             strategies: Callable[[], Sequence[str]] = _strategies):
    """Decorator: add `build(shape, dtype, group, device, seed) -> Problem` to CASES as `name`."""
    if kind not in KINDS:
        raise ValueError(f"register requires a kind in {list(KINDS)}, got {kind!r}")

    def wrap(build: Callable[..., Problem]) -> Callable[..., Problem]:
        if name in CASES:
            raise ValueError(f"register requires a new op name, got {name!r} twice")
        CASES[name] = OpCase(name, kind, build, requires, strategies)
        return build

    return wrap


# -- shared pieces of the builders --------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: how the ops spell dtypes in tuning-cache keys."""
    return str(dtype).removeprefix("torch.")


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator,
          scale: float = 1.0) -> torch.Tensor:
    """Standard normal values times scale. Never zeros: they hide wrong results, and a GPU
    multiplies them with less power, so at clocks that real data would not get."""
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if scale != 1.0:
        t.mul_(scale)
    return t.to(dtype)


def _generator(device: torch.device, seed: int, rank: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1009 + rank)


_TOLERANCES = {  # (rtol, atol): values are ~N(0, R); chunked GEMMs may round differently
    torch.bfloat16: (2e-2, 5e-2),
    torch.float16: (5e-3, 1e-2),
    torch.float32: (1e-4, 1e-3),
}


def check_close(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """AssertionError unless got matches want in shape, dtype and value (dtype's tolerance)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{label}: got {tuple(got.shape)} {got.dtype}, serial gives {tuple(want.shape)} {want.dtype}")
    rtol, atol = _TOLERANCES.get(want.dtype, (2e-2, 5e-2))
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    except AssertionError as exc:
        raise AssertionError(f"{label} differs from serial: {exc}") from None


def check_sqnr(label: str, got: torch.Tensor, want: torch.Tensor, min_db: float = 30.0) -> None:
    """AssertionError unless got matches want in shape and dtype with a signal-to-noise ratio of
    at least min_db (fp8 results: fast accumulation may differ between GEMM kernels; a wrong row
    or scale gives about 0 dB)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{label}: got {tuple(got.shape)} {got.dtype}, serial gives {tuple(want.shape)} {want.dtype}")
    noise = (got.float() - want.float()).norm()  # float32: exact enough, half the memory of float64
    if noise == 0:
        return
    sqnr = 20 * torch.log10(want.float().norm() / noise).item()
    if not sqnr >= min_db:
        raise AssertionError(f"{label} differs from serial: SQNR {sqnr:.1f} dB, needs >= {min_db} dB")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's raw bytes as integers: exact comparison for every dtype, float8 included."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _check_gather(got: Any, want: Any, close: Callable[[str, torch.Tensor, torch.Tensor], None] = check_close) -> None:
    a_got, outs_got = got
    a_want, outs_want = want
    if a_got is None or a_got.shape != a_want.shape or not torch.equal(_bits(a_got), _bits(a_want)):
        raise AssertionError("a_gathered is not exactly equal to serial's all_gather_into_tensor result")
    if len(outs_got) != len(outs_want):
        raise AssertionError(f"got {len(outs_got)} outputs, serial gives {len(outs_want)}")
    for i, (o, w) in enumerate(zip(outs_got, outs_want)):
        close(f"outs[{i}]", o, w)


def _check_scatter(got: Any, want: Any) -> None:
    check_close("out", got, want)


def call_torch_symm(op_name: str, group_name: str, device: torch.device, *args: Any, **kwargs: Any) -> Any:
    """torch.ops.symm_mem.<op_name>(*args, **kwargs), registering the group with torch's
    symmetric memory first on torch releases that still need it."""
    import torch.distributed._symmetric_memory as symm_mem  # defines torch.ops.symm_mem

    op = getattr(torch.ops.symm_mem, op_name)
    try:
        return op(*args, **kwargs)
    except RuntimeError:
        if device.type != "cuda" or symm_mem.is_symm_mem_enabled_for_group(group_name):
            raise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group_name)
    return op(*args, **kwargs)


# -- bf16 / fp16 / fp32 ops ----------------------------------------------------------------


@register("all_gather_matmul", "gather")
def _all_gather_matmul(shape: Shape, dtype: torch.dtype, group: dist.ProcessGroup,
                       device: torch.device, seed: int) -> Problem:
    world = group.size()
    gen = _generator(device, seed, group.rank())
    n_each = shape.n // shape.num_bs
    a_shard = randn((shape.m // world, shape.k), dtype, device, gen)  # [M / R, K]
    bs = [randn((shape.k, n_each), dtype, device, gen, scale=shape.k**-0.5) for _ in range(shape.num_bs)]
    a_full = randn((shape.m, shape.k), dtype, device, gen)  # [M, K]: the compute bound's input
    outs = [torch.empty((shape.m, n_each), dtype=dtype, device=device) for _ in bs]
    a_gathered = torch.empty((shape.m, shape.k), dtype=dtype, device=device)

    def compute_bound() -> None:
        for b, out in zip(bs, outs):
            torch.mm(a_full, b, out=out)

    def comm_bound() -> None:
        all_gather_rows(a_gathered, a_shard, group)

    def run(strategy: str) -> Any:
        return asynctp.all_gather_matmul(a_shard, bs, 0, group, strategy=strategy)

    def torch_fused() -> Any:
        return call_torch_symm("fused_all_gather_matmul", group.group_name, device, a_shard, bs, 0, group.group_name)

    return Problem(
        op="all_gather_matmul",
        shape_key=(dtype_name(dtype), shape.m, shape.n, shape.k),
        workspace_bytes=2 * shape.m * shape.k * dtype.itemsize,
        compute_bound=compute_bound,
        comm_bound=comm_bound,
        asynctp=run,
        torch_fused=torch_fused,
        check=_check_gather,
    )


@register("matmul_reduce_scatter", "scatter")
def _matmul_reduce_scatter(shape: Shape, dtype: torch.dtype, group: dist.ProcessGroup,
                           device: torch.device, seed: int) -> Problem:
    world = group.size()
    gen = _generator(device, seed, group.rank())
    a = randn((shape.m, shape.n), dtype, device, gen)  # [M, N]
    b = randn((shape.n, shape.k), dtype, device, gen, scale=shape.n**-0.5)  # [N, K]
    partial = randn((shape.m, shape.k), dtype, device, gen)  # [M, K]: the comm bound's input
    product = torch.empty((shape.m, shape.k), dtype=dtype, device=device)
    out_shard = torch.empty((shape.m // world, shape.k), dtype=dtype, device=device)

    def compute_bound() -> None:
        torch.mm(a, b, out=product)

    def comm_bound() -> None:
        reduce_scatter_rows(out_shard, partial, group)

    def run(strategy: str) -> Any:
        return asynctp.matmul_reduce_scatter(a, b, 0, group, strategy=strategy)

    def torch_fused() -> Any:
        return call_torch_symm("fused_matmul_reduce_scatter", group.group_name, device, a, b, "sum", 0, group.group_name)

    return Problem(
        op="matmul_reduce_scatter",
        # the op's own naming: b is its [K_op, N_op] = [N, K] of this file's legend
        shape_key=(dtype_name(dtype), shape.m, shape.k, shape.n),
        workspace_bytes=2 * shape.m * shape.k * dtype.itemsize,
        compute_bound=compute_bound,
        comm_bound=comm_bound,
        asynctp=run,
        torch_fused=torch_fused,
        check=_check_scatter,
    )


# -- float8 ops: one entry per (op, recipe); out dtype = the run's --dtype -------------------


def _float8_missing(public_name: str) -> Callable[[], str | None]:
    def requires() -> str | None:
        if getattr(asynctp, public_name, None) is None:
            return f"this asynctp has no asynctp.{public_name}"
        return None

    return requires


def _float8_strategies() -> Sequence[str]:
    """The fp8 ops' own list where they keep one (they may take fewer strategies), else the
    shared list."""
    from asynctp.ops import scales

    return getattr(scales, "STRATEGIES", None) or _strategies()


def _check_gather_fp8(got: Any, want: Any) -> None:
    _check_gather(got, want, close=check_sqnr)


def _check_scatter_fp8(got: Any, want: Any) -> None:
    check_sqnr("out", got, want)


def _weight_fp8(n_out: int, k_in: int, recipe: Any, dtype: torch.dtype, device: torch.device,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(b [k_in, n_out] float8, column-major; b_scale () or [1, n_out]) from a random
    nn.Linear weight [n_out, k_in], as a float8 training step passes it."""
    from asynctp.float8 import quantize_weight

    w_fp8, w_scale = quantize_weight(randn((n_out, k_in), dtype, device, gen, scale=k_in**-0.5), recipe)
    return w_fp8.t(), w_scale.t()


def _all_gather_scaled_matmul(recipe_name: str) -> Callable[..., Problem]:
    def build(shape: Shape, out_dtype: torch.dtype, group: dist.ProcessGroup, device: torch.device,
              seed: int) -> Problem:
        from asynctp.float8 import Float8Recipe, quantize_activation

        recipe = Float8Recipe.from_name(recipe_name)
        fast = recipe.use_fast_accum
        gen = _generator(device, seed, group.rank())
        n_each = shape.n // shape.num_bs
        # a_shard [M / R, K] fp8 with its scale (tensorwise: agreed over the group)
        a_shard, a_scale = quantize_activation(randn((shape.m // group.size(), shape.k), out_dtype, device, gen), recipe, group)
        weights = [_weight_fp8(n_each, shape.k, recipe, out_dtype, device, gen) for _ in range(shape.num_bs)]
        bs, b_scales = [b for b, _ in weights], [s for _, s in weights]
        a_full, a_full_scale = quantize_activation(randn((shape.m, shape.k), out_dtype, device, gen), recipe, None)
        gathered = torch.empty((shape.m, shape.k), dtype=torch.uint8, device=device)

        def compute_bound() -> None:
            for b, b_scale in zip(bs, b_scales):
                torch._scaled_mm(a_full, b, a_full_scale, b_scale, out_dtype=out_dtype, use_fast_accum=fast)

        def comm_bound() -> None:  # the fp8 bytes (a rowwise scale adds M * 4 bytes more)
            all_gather_rows(gathered, a_shard.view(torch.uint8), group)

        def run(strategy: str) -> Any:
            return asynctp.all_gather_scaled_matmul(a_shard, bs, a_scale, b_scales, 0, group, out_dtype=out_dtype,
                                                    use_fast_accum=fast, strategy=strategy)

        def torch_fused() -> Any:
            n = len(bs)
            return call_torch_symm("fused_all_gather_scaled_matmul", group.group_name, device, a_shard, bs, a_scale,
                                   b_scales, 0, group.group_name, [None] * n, [None] * n, [out_dtype] * n, [fast] * n)

        return Problem(
            op="all_gather_scaled_matmul",
            shape_key=(f"{dtype_name(a_shard.dtype)}-{recipe.scaling}", shape.m, shape.n, shape.k),
            workspace_bytes=2 * shape.m * (shape.k + 16),
            compute_bound=compute_bound,
            comm_bound=comm_bound,
            asynctp=run,
            torch_fused=torch_fused,
            check=_check_gather_fp8,
        )

    return build


def _scaled_matmul_reduce_scatter(recipe_name: str) -> Callable[..., Problem]:
    def build(shape: Shape, out_dtype: torch.dtype, group: dist.ProcessGroup, device: torch.device,
              seed: int) -> Problem:
        from asynctp.float8 import Float8Recipe, quantize_activation

        recipe = Float8Recipe.from_name(recipe_name)
        fast = recipe.use_fast_accum
        gen = _generator(device, seed, group.rank())
        # a [M, N] fp8: the row-parallel input is never gathered, so its scale needs no agreement
        a, a_scale = quantize_activation(randn((shape.m, shape.n), out_dtype, device, gen), recipe, None)
        b, b_scale = _weight_fp8(shape.k, shape.n, recipe, out_dtype, device, gen)  # [N, K]
        partial = randn((shape.m, shape.k), out_dtype, device, gen)  # [M, K]: the comm bound's input
        out_shard = torch.empty((shape.m // group.size(), shape.k), dtype=out_dtype, device=device)

        def compute_bound() -> None:
            torch._scaled_mm(a, b, a_scale, b_scale, out_dtype=out_dtype, use_fast_accum=fast)

        def comm_bound() -> None:
            reduce_scatter_rows(out_shard, partial, group)

        def run(strategy: str) -> Any:
            return asynctp.scaled_matmul_reduce_scatter(a, b, a_scale, b_scale, 0, group, out_dtype=out_dtype,
                                                        use_fast_accum=fast, strategy=strategy)

        def torch_fused() -> Any:
            return call_torch_symm("fused_scaled_matmul_reduce_scatter", group.group_name, device, a, b, a_scale,
                                   b_scale, "sum", 0, 0, group.group_name, [shape.m, shape.k], None, None, out_dtype,
                                   fast)

        return Problem(
            op="scaled_matmul_reduce_scatter",
            shape_key=(f"{dtype_name(a.dtype)}-{recipe.scaling}", shape.m, shape.k, shape.n),
            workspace_bytes=2 * shape.m * shape.k * out_dtype.itemsize,
            compute_bound=compute_bound,
            comm_bound=comm_bound,
            asynctp=run,
            torch_fused=torch_fused,
            check=_check_scatter_fp8,
        )

    return build


def _register_float8() -> None:
    """all_gather_scaled_matmul_<recipe> and scaled_matmul_reduce_scatter_<recipe>, for the named
    recipes of asynctp.float8 (they run only once asynctp exports the ops)."""
    for recipe in ("rowwise", "tensorwise"):
        register(f"all_gather_scaled_matmul_{recipe}", "gather", _float8_missing("all_gather_scaled_matmul"),
                 _float8_strategies)(_all_gather_scaled_matmul(recipe))
    for recipe in ("rowwise", "tensorwise"):
        register(f"scaled_matmul_reduce_scatter_{recipe}", "scatter",
                 _float8_missing("scaled_matmul_reduce_scatter"), _float8_strategies)(
            _scaled_matmul_reduce_scatter(recipe))


_register_float8()
