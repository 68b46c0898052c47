"""Float8 matmuls of the linears: which recipe, and how each of the four fused matmuls quantizes.

Per linear (recipe from asynctp.float8, current scaling):
    forward   x: recipe.activation_dtype, weight: recipe.weight_dtype   (scaled fused op)
    dgrad     grad_out: recipe.grad_dtype, weight: recipe.weight_dtype  (scaled fused op)
    wgrad     in the input precision (the column-parallel input re-gathered in high precision;
              the row-parallel output grad dequantized after its fp8 gather)
Tensorwise scales of a tensor that is gathered are agreed over the group (amax all-reduced);
rowwise scales travel with their rows. Weights are quantized per output feature for the forward
(b = w_fp8.t(), per-column scale) and per input feature for dgrad (b = w, per-column scale).

A Float8Matmuls made once per module (asynctp.parallel does) quantizes into buffers it keeps,
one per operand, when CUDA graphs are on: the fused ops then see the same addresses at every
step and replay from their graphs (asynctp.runtime.graphs). The cost is memory: each linear keeps its
fp8 operands (about its weights' bf16 size plus its fp8 activations and gradients) between calls.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from asynctp.float8 import Float8Recipe
from asynctp.float8 import quantize as q
from asynctp.ops.all_gather_scaled_matmul import all_gather_scaled_matmul, all_gather_scaled_matmul_with_scale
from asynctp.ops.scaled_matmul_reduce_scatter import scaled_matmul_reduce_scatter
from asynctp.ops.strategy import eager_call_ok
from asynctp.runtime import graphs

__all__ = ["Float8Matmuls", "resolve_float8"]

# the fp8 functions the matmuls call
_API = {
    "quantize_rows": q.quantize_rows, "quantize_tensor": q.quantize_tensor, "quantize_weight_into": q.quantize_weight_into,
    "quantize_weight_for_dgrad": q.quantize_weight_for_dgrad, "dequantize": q.dequantize, "abs_max": q.abs_max,
    "agreed_amax": q.agreed_amax, "all_gather_scaled_matmul": all_gather_scaled_matmul,
    "all_gather_scaled_matmul_with_scale": all_gather_scaled_matmul_with_scale,
    "scaled_matmul_reduce_scatter": scaled_matmul_reduce_scatter,
}


def resolve_float8(float8: Any, keep_buffers: bool = False) -> Float8Matmuls | None:
    """None, a recipe from asynctp.float8, or a recipe name -> the matmuls (None: high precision).
    keep_buffers: quantize into buffers kept between calls (for an instance made once per module,
    as asynctp.parallel makes them; a per-call instance would only hold them longer)."""
    if float8 is None:
        return None
    recipe = Float8Recipe.from_name(float8) if isinstance(float8, str) else float8
    if not isinstance(recipe, Float8Recipe):
        raise TypeError(f"float8 requires None, a recipe name or an asynctp.float8.Float8Recipe, got {type(float8).__name__}")
    return Float8Matmuls(recipe, _API, keep_buffers)


class Float8Matmuls:
    """The fp8 versions of the forward and dgrad matmuls of both linears."""

    def __init__(self, recipe: Any, api: dict[str, Any], keep_buffers: bool = False) -> None:
        self.recipe = recipe
        self.keep_buffers = keep_buffers
        self.api = types.SimpleNamespace(**api)
        self.rowwise = recipe.scaling == "rowwise"
        # role -> (fp8 buffer, scale buffer), reused by the next call of the same shape
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ column-parallel

    def all_gather_linear(
        self, x_shard: torch.Tensor, weights: list[torch.Tensor], biases: list, config: Any
    ) -> tuple[None, list[torch.Tensor]]:
        """(None, outs): outs[i] = x_gathered @ weights[i].t() + biases[i], fp8 inputs."""
        recipe = self.recipe
        x_fp8, x_scale = self._quantize("x", x_shard, recipe.activation_dtype, config.group_name)
        bs, b_scales = [], []
        for i, w in enumerate(weights):
            w_fp8, w_scale = self._quantize_weight(f"w{i}", w)
            bs.append(w_fp8.t())
            b_scales.append(w_scale.t())
        _, outs = self._gather_mm(
            x_fp8, bs, x_scale, b_scales, config, x_shard.dtype, biases, recipe.use_fast_accum, return_a=False
        )
        return None, outs

    def dgrad_reduce_scatter(self, grad: torch.Tensor, weight: torch.Tensor, config: Any) -> torch.Tensor:
        """reduce_scatter(grad @ weight) along config.dim, fp8 inputs (no agreement needed:
        partial products are dequantized before they are summed)."""
        g_fp8, g_scale = self._quantize("grad", grad, self.recipe.grad_dtype, None)
        b, b_scale = self._weight_for_dgrad(weight)
        return self._mm_scatter(g_fp8, b, g_scale, b_scale, config, grad.dtype, None, False)

    # ------------------------------------------------------------------ row-parallel

    def linear_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor, bias: Any, config: Any) -> torch.Tensor:
        x_fp8, x_scale = self._quantize("x", x, self.recipe.activation_dtype, None)
        w_fp8, w_scale = self._quantize_weight("w0", weight)
        return self._mm_scatter(x_fp8, w_fp8.t(), x_scale, w_scale.t(), config, x.dtype, bias, self.recipe.use_fast_accum)

    def dgrad_all_gather(self, grad_shard: torch.Tensor, weight: torch.Tensor, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(grad_gathered in grad_shard's dtype, grad_gathered @ weight), the gather in fp8."""
        g_fp8, g_scale = self._quantize("grad", grad_shard, self.recipe.grad_dtype, config.group_name)
        b, b_scale = self._weight_for_dgrad(weight)
        if self.rowwise and config.dim != grad_shard.ndim - 1 and eager_call_ok(g_fp8, g_scale, b, b_scale):
            # the fused op's gather moves the scales with their rows: it hands them back too
            g_gathered_fp8, scale, (grad_x,) = self.api.all_gather_scaled_matmul_with_scale(
                g_fp8, [b], g_scale, [b_scale], config.dim, config.group_name, out_dtype=grad_shard.dtype,
                strategy=config.strategy,
            )
            return self.api.dequantize(g_gathered_fp8, scale, grad_shard.dtype), grad_x
        g_gathered_fp8, (grad_x,) = self._gather_mm(
            g_fp8, [b], g_scale, [b_scale], config, grad_shard.dtype, [None], False, return_a=True
        )
        scale = self._gather_row_scales(g_scale, grad_shard.shape[-1], config) if self.rowwise else g_scale
        grad_gathered = self.api.dequantize(g_gathered_fp8, scale, grad_shard.dtype)
        return grad_gathered, grad_x

    # ------------------------------------------------------------------ quantization

    def _quantize(
        self, role: str, t: torch.Tensor, dtype: torch.dtype, group_name: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(t_fp8, scale), current scaling; a tensorwise amax is agreed over `group_name` (the
        tensor will be gathered; quantize.agreed_amax)."""
        scale_shape = tuple(t.shape[:-1]) + (1,) if self.rowwise else ()
        out, scale_out = self._kept(role, t, tuple(t.shape), dtype, scale_shape)
        if self.rowwise:
            return self.api.quantize_rows(t, dtype, self.recipe, out=out, scale_out=scale_out)
        if group_name is None:
            amax = self.api.abs_max(t.detach()).float()
        else:
            amax = self.api.agreed_amax(t, group_name)
        return self.api.quantize_tensor(t, amax, dtype, self.recipe, out=out, scale_out=scale_out)

    def _quantize_weight(self, role: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_fp8 [N, K], scale [N, 1] or ()) for the forward (b = w_fp8.t())."""
        scale_shape = (w.shape[0], 1) if self.rowwise else ()
        out, scale_out = self._kept(role, w, tuple(w.shape), self.recipe.weight_dtype, scale_shape)
        return self.api.quantize_weight_into(w, self.recipe, out=out, scale_out=scale_out)

    def _kept(
        self, role: str, like: torch.Tensor, shape: tuple, dtype: torch.dtype, scale_shape: tuple
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This module's buffers for `role` (made or remade to fit), or (None, None) where keeping
        them buys nothing: no CUDA graphs to replay (CPU, ASYNCTP_GRAPHS=0, torch.compile), or this
        instance lives for one call only."""
        if torch.compiler.is_compiling() or not (self.keep_buffers and like.is_cuda and graphs.enabled()):
            return None, None
        kept = self._buffers.get(role)
        if (
            kept is None or tuple(kept[0].shape) != shape or kept[0].dtype != dtype
            or kept[0].device != like.device or tuple(kept[1].shape) != scale_shape
        ):
            kept = (
                torch.empty(shape, dtype=dtype, device=like.device),
                torch.empty(scale_shape, dtype=torch.float32, device=like.device),
            )
            self._buffers[role] = kept
        return kept

    def _gather_mm(
        self, a: torch.Tensor, bs: list[torch.Tensor], a_scale: torch.Tensor, b_scales: list[torch.Tensor],
        config: Any, out_dtype: torch.dtype, biases: list, fast_accum: bool, return_a: bool,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        if torch.compiler.is_compiling():
            a_gathered, outs = torch.ops.asynctp.all_gather_scaled_matmul(
                a, bs, a_scale, b_scales, config.dim, config.group_name, out_dtype, biases, fast_accum, return_a,
                config.strategy,
            )
            return a_gathered, list(outs)
        return self.api.all_gather_scaled_matmul(
            a, bs, a_scale, b_scales, config.dim, config.group_name, out_dtype=out_dtype, biases=biases,
            use_fast_accum=fast_accum, return_a=return_a, strategy=config.strategy,
        )

    def _mm_scatter(
        self, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, config: Any,
        out_dtype: torch.dtype, bias: torch.Tensor | None, fast_accum: bool,
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.asynctp.scaled_matmul_reduce_scatter(
                a, b, a_scale, b_scale, config.dim, config.group_name, out_dtype, bias, "sum", fast_accum, config.strategy
            )
        return self.api.scaled_matmul_reduce_scatter(
            a, b, a_scale, b_scale, config.dim, config.group_name, out_dtype=out_dtype, bias=bias,
            use_fast_accum=fast_accum, strategy=config.strategy,
        )

    def _weight_for_dgrad(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """b = weight [N, K] as the (K_b = N, N_b = K) operand, column-major, scaled per K."""
        n, k = weight.shape
        out, scale_out = self._kept("w_dgrad", weight, (k, n), self.recipe.weight_dtype, (1, k) if self.rowwise else ())
        return self.api.quantize_weight_for_dgrad(weight, self.recipe, out=out, scale_out=scale_out)

    def _gather_row_scales(self, scale: torch.Tensor, cols: int, config: Any) -> torch.Tensor:
        """Every rank's rowwise scales ([..., 1] each, a few bytes per row: a plain all-gather),
        laid out to broadcast against the gathered grad."""
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # renamed in newer torch
        stacked = funcol.wait_tensor(gather(scale.contiguous(), 0, config.group_name))
        parts = stacked.chunk(stacked.shape[0] // scale.shape[0], dim=0)
        if config.dim == scale.ndim - 1:
            # gathered along the columns: rank p's scale covers columns p * cols:(p + 1) * cols
            return torch.cat(parts, dim=-1).repeat_interleave(cols, dim=-1)
        return torch.cat(parts, dim=config.dim)


