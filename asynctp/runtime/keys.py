"""Graph-cache keys and results (runtime/graphs.py): what of a call a captured graph depends on,
an op's result as a flat list of tensors, and a captured call (Entry)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["tensor_key", "tensor_keys", "strip", "flatten", "unflatten", "Entry"]

_use_count = torch._C._storage_Use_Count


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


class Entry:
    """One captured call: its graph (or, in tests, any replay callable) and its outputs."""

    __slots__ = ("replay", "outs", "spec", "storages", "replays", "shape", "born", "last", "gap", "nbytes")

    def __init__(self, replay: Callable[[], None], outs: list[torch.Tensor], spec: Any, shape: tuple = (),
                 born: int = 0, gap: int = 0, nbytes: tuple[int, int] = (0, 0)) -> None:
        self.replay, self.outs, self.spec, self.replays = replay, outs, spec, 0
        self.shape = shape  # its key without the addresses
        self.nbytes = nbytes  # its key's bytes of inputs + outputs, of outputs
        self.born = self.last = born  # calls through the cache before it was captured / last used
        self.gap = gap  # the longest run of calls seen between two uses of its key: the key's period
        # (StorageImpl pointer, its use count while only this entry holds it) per storage
        seen: dict[int, int] = {}
        for t in outs:
            cdata = t.untyped_storage()._cdata
            seen[cdata] = _use_count(cdata)
        self.storages = list(seen.items())

    def free(self) -> bool:
        """No tensor outside this entry shares an output's storage: a replay may overwrite them."""
        for cdata, baseline in self.storages:
            if _use_count(cdata) > baseline:
                return False
        return True

    def result(self) -> Any:
        # new tensors (not views: no _base) on the outputs' storages, raising their use counts
        return unflatten([t.detach() for t in self.outs], self.spec)
