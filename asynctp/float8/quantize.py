"""Current-scaling quantization of high-precision activations and weights to float8, with the
scale conventions torch._scaled_mm (and asynctp's scaled ops) expect.

A scale is the dequantization multiplier, float32:  x_hp ~= x_fp8.float() * x_scale
    x_scale = amax / fp8_max       x_fp8 = clamp(x_hp / x_scale, -fp8_max, fp8_max)
Shape legend:
    x_hp      [..., K]   an activation (any leading dims; the last is the matmul's K)
    w_hp      [N, K]     an nn.Linear weight
    tensorwise scales: shape ()     rowwise: x [..., 1], w [N, 1]
Pass a weight to the ops as b = w_fp8.t() ([K, N], column-major as cuBLAS wants) with
b_scale = w_scale.t() (() or [1, N]).

On CUDA (outside torch.compile) the quantization runs as one Triton kernel per tensor
(asynctp.float8.kernels, bit-for-bit the torch code below, which stays the implementation on CPU
and under compile; `torch_formulas()` selects it on CUDA too, to compare). The `out=` / `scale_out=`
arguments of the internal helpers let a caller quantize into buffers it keeps (stable addresses,
so a fused op fed by them can be replayed from a CUDA graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from asynctp.config import warn_once
from asynctp.float8.recipe import Float8Recipe
from asynctp.symm import resolve_group

__all__ = [
    "quantize_activation", "quantize_weight", "amax_to_scale", "to_float8",
    "quantize_rows", "quantize_tensor", "quantize_weight_into", "agreed_amax", "quantize_weight_for_dgrad", "dequantize", "abs_max",
]

_HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_kernels: Any = None  # the Triton module once imported; False when it cannot be
_torch_only = False  # set by torch_formulas()


def amax_to_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, recipe: Float8Recipe) -> torch.Tensor:
    """The float32 dequantization scale for tensors whose absolute maximum is `amax`."""
    # times the float32 reciprocal (what `/ fp8_max` computes on CUDA; written out so that CPU,
    # CUDA and the Triton kernels agree bit for bit)
    scale = amax.float().clamp(min=recipe.amax_eps) * (1.0 / torch.finfo(fp8_dtype).max)
    if recipe.power_of_2_scales:
        scale = _round_up_pow2(scale)
    return scale


def _round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= scale (x / scale then never exceeds fp8_max), exactly: on the
    float's bits (scale is a positive normal float: amax_eps / fp8_max is far above the
    subnormals). A mantissa is cleared and the exponent stepped up unless it already is zero;
    inf and NaN pass unchanged. The Triton kernels do the same."""
    bits = scale.contiguous().view(torch.int32)
    exponent = bits & 0x7F800000
    round_up = ((bits & 0x007FFFFF) != 0) & (exponent != 0x7F800000)
    return torch.where(round_up, exponent + 0x00800000, bits).view(torch.float32)


def to_float8(x_hp: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """x_hp / scale, saturated to the float8 range (scale broadcasts: () or [..., 1])."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (x_hp.float() / scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def agreed_amax(t: torch.Tensor, group: Any) -> torch.Tensor:
    """max |t| over every rank of `group` (a ProcessGroup or its name; float32, 0-dim; a
    collective): the amax of a tensorwise tensor that will be gathered, so every shard gets one
    scale. A plain in-place all-reduce in eager mode (the functional collective's wrapping costs
    host time), a functional collective under torch.compile, which can trace it."""
    amax = abs_max(t.detach()).float()
    if torch.compiler.is_compiling():
        import torch.distributed._functional_collectives as funcol

        name = group if isinstance(group, str) else group.group_name
        return funcol.wait_tensor(funcol.all_reduce(amax, "max", name))
    pg = resolve_group(group)
    if pg.size() > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=pg)
    return amax


def abs_max(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |t| (over `dim`, kept), in t's dtype (exact: a max picks one of t's values); one
    reduction kernel where t.abs().amax() takes two."""
    if dim is None:
        return torch.linalg.vector_norm(t, float("inf"))
    return torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=True)


# ---------------------------------------------------------------------- fast path dispatch

@contextlib.contextmanager
def torch_formulas() -> Iterator[None]:
    """Within the block, quantize with the torch formulas on CUDA too (tests compare them with the
    Triton kernels, which must give the same bytes)."""
    global _torch_only
    before, _torch_only = _torch_only, True
    try:
        yield
    finally:
        _torch_only = before


def _fast(t: torch.Tensor) -> Any:
    """The Triton kernels module when t may use it, else None (CPU, torch.compile, turned off)."""
    global _kernels
    if not t.is_cuda or torch.compiler.is_compiling() or _torch_only:
        return None
    if _kernels is None:
        try:
            from asynctp.float8 import kernels
        except ImportError as exc:
            warn_once(
                "fp8-kernels",
                f"asynctp.float8: the Triton quantization kernels are unavailable ({exc}); fp8 tensors are "
                f"quantized with torch ops instead (same results, several kernels per tensor, slower)",
            )
            kernels = False
        _kernels = kernels
    return _kernels or None


def _buffer(out: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out requires a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return out


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if out is None:
        return value
    _buffer(out, tuple(value.shape), value.dtype, value.device).copy_(value)
    return out


def quantize_rows(
    t: torch.Tensor, fp8_dtype: torch.dtype, recipe: Float8Recipe, *,
    out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_fp8, scale [..., 1]): one scale per row (over the last dim)."""
    rows_shape = tuple(t.shape[:-1]) + (1,)
    kernels = _fast(t)
    if kernels is None:
        scale = amax_to_scale(t.abs().amax(dim=-1, keepdim=True), fp8_dtype, recipe)
        return _into(out, to_float8(t, scale, fp8_dtype)), _into(scale_out, scale)
    y = _buffer(out, tuple(t.shape), fp8_dtype, t.device)
    scale = _buffer(scale_out, rows_shape, torch.float32, t.device)
    cols = t.shape[-1]
    kernels.quantize_rows(
        t.reshape(-1, cols), y.view(-1, cols), scale.view(-1), recipe.amax_eps, recipe.power_of_2_scales
    )
    return y, scale


def quantize_tensor(
    t: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype, recipe: Float8Recipe, *,
    out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_fp8, scale ()): one scale from `amax` (0-dim, e.g. agreed over a group)."""
    kernels = _fast(t)
    if kernels is None:
        scale = amax_to_scale(amax, fp8_dtype, recipe)
        return _into(out, to_float8(t, scale, fp8_dtype)), _into(scale_out, scale)
    y = _buffer(out, tuple(t.shape), fp8_dtype, t.device)
    scale = _buffer(scale_out, (), torch.float32, t.device)
    cols = t.shape[-1] if t.ndim else 1
    x2 = t.reshape(-1, cols)
    rows = x2.shape[0]
    kernels.quantize_given_amax(
        x2, amax.reshape(1, 1).expand(rows, cols), y.view(-1, cols), scale.view(1, 1).expand(rows, cols),
        recipe.amax_eps, recipe.power_of_2_scales,
    )
    return y, scale


def quantize_weight_into(
    w_hp: torch.Tensor, recipe: Float8Recipe, *, out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight without its argument checks: (w_fp8 [N, K], scale [N, 1] or ()), for the
    forward (b = w_fp8.t())."""
    if recipe.scaling == "rowwise":
        return quantize_rows(w_hp, recipe.weight_dtype, recipe, out=out, scale_out=scale_out)
    return quantize_tensor(w_hp, abs_max(w_hp), recipe.weight_dtype, recipe, out=out, scale_out=scale_out)


def quantize_weight_for_dgrad(
    w_hp: torch.Tensor, recipe: Float8Recipe, *, out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8, scale) of an nn.Linear weight [N, K] as the b operand of grad @ w: w_fp8 has
    shape [N, K], column-major (strides (1, N)); scale is per input feature [1, K] (rowwise) or ()
    (tensorwise). `out` is the [K, N] contiguous storage."""
    dtype = recipe.weight_dtype
    rowwise = recipe.scaling == "rowwise"
    n, k = w_hp.shape
    kernels = _fast(w_hp)
    if kernels is None:
        amax = w_hp.abs().amax(dim=0, keepdim=True) if rowwise else w_hp.abs().amax()
        scale = amax_to_scale(amax, dtype, recipe)
        w_fp8 = _into(out, to_float8(w_hp, scale, dtype).t().contiguous())
        return w_fp8.t(), _into(scale_out, scale)
    amax = abs_max(w_hp, 0) if rowwise else abs_max(w_hp)
    y = _buffer(out, (k, n), dtype, w_hp.device)
    scale = _buffer(scale_out, (1, k) if rowwise else (), torch.float32, w_hp.device)
    kernels.quantize_given_amax(
        w_hp, amax.expand(n, k), y.t(), scale.expand(n, k), recipe.amax_eps, recipe.power_of_2_scales
    )
    return y.t(), scale


def dequantize(t_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(t_fp8 * scale).to(dtype); scale broadcasts against t_fp8."""
    kernels = _fast(t_fp8)
    if kernels is None:
        return (t_fp8.float() * scale).to(dtype)
    y = torch.empty(t_fp8.shape, dtype=dtype, device=t_fp8.device)
    cols = t_fp8.shape[-1]
    kernels.dequantize(t_fp8.reshape(-1, cols), scale.expand(t_fp8.shape).reshape(-1, cols), y.view(-1, cols))
    return y


# ---------------------------------------------------------------------- public helpers

def _check_hp(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} requires a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _HP_DTYPES:
        raise TypeError(f"{name} requires a dtype in {[str(d) for d in _HP_DTYPES]}, got {t.dtype}")
    if t.ndim < 2:
        raise ValueError(f"{name} requires at least 2 dims, got shape {tuple(t.shape)}")


def _check_recipe(recipe: Any) -> None:
    if not isinstance(recipe, Float8Recipe):
        raise TypeError(f"recipe requires a Float8Recipe (Float8Recipe.from_name(...)), got {type(recipe).__name__}")


def quantize_activation(x_hp: torch.Tensor, recipe: Float8Recipe, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8, x_scale) for an activation shard, ready for the scaled ops' a / a_scale.

    Plain PyTorch equivalent (tensorwise)::

        amax = x_hp.abs().max(); dist.all_reduce(amax, op=MAX, group=group)
        x_scale = amax / fp8_max;  x_fp8 = (x_hp / x_scale).to(fp8)

    group: the group the activation will be gathered over (a ProcessGroup or its name). With
    tensorwise scaling the amax is all-reduced (MAX) over it, so every rank's shard gets the
    same scale and the gathered tensor has one scale (a collective: every rank of the group must
    call). None means the activation is never gathered (e.g. the input of a row-parallel matmul,
    whose partial products are dequantized before they are summed). Rowwise scales ([..., 1])
    are per row and travel with their rows, so they need no agreement and no collective.
    """
    _check_hp("x_hp", x_hp)
    _check_recipe(recipe)
    pg = None if group is None else resolve_group(group)
    dtype = recipe.activation_dtype
    if recipe.scaling == "rowwise":
        return quantize_rows(x_hp, dtype, recipe)
    amax = abs_max(x_hp).float() if pg is None else agreed_amax(x_hp, pg)
    return quantize_tensor(x_hp, amax, dtype, recipe)


def quantize_weight(w_hp: torch.Tensor, recipe: Float8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8 [N, K], w_scale) for an nn.Linear weight (or this rank's shard of one).

    Plain PyTorch equivalent (rowwise)::

        w_scale = w_hp.abs().amax(dim=1, keepdim=True) / fp8_max     # [N, 1], per output feature
        w_fp8 = (w_hp / w_scale).to(fp8)

    Tensorwise gives w_scale of shape (). Call the ops with b = w_fp8.t(), b_scale = w_scale.t().
    A weight shard needs no agreement over the group: each rank's b multiplies only its own
    columns (column-parallel) or its partial is dequantized before the reduction (row-parallel).
    """
    _check_hp("w_hp", w_hp)
    _check_recipe(recipe)
    if w_hp.ndim != 2:
        raise ValueError(f"w_hp requires a 2-D (N, K) weight, got shape {tuple(w_hp.shape)}")
    return quantize_weight_into(w_hp, recipe)
