"""Rank-side cases for FSDP2 x TP: the demo's Llama on a (dp 2, tp 2) mesh, fully_shard over dp,
vanilla vs asynctp TP styles, eager and compiled: loss and gradients equal."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.cases_nn import _forward_backward, _test_config


def _two_d(model, mesh, asynchronous: bool, compiled: bool):
    from torch.distributed.fsdp import fully_shard

    from asynctp.demo.plan import parallelize

    parallelize(model, mesh["tp"], asynchronous)
    for i, block in enumerate(model.layers):
        if compiled:  # per block, as torchtitan compiles; aot_eager: dynamo and AOTAutograd trace
            # asynctp's ops (inductor's C++ compile of a 4-rank CPU model takes minutes on 2 cores)
            block = torch.compile(block, backend="aot_eager")
            model.layers[i] = block
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def fsdp_tp_matches_vanilla(device: str, compiled: bool) -> float:
    """Worst gradient difference between vanilla 2-D and asynctp 2-D after one step."""
    from torch.distributed.device_mesh import init_device_mesh

    from asynctp.demo.data import MarkovTokens
    from asynctp.demo.model import Transformer

    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = _test_config()
    torch.manual_seed(0)
    with torch.device(device):
        base = Transformer(cfg)
    dp_rank = mesh["dp"].get_local_rank()
    tokens = MarkovTokens(cfg.vocab_size, seed=3 + dp_rank).batch(cfg.batch_size, cfg.seq_len).to(device)
    results = []
    for asynchronous in (False, True):
        model = _two_d(copy.deepcopy(base), mesh, asynchronous, compiled)
        loss = torch.tensor(_forward_backward(model, tokens))
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        results.append((loss.item(), grads))
    (loss_v, grads_v), (loss_a, grads_a) = results
    assert abs(loss_v - loss_a) <= 1e-5, (loss_v, loss_a)
    assert grads_v.keys() == grads_a.keys() and grads_v
    worst = 0.0
    for name, g in grads_v.items():
        torch.testing.assert_close(grads_a[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        worst = max(worst, (grads_a[name] - g).abs().max().item())
    return worst
