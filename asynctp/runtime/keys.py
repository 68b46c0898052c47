"""Graph-cache keys and results (runtime/graphs.py): what of a call a captured graph depends on,
and an op's result as a flat list of tensors."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensor_key", "tensor_keys", "strip", "flatten", "unflatten"]


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What of a tensor a captured graph depends on: where it is and how it is laid out."""
    if t is None:
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def _is_tensor_key(value: tuple) -> bool:
    """Whether a tuple of a key is a tensor_key() (address, shape, strides, dtype)."""
    return len(value) == 4 and isinstance(value[0], int) and isinstance(value[3], torch.dtype)


def tensor_keys(key: Any) -> list[tuple]:
    """The tensor_key() tuples anywhere in a key, in order."""
    if isinstance(key, tuple):
        if _is_tensor_key(key):
            return [key]
        return [t for v in key for t in tensor_keys(v)]
    return []


def strip(value: Any) -> Any:
    """A key without the addresses: tensor keys lose their data pointer."""
    if isinstance(value, tuple):
        if _is_tensor_key(value):
            return value[1:]
        return tuple(strip(v) for v in value)
    return value


def flatten(result: Any) -> tuple[list[torch.Tensor], Any]:
    """(tensors, spec) of an op's result: a tensor, or (tensor or None, [tensors])."""
    if isinstance(result, torch.Tensor):
        return [result], None
    first, outs = result
    return ([] if first is None else [first]) + list(outs), first is not None


def unflatten(tensors: list[torch.Tensor], spec: Any) -> Any:
    return tensors[0] if spec is None else ((tensors[0], tensors[1:]) if spec else (None, tensors))
