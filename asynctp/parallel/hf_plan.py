"""Hugging Face tp_plan string dicts (model.tp_plan) as async sequence-parallel torch plans.

HF's Llama-family plan is plain tensor parallelism: "colwise" / "rowwise" linears, a
vocabulary-sharded "embedding_rowwise", and "colwise_gather_output" for the head; between
layers the activations are replicated. The async plan is sequence-parallel instead:

    embed_tokens        RowwiseParallel -> Shard(1) as a DTensor
    *norm (RMSNorm...)  SequenceParallel                        (added: HF's plan has none)
    colwise             AsyncColwiseParallel(input_layouts=Shard(1)), siblings share one gather
    rowwise             AsyncRowwiseParallel(output_layouts=Shard(1)) as a DTensor
    lm_head             ColwiseParallel(input_layouts=Shard(1)) gathering its output

The residual stream stays a DTensor (use_local_output=False) because HF reads sequence lengths
from it: the model derives cache_position / position_ids and the causal mask from
inputs_embeds.shape[1], and each attention reshapes to hidden_states.shape[:-1]; a DTensor's
shape is the global one, a local shard's would give every rank positions 0..S/R.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from asynctp.parallel.colwise import AsyncColwiseParallel
from asynctp.parallel.make_async import expand_wildcards, warn_unconverted
from asynctp.parallel.rowwise import AsyncRowwiseParallel
from asynctp.parallel.shared_gather import SharedGather

__all__ = ["from_hf_plan", "vanilla_plan"]

_NORM_SUFFIXES = ("RMSNorm", "LayerNorm")


def vanilla_plan(module: nn.Module) -> dict[str, ParallelStyle]:
    """The same sequence-parallel plan for module.tp_plan with torch's own styles (the baseline)."""
    return from_hf_plan(dict(module.tp_plan), module, asynchronous=False)


def from_hf_plan(
    plan: dict[str, str], module: nn.Module | None, *, share_gathers: bool = True, float8: Any = None,
    strategy: str = "auto", asynchronous: bool = True,
) -> dict[str, ParallelStyle]:
    """The async torch plan for a Hugging Face tp_plan of `module` (keys relative to it: pass
    model.tp_plan with the model, or config.base_model_tp_plan with model.model). Entries of
    another kind ("local_colwise", "gather", ...) are left out and named in one warning."""
    if module is None:
        raise ValueError("make_async requires module= for a Hugging Face tp_plan (its norms and blocks are "
                         "found in the model), got None")
    shared: dict[str, SharedGather] = {}
    out: dict[str, ParallelStyle] = {}
    unconverted: dict[str, str] = {}
    for key, kind in expand_wildcards(plan, module).items():
        style = _style(key, kind, shared, share_gathers, float8, strategy, asynchronous)
        if style is None:
            unconverted[key] = f"{kind!r} has no sequence-parallel async form (left out of the plan)"
        else:
            out[key] = style
    for name, sub in module.named_modules():
        if name and name not in out and type(sub).__name__.endswith(_NORM_SUFFIXES):
            out[name] = SequenceParallel(use_local_output=False)
    warn_unconverted(unconverted)
    return out


def _style(
    key: str, kind: str, shared: dict[str, SharedGather], share: bool, float8: Any, strategy: str, asynchronous: bool,
) -> ParallelStyle | None:
    if not asynchronous and kind in ("colwise", "rowwise"):
        if float8 is not None:
            raise ValueError(f"the vanilla plan requires float8=None (fp8 is asynctp's), got {float8!r}")
        if kind == "colwise":
            return ColwiseParallel(input_layouts=Shard(1))
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    if kind == "colwise":
        gather = shared.setdefault(key.rpartition(".")[0], SharedGather()) if share else None
        return AsyncColwiseParallel(input_layouts=Shard(1), float8=float8, strategy=strategy, shared_gather=gather)
    if kind == "rowwise":
        return AsyncRowwiseParallel(output_layouts=Shard(1), use_local_output=False, float8=float8, strategy=strategy)
    if kind == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    if kind in ("colwise_gather_output", "colwise_rep"):  # the head: gathered logits (older releases: _rep)
        return ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return None
