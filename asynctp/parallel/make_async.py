"""make_async: a vanilla sequence-parallel plan for parallelize_module becomes the async one.

The classic plan gathers on the parent module and runs plain column-parallel children:

    "attention":    PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    "attention.wq": ColwiseParallel()                      (also wk, wv)
    "attention.wo": RowwiseParallel(output_layouts=Shard(1))

and becomes

    "attention":    PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Shard(1), None))
    "attention.wq": AsyncColwiseParallel(input_layouts=Shard(1), shared_gather=qkv)   (also wk, wv)
    "attention.wo": AsyncRowwiseParallel(output_layouts=Shard(1))

The parent keeps its PrepareModuleInput, now without the gather: it still hands the module a
DTensor, whose global shape the module's own reshapes read (a plain local tensor would give them
the sequence shard's length). Per-linear plans (ColwiseParallel(input_layouts=Shard(d))) convert
directly; torchao's Float8ColwiseParallel / Float8RowwiseParallel / PrepareFloat8ModuleInput map to
the tensorwise recipe they implement. Hugging Face tp_plan string dicts go through hf_plan.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from asynctp.parallel.colwise import AsyncColwiseParallel
from asynctp.parallel.rowwise import AsyncRowwiseParallel
from asynctp.parallel.waited import WaitedRowwiseParallel
from asynctp.parallel.shared_gather import SharedGather

__all__ = ["make_async", "expand_wildcards", "warn_unconverted"]

# torchao's float8 TP styles (float8_tensor_parallel) cast with tensorwise dynamic scaling
_TORCHAO_FLOAT8 = {"Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"}


def make_async(
    plan: dict[str, Any], module: nn.Module | None = None, *, share_gathers: bool = True, float8: Any = None,
    strategy: str = "auto",
) -> dict[str, ParallelStyle]:
    """The async version of a sequence-parallel plan, for parallelize_module(module, mesh, plan).

    Args:
        plan: {module path: ParallelStyle} (torch's styles, torchao's float8 styles), or a Hugging
            Face tp_plan of strings (model.tp_plan), which needs `module`.
        module: the model the plan is for. With it, wildcard keys ("layers.*.attention.wq") are
            expanded so each block's siblings get their own shared gather, and entries on modules
            that are not nn.Linear (embeddings) are kept as they are.
        share_gathers: sibling column-parallel linears fed one input (wq / wk / wv, w1 / w3) share
            one gather (SharedGather).
        float8: an asynctp fp8 recipe (or its name) for every converted linear; torchao's float8
            styles map to "tensorwise" unless this is given.
        strategy: the fused ops' strategy.

    Entries that cannot be made async stay as they were and are named in one UserWarning.
    """
    if not isinstance(plan, dict):
        raise TypeError(f"make_async requires a dict plan, got {type(plan).__name__}")
    if plan and all(isinstance(v, str) for v in plan.values()):
        from asynctp.parallel.hf_plan import from_hf_plan

        return from_hf_plan(plan, module, share_gathers=share_gathers, float8=float8, strategy=strategy)
    if any(isinstance(v, str) for v in plan.values()):
        raise ValueError("make_async requires a plan of ParallelStyles or of Hugging Face strings, got a mix")
    if module is not None:
        plan = expand_wildcards(plan, module)
    options = dict(share_gathers=share_gathers, float8=float8, strategy=strategy)
    return _Converter(plan, module, options).run()


def expand_wildcards(plan: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """Keys with "*" replaced by the module paths they match (parallelize_module's atom-wise
    fnmatch); a key matching nothing stays, for parallelize_module to report."""
    names = [name for name, _ in module.named_modules() if name]
    out: dict[str, Any] = {}
    for key, style in plan.items():
        if "*" not in key:
            out[key] = style
            continue
        atoms = key.split(".")
        hits = [n for n in names if len(n.split(".")) == len(atoms)
                and all(fnmatch.fnmatchcase(a, p) for a, p in zip(n.split("."), atoms))]
        for name in hits or [key]:
            out[name] = style
    return out


def warn_unconverted(unconverted: dict[str, str]) -> None:
    if unconverted:
        lines = "\n".join(f"  {key}: {why}" for key, why in unconverted.items())
        warnings.warn(f"make_async kept {len(unconverted)} plan entries as they were:\n{lines}", UserWarning, stacklevel=3)


def _parent(key: str) -> str:
    return key.rpartition(".")[0]


def _first_shard_input(style: PrepareModuleInput) -> tuple[int, Shard] | None:
    """(index, Shard) of the input that style gathers (Shard -> Replicate), if exactly one."""
    ins, wants = style.input_layouts or (), style.desired_input_layouts or ()
    hits = [(i, a) for i, (a, b) in enumerate(zip(ins, wants)) if isinstance(a, Shard) and isinstance(b, Replicate)]
    return hits[0] if len(hits) == 1 else None


class _Converter:
    def __init__(self, plan: dict[str, Any], module: nn.Module | None, options: dict[str, Any]) -> None:
        self.plan, self.module = plan, module
        self.share, self.float8, self.strategy = options["share_gathers"], options["float8"], options["strategy"]
        self.out: dict[str, Any] = dict(plan)
        self.unconverted: dict[str, str] = {}
        self.shared: dict[tuple[str, str], SharedGather] = {}

    def run(self) -> dict[str, Any]:
        gathered = {}  # parent path -> the Shard its PrepareModuleInput gathered
        for key, style in self.plan.items():
            if isinstance(style, PrepareModuleInput):
                hit = _first_shard_input(style)
                if hit is not None and self._children(key):
                    gathered[key] = hit[1]
                    self.out[key] = _without_gather(style, hit[0])
        for key, style in self.plan.items():
            if isinstance(style, ColwiseParallel) and not isinstance(style, AsyncColwiseParallel):
                self._colwise(key, style, gathered.get(_parent(key)))
            elif isinstance(style, RowwiseParallel) and not isinstance(style, AsyncRowwiseParallel):
                self._rowwise(key, style)
        warn_unconverted(self.unconverted)
        return self.out

    def _children(self, parent: str) -> list[str]:
        return [k for k, s in self.plan.items() if _parent(k) == parent and isinstance(s, ColwiseParallel)]

    def _target(self, key: str) -> nn.Module | None:
        if self.module is None:
            return None
        try:
            return self.module.get_submodule(key)
        except AttributeError:
            return None

    def _float8(self, style: ParallelStyle) -> Any:
        if self.float8 is not None:
            return self.float8
        return "tensorwise" if type(style).__name__ in _TORCHAO_FLOAT8 else None

    def _skip(self, key: str, style: ParallelStyle) -> bool:
        """True (and noted unless an embedding) when the target is not a linear."""
        target = self._target(key)
        if target is None or isinstance(target, nn.Linear):
            return False
        if not isinstance(target, nn.Embedding):
            self.unconverted[key] = f"{type(style).__name__} on a {type(target).__name__} (the async styles serve nn.Linear)"
        return True

    def _colwise(self, key: str, style: ColwiseParallel, parent_shard: Shard | None) -> None:
        if self._skip(key, style):
            return
        placement = style.input_layouts[0]
        if isinstance(placement, Replicate) and parent_shard is not None:
            placement = parent_shard
        if not isinstance(placement, Shard):
            self.unconverted[key] = "its input is replicated with no sequence-sharded parent gather (nothing to overlap)"
            return
        if not (isinstance(style.output_layouts[0], Shard) and style.output_layouts[0].dim in (-1,)):
            self.unconverted[key] = f"output_layouts={style.output_layouts[0]} (async column-parallel gives Shard(-1))"
            return
        shared = None
        if self.share:
            shared = self.shared.setdefault((_parent(key), repr(placement)), SharedGather())
        self.out[key] = AsyncColwiseParallel(
            input_layouts=placement, output_layouts=Shard(-1), use_local_output=style.use_local_output,
            float8=self._float8(style), strategy=self.strategy, shared_gather=shared,
        )

    def _rowwise(self, key: str, style: RowwiseParallel) -> None:
        if isinstance(self._target(key), nn.Embedding) and type(style) is RowwiseParallel:
            # waited output: a block compiled on its own then gets a plain input (see waited.py)
            self.out[key] = WaitedRowwiseParallel(input_layouts=style.input_layouts[0],
                                                  output_layouts=style.output_layouts[0],
                                                  use_local_output=style.use_local_output)
            return
        if self._skip(key, style):
            return
        out_placement, in_placement = style.output_layouts[0], style.input_layouts[0]
        if isinstance(in_placement, Replicate):
            if self._target(key) is None:  # the embedding shape: a lookup has no matmul to overlap
                return
            self.unconverted[key] = "input_layouts=Replicate() (a row-parallel linear reads Shard(-1))"
            return
        if not isinstance(out_placement, Shard):
            self.unconverted[key] = f"output_layouts={out_placement} (an all-reduce has no matmul after it to overlap)"
            return
        self.out[key] = AsyncRowwiseParallel(
            input_layouts=in_placement, output_layouts=out_placement, use_local_output=style.use_local_output,
            float8=self._float8(style), strategy=self.strategy,
        )


def _without_gather(style: PrepareModuleInput, index: int) -> PrepareModuleInput:
    """The same PrepareModuleInput, input `index` left sharded (the children gather it)."""
    desired = list(style.desired_input_layouts)
    desired[index] = style.input_layouts[index]
    return PrepareModuleInput(
        input_layouts=style.input_layouts, desired_input_layouts=tuple(desired),
        input_kwarg_layouts=style.input_kwarg_layouts or None,
        desired_input_kwarg_layouts=style.desired_input_kwarg_layouts or None,
        use_local_output=style.use_local_output,
    )
