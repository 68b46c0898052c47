"""Rank-side cases for asynctp.integrations: Hugging Face's LlamaForCausalLM under its own tp_plan
made async, against the single-process model."""

from __future__ import annotations

import copy

import torch

from tests.cases_nn import _full, _mesh
from tests.cases_plans import counting_fused_gathers


def hf_llama_config():
    from transformers import LlamaConfig

    # heads, kv heads, ffn and sequence divide by 2
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def hf_llama_matches_single_process(device: str) -> dict[str, float]:
    """One forward/backward of the TP=R model equals the unsharded one: loss and every grad."""
    from transformers import LlamaForCausalLM

    from asynctp.integrations import hf

    torch.manual_seed(0)
    ref = LlamaForCausalLM(hf_llama_config()).to(device)
    model = hf.parallelize(copy.deepcopy(ref), _mesh(device))
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    with counting_fused_gathers() as calls:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
    ref_loss = ref(input_ids=tokens, labels=tokens).loss
    ref_loss.backward()
    loss_value = _full(loss).item()
    assert abs(loss_value - ref_loss.item()) <= 1e-5, (loss_value, ref_loss.item())
    params = dict(model.named_parameters())
    worst = 0.0
    for name, p_ref in ref.named_parameters():
        grad = _full(params[name].grad)
        torch.testing.assert_close(grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        worst = max(worst, (grad - p_ref.grad).abs().max().item())
    return dict(loss=loss_value, worst_grad_error=worst, fused_gathers=len(calls))


def torchtitan_dist_gemm_matches_unsharded(device: str, float8: str | None) -> dict[str, float]:
    """torchtitan 0.3's own fused FFN (AllGatherFusedFeedForward: AllGatherLinearMulti +
    LinearReduceScatter) and its AllGatherLinear (the QKV's) under asynctp.integrations.torchtitan,
    against torchtitan's stock FFN / a plain linear on the whole sequence: outputs and every grad.
    Returns the SQNR (dB) of each."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.models.common import dist_gemm
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear

    import asynctp.integrations.torchtitan as att

    rank, world = dist.get_rank(), dist.get_world_size()
    dim, hidden, batch, seq = 16, 32, 2, 8
    linear = lambda i, o: Linear.Config(in_features=i, out_features=o)  # noqa: E731
    fields = dict(w1=linear(dim, hidden), w2=linear(hidden, dim), w3=linear(dim, hidden))
    torch.manual_seed(0)
    ref = FeedForward.Config(**fields).build().to(device)
    fused = dist_gemm.AllGatherFusedFeedForward.Config(**fields).build().to(device)
    rows = slice(rank * hidden // world, (rank + 1) * hidden // world)
    with torch.no_grad():
        fused.w1.weight = torch.nn.Parameter(ref.w1.weight[rows].clone())
        fused.w3.weight = torch.nn.Parameter(ref.w3.weight[rows].clone())
        fused.w2.weight = torch.nn.Parameter(ref.w2.weight[:, rows].clone())
    x = torch.randn(batch, seq, dim, device=device, generator=torch.Generator().manual_seed(1))
    seq_rows = slice(rank * seq // world, (rank + 1) * seq // world)
    x_shard = x[:, seq_rows].clone().requires_grad_(True)
    x_ref = x.clone().requires_grad_(True)
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("tp",))
    att.enable(float8=float8)
    try:
        assert att.enabled()
        with set_current_spmd_mesh(mesh):
            out = fused(x_shard)
        out.square().sum().backward()
        group = mesh.get_group()
        x_rows = x_shard.detach().transpose(0, 1).reshape(-1, dim)  # sequence-major, as dist_gemm flattens
        bias = torch.arange(hidden // world, dtype=x.dtype, device=device)
        qkv = dist_gemm.AllGatherLinear.apply(x_rows, fused.w1.weight, bias, group, group.group_name)
    finally:
        att.disable()
    assert not att.enabled()
    out_ref = ref(x_ref)
    out_ref.square().sum().backward()
    qkv_ref = torch.nn.functional.linear(x.transpose(0, 1).reshape(-1, dim), ref.w1.weight[rows], bias)
    pairs = {
        "qkv": (qkv, qkv_ref), "out": (out, out_ref[:, seq_rows]), "dx": (x_shard.grad, x_ref.grad[:, seq_rows]),
        "w1": (fused.w1.weight.grad, ref.w1.weight.grad[rows]), "w3": (fused.w3.weight.grad, ref.w3.weight.grad[rows]),
        "w2": (fused.w2.weight.grad, ref.w2.weight.grad[:, rows]),
    }
    return {name: _sqnr(want.detach(), got.detach()) for name, (got, want) in pairs.items()}


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    noise = (ref - got).float().norm()
    return float("inf") if noise == 0 else (20 * torch.log10(ref.float().norm() / noise)).item()
