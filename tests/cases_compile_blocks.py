"""Rank-side case for the compile pass on the classic plan compiled per block (as torchtitan
compiles): the demo's Llama with torchtitan <= 0.2's plan (the parent gathers once for wq / wk /
wv and for w1 / w3, so backward reduce-scatters the SUM of their input gradients), the
embedding's style from make_async (its output waited), each block compiled with and without
asynctp's pass: loss and gradients equal, and the fusion counts."""

from __future__ import annotations

import copy
from typing import Any

import torch

from asynctp.compile import fresh_compiles


def _classic_model(base: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    from asynctp.parallel import WaitedRowwiseParallel
    from tests.cases_plans import classic_plan

    model = copy.deepcopy(base)
    plan = classic_plan(len(model.layers))
    old = plan["tok_embeddings"]
    plan["tok_embeddings"] = WaitedRowwiseParallel(input_layouts=old.input_layouts[0], output_layouts=old.output_layouts[0])
    parallelize_module(model, mesh, plan)
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block)
    return model


def per_block_classic_matches(device: str) -> dict[str, Any]:
    """Rank body: per-block compiled with the pass against without it; returns the report's counts
    and the worst gradient difference relative to the gradient's magnitude."""
    import torch._dynamo

    import asynctp.compile
    from asynctp.demo.data import MarkovTokens
    from asynctp.demo.model import Transformer
    from tests.cases_nn import _forward_backward, _full, _mesh, _test_config

    cfg = _test_config()
    torch.manual_seed(0)
    with torch.device(device):
        base = Transformer(cfg)
    tokens = MarkovTokens(cfg.vocab_size, seed=3).batch(cfg.batch_size, cfg.seq_len).to(device)
    mesh = _mesh(device)
    results = []
    with fresh_compiles():
        for context in (None, asynctp.compile.enabled(fail_if_unfused=True)):
            torch._dynamo.reset()
            asynctp.compile.fusion_report(clear=True)
            model = _classic_model(base, mesh)
            if context is None:
                loss = _forward_backward(model, tokens)
            else:
                with context:
                    loss = _forward_backward(model, tokens)
            results.append((loss, {n: _full(p.grad).clone() for n, p in model.named_parameters()}))
        torch._dynamo.reset()
    report = asynctp.compile.fusion_report(clear=True)
    (plain_loss, plain), (fused_loss, fused) = results
    rel = {n: ((fused[n] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item() for n, ref in plain.items()}
    return {
        "loss_diff": abs(plain_loss - fused_loss), "max_rel": max(rel.values()), "params": len(rel),
        "graphs": [g.kind for g in report.graphs], "collectives": len(report.records),
        "ag": report.count("asynctp.all_gather_matmul"), "rs": report.count("asynctp.matmul_reduce_scatter"),
        "summed": sorted(r.num_matmuls for r in report.fused if r.kind == "reduce-scatter" and r.num_matmuls > 1),
        "unfused": [r.describe() for r in report.unfused], "text": str(report),
    }
