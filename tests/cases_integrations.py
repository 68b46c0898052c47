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
