"""Which inputs of a graph-cache key were at new addresses when the key was new: why a training
loop's calls miss the cache (runtime/graphs.py keys a call by its inputs' addresses).

A key's tensors are numbered in the key's order (the op's key() in asynctp/ops: e.g.
all_gather_scaled_matmul's a_shard, a_scale, bs, b_scales, biases). For each new key, a tensor
counts as moved when its address was not among the last ADDRESSES addresses seen at that number
in keys of the same shape (the same call site, or another layer's call of the same shape: the
weights of four layers are four addresses, all seen after the first step). The first key of a
shape counts nothing; a loop's first pass counts its other layers' tensors once each.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

__all__ = ["Moves"]

ADDRESSES = 64  # addresses remembered per (shape, tensor number)
_SLOTS = 1024  # (shape, tensor number) pairs remembered, least recent forgotten


class Moves:
    """Counts, per op and tensor number, the new keys whose tensor there was at a new address."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, int]] = Counter()
        self._seen: OrderedDict[tuple, OrderedDict[int, None]] = OrderedDict()

    def note(self, op: str, shape: tuple, tensors: list[int]) -> None:
        """A new key of `op` (its shape: the key without addresses; tensors: its addresses in order)."""
        for i, address in enumerate(tensors):
            slot = (shape, i)
            seen = self._seen.get(slot)
            if seen is None:
                seen = self._seen[slot] = OrderedDict()
                if len(self._seen) > _SLOTS:
                    self._seen.popitem(last=False)
            elif address not in seen:
                self.counts[op, i] += 1
            seen[address] = None
            seen.move_to_end(address)
            if len(seen) > ADDRESSES:
                seen.popitem(last=False)

    def summary(self) -> dict[str, int]:
        """{"<op> tensor <i>": new keys with that tensor at a new address}, most first."""
        return {f"{op} tensor {i}": n for (op, i), n in self.counts.most_common()}

