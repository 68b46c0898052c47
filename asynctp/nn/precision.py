"""Float8 matmuls of the linears: which recipe, and how each of the four fused matmuls quantizes."""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["Float8Matmuls", "resolve_float8"]

_NEEDED = ("Float8Recipe", "all_gather_scaled_matmul", "scaled_matmul_reduce_scatter")


def resolve_float8(float8: Any) -> Float8Matmuls | None:
    """None, a recipe from asynctp.float8, or a recipe name -> the matmuls (None: high precision)."""
    if float8 is None:
        return None
    try:
        module = importlib.import_module("asynctp.float8")
    except ImportError as exc:
        raise ValueError(f"float8 requires the module asynctp.float8, which is missing ({exc})") from None
    missing = [name for name in _NEEDED if not hasattr(module, name)]
    if missing:
        raise ValueError(
            f"float8 requires asynctp.float8 to provide {', '.join(_NEEDED)}; this installation lacks "
            f"{', '.join(missing)} (use float8=None)"
        )
    recipe = module.Float8Recipe.from_name(float8) if isinstance(float8, str) else float8
    if not isinstance(recipe, module.Float8Recipe):
        raise TypeError(f"float8 requires None, a recipe name or an asynctp.float8.Float8Recipe, got {type(float8).__name__}")
    return Float8Matmuls(module, recipe)


class Float8Matmuls:
    """The fp8 versions of the forward and dgrad matmuls (wgrad stays in the input precision)."""

    def __init__(self, module: Any, recipe: Any) -> None:
        self.module = module
        self.recipe = recipe

    def all_gather_linear(self, x_shard: torch.Tensor, weights: list[torch.Tensor], biases: list, config: Any):
        raise ValueError("float8 requires asynctp.float8, which is not integrated yet")

    def dgrad_reduce_scatter(self, grad: torch.Tensor, weight: torch.Tensor, config: Any) -> torch.Tensor:
        raise ValueError("float8 requires asynctp.float8, which is not integrated yet")

    def linear_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor, bias: Any, config: Any) -> torch.Tensor:
        raise ValueError("float8 requires asynctp.float8, which is not integrated yet")

    def dgrad_all_gather(self, grad_shard: torch.Tensor, weight: torch.Tensor, config: Any):
        raise ValueError("float8 requires asynctp.float8, which is not integrated yet")
