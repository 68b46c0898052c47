"""Hugging Face transformers: a model's own tp_plan, made async and sequence-parallel.

    model = LlamaForCausalLM(config)
    asynctp.integrations.hf.parallelize(model, mesh)      # mesh: 1-D, the TP ranks
    loss = model(input_ids=tokens, labels=tokens).loss

The plan is make_async(model.tp_plan, model) (see asynctp.parallel.hf_plan for the layout).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from asynctp.parallel import make_async

__all__ = ["parallelize"]


def parallelize(model: nn.Module, mesh: DeviceMesh, *, float8: Any = None, strategy: str = "auto") -> nn.Module:
    """Shard `model` (a transformers PreTrainedModel with a tp_plan) in place over the 1-D mesh."""
    plan = getattr(model, "tp_plan", None)
    if not plan:
        raise ValueError(f"parallelize requires a transformers model with a tp_plan, got {type(model).__name__} without one")
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field, None)
        if value is not None and value % mesh.size():
            raise ValueError(f"parallelize requires config.{field} divisible by the TP size {mesh.size()}, got {value}")
    return parallelize_module(model, mesh, make_async(dict(plan), model, float8=float8, strategy=strategy))
