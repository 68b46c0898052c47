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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from asynctp.float8.recipe import Float8Recipe
from asynctp.symm import resolve_group

__all__ = ["quantize_activation", "quantize_weight", "amax_to_scale", "to_float8"]

_HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def amax_to_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, recipe: Float8Recipe) -> torch.Tensor:
    """The float32 dequantization scale for tensors whose absolute maximum is `amax`."""
    scale = amax.float().clamp(min=recipe.amax_eps) / torch.finfo(fp8_dtype).max
    if recipe.power_of_2_scales:
        # rounded up, so x / scale never exceeds fp8_max
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def to_float8(x_hp: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """x_hp / scale, saturated to the float8 range (scale broadcasts: () or [..., 1])."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (x_hp.float() / scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


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
        amax = x_hp.abs().amax(dim=-1, keepdim=True).float()
    else:
        amax = x_hp.abs().amax().float()
        if pg is not None and pg.size() > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=pg)
    scale = amax_to_scale(amax, dtype, recipe)
    return to_float8(x_hp, scale, dtype), scale


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
    dtype = recipe.weight_dtype
    if recipe.scaling == "rowwise":
        amax = w_hp.abs().amax(dim=1, keepdim=True).float()
    else:
        amax = w_hp.abs().amax().float()
    scale = amax_to_scale(amax, dtype, recipe)
    return to_float8(w_hp, scale, dtype), scale
