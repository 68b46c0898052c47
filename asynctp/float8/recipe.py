"""Float8Recipe: how activations, weights and gradients are quantized to float8 (a frozen config)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Float8Recipe", "SCALINGS"]

SCALINGS = ("tensorwise", "rowwise")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, kw_only=True)
class Float8Recipe:
    """Current scaling: every call derives its scales from the tensor it quantizes (amax ->
    scale = amax / fp8_max); no amax history. Build with `Float8Recipe.from_name("rowwise")`."""

    # "tensorwise": one scale per tensor; the amax of an activation that will be gathered is
    # all-reduced (MAX) over the group, so every shard shares the scale. "rowwise": one scale per
    # row of an activation (it travels with its row) and per output feature of a weight.
    scaling: str = "tensorwise"
    # float8 dtype of forward activations (e4m3: more precision, range enough after scaling)
    activation_dtype: torch.dtype = torch.float8_e4m3fn
    # float8 dtype of weights
    weight_dtype: torch.dtype = torch.float8_e4m3fn
    # float8 dtype of gradients in backward (e5m2: gradients need range more than precision)
    grad_dtype: torch.dtype = torch.float8_e5m2
    # round every scale up to a power of two, so scaling changes only exponents (no rounding
    # from the scale's mantissa) and tensors quantized on different ranks compare exactly
    power_of_2_scales: bool = False
    # amax floor: an all-zero tensor gets scale amax_eps / fp8_max instead of 0 (no 0 / 0)
    amax_eps: float = 1e-12
    # cuBLAS fast accumulation in the forward matmul: faster, fewer fp32 promotions of the
    # tensor-core partial sums (backward matmuls never use it)
    use_fast_accum: bool = False

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling requires one of {list(SCALINGS)}, got {self.scaling!r}")
        for name in ("activation_dtype", "weight_dtype", "grad_dtype"):
            dtype = getattr(self, name)
            if dtype not in _FP8_DTYPES:
                raise ValueError(f"{name} requires one of {[str(d) for d in _FP8_DTYPES]}, got {dtype}")
        # each matmul of a linear layer pairs two of the three; cuBLAS has no e5m2 x e5m2 GEMM
        for x, y in (("activation_dtype", "weight_dtype"), ("grad_dtype", "weight_dtype"),
                     ("grad_dtype", "activation_dtype")):
            if getattr(self, x) == getattr(self, y) == torch.float8_e5m2:
                raise ValueError(f"{x} and {y} require at most one float8_e5m2 (no e5m2 x e5m2 GEMM), got both")
        for name in ("power_of_2_scales", "use_fast_accum"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} requires a bool, got {type(getattr(self, name)).__name__}")
        eps = self.amax_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"amax_eps requires a positive finite float, got {eps!r}")

    @classmethod
    def from_name(cls, name: str) -> Float8Recipe:
        """The named recipes: "tensorwise" (fast) and "rowwise" (more accurate with outliers)."""
        if name == "tensorwise":
            return cls(scaling="tensorwise", use_fast_accum=True)
        if name == "rowwise":
            return cls(scaling="rowwise", power_of_2_scales=True, use_fast_accum=True)
        raise ValueError(f"Float8Recipe.from_name requires one of {list(SCALINGS)}, got {name!r}")
