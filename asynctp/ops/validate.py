"""Argument checks shared by the ops: run before any communication, so bad input never hangs.

Messages read "<argument> requires <what>, got <what was given>".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "STRATEGIES",
    "check_tensor",
    "check_dim",
    "check_strategy",
    "check_matrices",
    "check_matrix",
    "check_biases",
    "check_all_gather_matmul",
    "check_matmul_reduce_scatter",
]

STRATEGIES = ("auto", "serial", "pipeline", "fused", "ring")
REDUCE_OPS = ("sum", "avg")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_tensor(name: str, t: Any, min_ndim: int = 0) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} requires a torch.Tensor, got {type(t).__name__}")
    if t.ndim < min_ndim:
        raise ValueError(f"{name} requires at least {min_ndim} dims, got shape {tuple(t.shape)}")
    return t


def check_dim(name: str, dim: Any, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} requires an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name} requires a dim in [{-ndim}, {ndim - 1}] for a {ndim}-D input, got {dim}")
    return dim % ndim


def check_strategy(strategy: Any, allowed: Sequence[str] = STRATEGIES) -> str:
    if strategy not in allowed:
        raise ValueError(f"strategy requires one of {list(allowed)}, got {strategy!r}")
    return strategy


def _check_like(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} requires dtype {ref.dtype} (the dtype of {ref_name}), got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} requires device {ref.device} (the device of {ref_name}), got {t.device}")


def check_matrices(name: str, bs: Any, a: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Each b is (K, N), same dtype and device as a."""
    if isinstance(bs, torch.Tensor) or not isinstance(bs, (list, tuple)):
        raise TypeError(f"{name} requires a list of (K, N) tensors, got {type(bs).__name__}")
    if len(bs) == 0:
        raise ValueError(f"{name} requires at least one (K, N) matrix, got an empty list")
    for i, b in enumerate(bs):
        check_matrix(f"{name}[{i}]", b, a, k)
    return list(bs)


def check_matrix(label: str, b: Any, a: torch.Tensor, k: int) -> torch.Tensor:
    check_tensor(label, b)
    if b.ndim != 2:
        raise ValueError(f"{label} requires a 2-D (K, N) matrix, got shape {tuple(b.shape)}")
    _check_like(label, b, a, "a")
    if b.shape[0] != k:
        raise ValueError(f"{label} requires shape[0] == K = {k} (a's last dim), got {tuple(b.shape)}")
    return b


def check_biases(name: str, biases: Any, bs: list[torch.Tensor], a: torch.Tensor) -> list[torch.Tensor | None]:
    if biases is None:
        return [None] * len(bs)
    if isinstance(biases, torch.Tensor) or not isinstance(biases, (list, tuple)):
        raise TypeError(f"{name} requires a list (one bias or None per b), got {type(biases).__name__}")
    if len(biases) != len(bs):
        raise ValueError(f"{name} requires one entry per b ({len(bs)}), got {len(biases)}")
    for i, (bias, b) in enumerate(zip(biases, bs)):
        if bias is None:
            continue
        label = f"{name}[{i}]"
        check_tensor(label, bias)
        if tuple(bias.shape) != (b.shape[1],):
            raise ValueError(f"{label} requires shape ({b.shape[1]},) (b's N), got {tuple(bias.shape)}")
        _check_like(label, bias, a, "a")
    return list(biases)


def _check_input(name: str, a: Any) -> torch.Tensor:
    check_tensor(name, a, min_ndim=2)
    if a.dtype not in _FLOATS:
        raise TypeError(f"{name} requires a floating dtype {[str(d) for d in _FLOATS]}, got {a.dtype}")
    return a


def check_all_gather_matmul(
    a_shard: Any, bs: Any, gather_dim: Any, world_size: int, biases: Any, strategy: Any
) -> tuple[int, list[torch.Tensor], list[torch.Tensor | None]]:
    """Returns (normalized gather_dim, bs, biases)."""
    _check_input("a_shard", a_shard)
    dim = check_dim("gather_dim", gather_dim, a_shard.ndim)
    k = a_shard.shape[-1] * (world_size if dim == a_shard.ndim - 1 else 1)
    bs = check_matrices("bs", bs, a_shard, k)
    biases = check_biases("biases", biases, bs, a_shard)
    check_strategy(strategy)
    return dim, bs, biases


def check_matmul_reduce_scatter(
    a: Any, b: Any, scatter_dim: Any, world_size: int, reduce_op: Any, bias: Any, strategy: Any
) -> int:
    """Returns the normalized scatter_dim."""
    _check_input("a", a)
    check_matrix("b", b, a, a.shape[-1])
    dim = check_dim("scatter_dim", scatter_dim, a.ndim)
    size = b.shape[1] if dim == a.ndim - 1 else a.shape[dim]
    if size % world_size:
        raise ValueError(
            f"scatter_dim {scatter_dim} requires a size divisible by the world size {world_size}, got {size}"
        )
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"reduce_op requires one of {list(REDUCE_OPS)}, got {reduce_op!r}")
    if bias is not None:
        check_biases("bias", [bias], [b], a)
    check_strategy(strategy)
    return dim
