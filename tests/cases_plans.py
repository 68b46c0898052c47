"""Rank-side cases for make_async: the classic parallelize_module plan shape on the demo's Llama,
made async, against the vanilla plan and the unsharded model (loss, grads, collective counts)."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from tests.cases_nn import _forward_backward, _full, _mesh, _test_config


def classic_plan(num_layers: int) -> dict[str, Any]:
    """torchtitan <= 0.2's apply_tp plan: the parent gathers, plain ColwiseParallel children."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(num_layers):
        block = f"layers.{i}"
        plan[f"{block}.attention_norm"] = SequenceParallel()
        plan[f"{block}.attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
        plan[f"{block}.ffn_norm"] = SequenceParallel()
        plan[f"{block}.feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"{block}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"{block}.{name}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


@contextlib.contextmanager
def counting_fused_gathers() -> Iterator[list[int]]:
    """Inside the block, every all_gather_linear call of an AsyncColwiseParallel appends to the list."""
    import asynctp.parallel.colwise as colwise

    calls: list[int] = []
    original = colwise.run_all_gather_linear

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    colwise.run_all_gather_linear = counting
    try:
        yield calls
    finally:
        colwise.run_all_gather_linear = original


def _fused_calls(model, tokens) -> tuple[float, int]:
    """(loss, all_gather_linear calls) over one forward + backward."""
    with counting_fused_gathers() as calls:
        loss = _forward_backward(model, tokens)
    return loss, len(calls)


def _dtensor_gathers(model, tokens) -> int:
    """All-gathers torch's DTensor issues in one forward (CommDebugMode's module hooks wrap every
    module input in a new tensor, which defeats SharedGather: counted on a separate forward)."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        model(tokens[:, :-1])
    return sum(n for op, n in comm.get_comm_counts().items() if "all_gather" in str(op))


def classic_plan_made_async(device: str) -> dict[str, Any]:
    """Vanilla classic plan vs make_async of it vs the unsharded model: loss and every grad."""
    from torch.distributed.tensor.parallel import parallelize_module

    from asynctp.demo.data import MarkovTokens
    from asynctp.demo.model import Transformer
    from asynctp.parallel import make_async

    cfg = _test_config()
    torch.manual_seed(0)
    with torch.device(device):
        ref = Transformer(cfg)
    plan = classic_plan(cfg.num_layers)
    vanilla = parallelize_module(copy.deepcopy(ref), _mesh(device), plan)
    fused_model = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = parallelize_module(fused_model, _mesh(device), make_async(plan, fused_model))
    tokens = MarkovTokens(cfg.vocab_size, seed=3).batch(cfg.batch_size, cfg.seq_len).to(device)
    loss_v, _ = _fused_calls(vanilla, tokens)
    loss_a, fused_calls = _fused_calls(fused, tokens)
    gathers_v, gathers_a = _dtensor_gathers(vanilla, tokens), _dtensor_gathers(fused, tokens)
    ref_loss = F.cross_entropy(ref(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    ref_loss.backward()
    assert abs(loss_a - ref_loss.item()) <= 1e-5 and abs(loss_v - ref_loss.item()) <= 1e-5, (loss_a, loss_v, ref_loss)
    params = dict(fused.named_parameters())
    for name, p_ref in ref.named_parameters():
        torch.testing.assert_close(_full(params[name].grad), p_ref.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    return dict(fused_calls=fused_calls, gathers_vanilla=gathers_v, gathers_async=gathers_a,
                warnings=[str(w.message) for w in caught])


def unconvertible_entries_warn_once(device: str) -> list[str]:
    """A non-sequence-parallel plan: every linear entry stays, all named in one warning."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from asynctp.parallel import make_async

    plan = {"a": ColwiseParallel(), "b": RowwiseParallel(), "c": RowwiseParallel(output_layouts=Replicate())}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = make_async(plan)
    assert all(out[k] is plan[k] for k in plan)
    return [str(w.message) for w in caught]


def replicated_input_warns(device: str) -> list[str]:
    """AsyncColwiseParallel under a parent that already gathers: correct, and it warns (once)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    from asynctp.parallel import AsyncColwiseParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4, bias=False))
    plan = {"": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
            "0": AsyncColwiseParallel(input_layouts=Shard(0))}
    model = parallelize_module(model, _mesh(device), plan)
    x = torch.arange(24.0, device=device).view(4, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x)
        model(x)
    return [str(w.message) for w in caught if "AsyncColwiseParallel" in str(w.message)]


def no_comm_run_after_vanilla_sends_nothing() -> list[str]:
    """The demo's no-communication baseline right after a vanilla run over the real group (the
    demo's order): the process group's collectives it issued (torch.profiler's "gloo:" ranges).
    A fake mesh equal to the real one (DeviceMesh equality ignores the group) reused DTensor's
    cached shardings of the real mesh and sent activations over the real group."""
    from torch.profiler import ProfilerActivity, profile

    from asynctp.demo.model import SIZES
    from asynctp.demo.train import VARIANTS, TrainSettings, train

    settings = TrainSettings(cfg=SIZES["tiny"], steps=2, dtype=torch.float32, lr=1e-3, warmup=1)
    mesh, device = _mesh("cpu"), torch.device("cpu")
    train(VARIANTS["vanilla"], settings, mesh, device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train(VARIANTS["no-comm"], settings, mesh, device)
    return sorted({e.name for e in prof.events() if e.name.startswith("gloo:")})


def no_comm_collectives_are_local() -> dict[str, Any]:
    """The no-communication baseline: inside local_collectives the functional collectives over the
    fake mesh give what this rank's data gives (every output written: torch 2.11's fake group left
    reduce-scatter outputs unwritten), one over the real group raises, and the override ends with
    the block; the baseline's parameters, split locally, equal vanilla's scattered ones, and its
    run trains on finite losses."""
    import torch.distributed._functional_collectives as funcol

    from asynctp.demo.model import SIZES
    from asynctp.demo.nocomm import fake_mesh, local_collectives
    from asynctp.demo.train import VARIANTS, TrainSettings, _build, train

    mesh = _mesh("cpu")
    fake = fake_mesh(mesh)
    group, rank = fake.get_group(), mesh.get_rank()
    x = torch.arange(8.0).view(4, 2) + 10 * rank
    out: dict[str, Any] = {}
    with local_collectives(fake):
        out["gathered"] = funcol.all_gather_tensor(x, 0, group).equal(torch.cat([x, x]))
        out["scattered"] = funcol.reduce_scatter_tensor(x, "sum", 0, group).equal(x.chunk(2)[rank])
        out["reduced"] = funcol.all_reduce(x, "sum", group).equal(x)
        try:
            funcol.all_reduce(x, "sum", mesh.get_group())
            out["real group"] = "no error"
        except RuntimeError as exc:
            out["real group"] = str(exc)
    out["real after"] = funcol.all_reduce(x, "sum", mesh.get_group()).equal(2 * torch.arange(8.0).view(4, 2) + 10)
    settings = TrainSettings(cfg=SIZES["tiny"], steps=3, dtype=torch.float32, lr=1e-3, warmup=1)
    shards = [{n: p.to_local() for n, p in _build(VARIANTS[v], settings, mesh, torch.device("cpu")).named_parameters()}
              for v in ("vanilla", "no-comm")]
    out["same shards"] = shards[0].keys() == shards[1].keys() and all(shards[0][n].equal(shards[1][n]) for n in shards[0])
    losses = train(VARIANTS["no-comm"], settings, mesh, torch.device("cpu")).losses
    out["finite"] = all(torch.isfinite(torch.tensor(losses)).tolist())
    return out
