"""Rank-side test bodies for the training layer (asynctp.nn, asynctp.parallel, the demo model),
shared by tests/dist (gloo, cpu backend) and tests/gpu (nccl, cuda backend).

The autograd functions are checked exactly: small-integer inputs, a float64 serial reference
built on every rank from seeds (every rank can build every rank's shards), atol=0. The parallel
styles are checked on the demo's tiny Llama against one unsharded process (float32, tolerances).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from asynctp import all_gather_linear, linear_reduce_scatter
from tests.cases import DTYPES, expect_errors, ints, under_env, world

# ---------------------------------------------------------------- autograd functions, exact


def _col_case(device, dtype, gather_dim, num_weights, with_bias, save, seed, strategy="auto"):
    """all_gather_linear forward and backward against the float64 serial reference."""
    rank, ws = world()
    k = 4 * ws
    shard_shape = [2, 3, k]
    if gather_dim == 2:
        shard_shape[2] = k // ws
    shards = [ints(shard_shape, seed * 100 + r, dtype, device) for r in range(ws)]
    # every rank's weights: rank p holds weights[p][i] of shape (N_i, K)
    weights = [[ints((3 + 2 * i, k), seed * 100 + 20 + 10 * p + i, dtype, device) for i in range(num_weights)] for p in range(ws)]
    biases = [[ints((w.shape[0],), seed * 100 + 60 + 10 * p + i, dtype, device) if with_bias else None
               for i, w in enumerate(weights[p])] for p in range(ws)]
    x_full = torch.cat(shards, dim=gather_dim)
    grads_out = [[ints(x_full.shape[:-1] + (w.shape[0],), seed * 100 + 90 + 10 * p + i, dtype, device)
                  for i, w in enumerate(weights[p])] for p in range(ws)]

    x_shard = shards[rank].clone().requires_grad_()
    my_w = [w.clone().requires_grad_() for w in weights[rank]]
    my_b = [b.clone().requires_grad_() if b is not None else None for b in biases[rank]]
    outs = all_gather_linear(
        x_shard, my_w if num_weights > 1 else my_w[0], my_b if num_weights > 1 else my_b[0],
        group=dist.group.WORLD, gather_dim=gather_dim, save_gathered_input=save, strategy=strategy,
    )
    outs = outs if num_weights > 1 else [outs]
    torch.autograd.backward(outs, grads_out[rank])

    x_ref = x_full.double()
    label = f"col dim={gather_dim} n={num_weights} bias={with_bias} save={save} {dtype}"
    for i, (o, w, b) in enumerate(zip(outs, weights[rank], biases[rank])):
        ref = F.linear(x_ref, w.double(), b.double() if b is not None else None).to(dtype)
        assert torch.equal(o, ref), f"{label}: out {i}"
    grad_x_full = sum(g.double() @ w.double() for p in range(ws) for g, w in zip(grads_out[p], weights[p]))
    grad_x_ref = grad_x_full.chunk(ws, dim=gather_dim)[rank].to(dtype)
    assert torch.equal(x_shard.grad, grad_x_ref), f"{label}: grad x, max diff {(x_shard.grad.double() - grad_x_ref.double()).abs().max()}"
    x_2d = x_ref.reshape(-1, x_ref.shape[-1])
    for i, (w, b, g) in enumerate(zip(my_w, my_b, grads_out[rank])):
        g_2d = g.double().reshape(-1, g.shape[-1])
        assert torch.equal(w.grad, (g_2d.t() @ x_2d).to(dtype)), f"{label}: grad weight {i}"
        if b is not None:
            assert torch.equal(b.grad, g_2d.sum(0).to(dtype)), f"{label}: grad bias {i}"


def contract_cases(device: str, dtype_name: str = "float32") -> int:
    """all_gather_contract (the re-gathering wgrad) against g^T @ x_gathered, exactly, for
    gather dims 0 and 1, both row orders (batch-major forced, and by default at long runs), every
    strategy, two grads sharing the gather; results contiguous [N_i, K]. bfloat16 (CUDA): exact
    too, the float32 sums rounded once (a bf16 partial per block would round twice)."""
    from asynctp.ops.all_gather_matmul import all_gather_contract
    rank, ws = world()
    count = 0
    for shape, dim, env in (((3, 2, 8), 0, {}), ((2, 3, 8), 1, {}), ((2, 3, 8), 1, {"ASYNCTP_BATCH_MAJOR": "1"}),
                            ((2, 512, 8), 1, {})):
        for strategy in ("pipeline", "serial", "ring"):
            dtype = DTYPES[dtype_name]
            shards = [ints(shape, count * 10 + r, dtype, device) for r in range(ws)]
            x_full = torch.cat(shards, dim=dim)
            gs = [ints((*x_full.shape[:-1], n), count * 10 + 7 + n, dtype, device) for n in (5, 3)]
            got = under_env(env, all_gather_contract, shards[rank], gs, dim, dist.group.WORLD, strategy)
            for g, o in zip(gs, got):
                ref = (g.double().reshape(-1, g.shape[-1]).t() @ x_full.double().reshape(-1, shape[-1])).to(dtype)
                label = f"contract {shape} dim={dim} {env} {strategy}"
                assert torch.equal(o, ref), f"{label}: max diff {(o - ref).abs().max()}"
                assert o.is_contiguous(), f"{label}: strides {o.stride()}"
            count += 1
    return count


def compiled_regather_matches_eager(device: str) -> int:
    """all_gather_linear with save_gathered_input=False under torch.compile: the backward's wgrad
    goes through torch.ops.asynctp.all_gather_contract and equals eager's grads exactly."""
    rank, ws = world()
    x_full = ints((2, 3 * ws, 8), 3, torch.float32, device)
    weights = [ints((n, 8), 4 + n, torch.float32, device) for n in (5, 6)]
    grads = [ints((2, 3 * ws, n), 20 + n, torch.float32, device) for n in (5, 6)]

    def step(x, w1, w2):
        o1, o2 = all_gather_linear(x, [w1, w2], group=dist.group.WORLD, gather_dim=1, save_gathered_input=False)
        return (o1 * grads[0]).sum() + (o2 * grads[1]).sum()

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        x = x_full.chunk(ws, dim=1)[rank].clone().requires_grad_()
        ws_ = [w.clone().requires_grad_() for w in weights]
        fn(x, *ws_).backward()
        results.append([x.grad, *(w.grad for w in ws_)])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled), f"max diff {(eager - compiled).abs().max()}"
    return len(results[0])


def _row_case(device, dtype, scatter_dim, with_bias, seed, strategy="auto"):
    """linear_reduce_scatter forward and backward against the float64 serial reference."""
    rank, ws = world()
    k, n = 4, 3 * ws
    shape = [2, 3, k]
    if scatter_dim != 2:
        shape[scatter_dim] *= ws
    xs = [ints(shape, seed * 100 + r, dtype, device) for r in range(ws)]
    ws_ = [ints((n, k), seed * 100 + 20 + r, dtype, device) for r in range(ws)]
    bias = ints((n,), seed * 100 + 50, dtype, device) if with_bias else None
    y_full = sum(x.double() @ w.double().t() for x, w in zip(xs, ws_))
    chunk_shape = list(y_full.chunk(ws, dim=scatter_dim)[0].shape)
    grads = [ints(chunk_shape, seed * 100 + 70 + r, dtype, device) for r in range(ws)]

    x = xs[rank].clone().requires_grad_()
    w = ws_[rank].clone().requires_grad_()
    b = bias.clone().requires_grad_() if with_bias else None
    out = linear_reduce_scatter(x, w, b, group=dist.group.WORLD, scatter_dim=scatter_dim, strategy=strategy)
    out.backward(grads[rank])

    label = f"row dim={scatter_dim} bias={with_bias} {dtype}"
    ref = y_full.chunk(ws, dim=scatter_dim)[rank]
    if with_bias:
        ref = ref + (bias.double().chunk(ws)[rank] if scatter_dim == 2 else bias.double())
    assert torch.equal(out, ref.to(dtype)), f"{label}: out"
    g_full = torch.cat([g.double() for g in grads], dim=scatter_dim)
    assert torch.equal(x.grad, (g_full @ w.double()).to(dtype)), f"{label}: grad x"
    g_2d = g_full.reshape(-1, n)
    assert torch.equal(w.grad, (g_2d.t() @ x.double().reshape(-1, k)).to(dtype)), f"{label}: grad weight"
    if with_bias:
        assert torch.equal(b.grad, g_2d.sum(0).to(dtype)), f"{label}: grad bias"


def linear_grid(device: str, dtype_name: str, strategy: str = "auto") -> int:
    """Every gather/scatter dim of a 3-D input, one and several weights, bias or not."""
    dtype = DTYPES[dtype_name]
    count = 0
    for dim in (0, 1, 2):
        for num_weights, with_bias, save in ((1, False, False), (3, True, False), (2, True, True), (1, True, True)):
            _col_case(device, dtype, dim, num_weights, with_bias, save, seed=count, strategy=strategy)
            count += 1
        for with_bias in (False, True):
            _row_case(device, dtype, dim, with_bias, seed=count, strategy=strategy)
            count += 1
    return count


def two_layers_in_a_row(device: str, save_gathered_input: bool) -> None:
    """col -> relu -> row -> col -> relu -> row, twice with other data: every grad equals the
    serial reference, so nothing saved for backward pointed into a reused workspace."""
    rank, ws = world()
    dtype = torch.float32
    d, h = 4, 2 * ws  # model dim, hidden per rank
    full_w = [ints((h * ws, d), 11, dtype, device), ints((d, h * ws), 12, dtype, device),
              ints((h * ws, d), 13, dtype, device), ints((d, h * ws), 14, dtype, device)]
    local_w = [full_w[0].chunk(ws, 0)[rank], full_w[1].chunk(ws, 1)[rank],
               full_w[2].chunk(ws, 0)[rank], full_w[3].chunk(ws, 1)[rank]]
    params = [w.clone().requires_grad_() for w in local_w]
    ref_params = [w.double().requires_grad_() for w in full_w]
    g = dist.group.WORLD
    for trial in range(2):
        x_full = ints((2, 3 * ws, d), 100 + trial, dtype, device, low=-1, high=2)
        x_shard = x_full.chunk(ws, 1)[rank].clone().requires_grad_()
        y = x_shard
        for i in (0, 2):
            hidden = all_gather_linear(y, params[i], group=g, gather_dim=1, save_gathered_input=save_gathered_input)
            y = linear_reduce_scatter(torch.relu(hidden), params[i + 1], group=g, scatter_dim=1)
        y_grad = ints(y.shape, 200 + trial + rank, dtype, device, low=-1, high=2)
        y.backward(y_grad)

        x_ref = x_full.double().requires_grad_()
        y_ref = x_ref
        for i in (0, 2):
            y_ref = F.linear(torch.relu(F.linear(y_ref, ref_params[i])), ref_params[i + 1])
        grad_full = torch.cat([ints(y.shape, 200 + trial + p, dtype, device, low=-1, high=2) for p in range(ws)], 1)
        y_ref.backward(grad_full.double())
        assert torch.equal(y, y_ref.chunk(ws, 1)[rank].to(dtype)), f"trial {trial}: output"
        assert torch.equal(x_shard.grad, x_ref.grad.chunk(ws, 1)[rank].to(dtype)), f"trial {trial}: grad x"
        for i, (p, r) in enumerate(zip(params, ref_params)):
            ref_grad = r.grad.chunk(ws, 0 if i % 2 == 0 else 1)[rank].to(dtype)
            assert torch.equal(p.grad, ref_grad), f"trial {trial}: grad of weight {i}"
        for p in params + ref_params:
            p.grad = None


def bad_linear_inputs(device: str) -> list[str]:

    rank, ws = world()
    g = dist.group.WORLD
    x = ints((2, 3, 8), rank, torch.float32, device)
    w = ints((5, 8), 1, torch.float32, device)
    cases = [
        (ValueError, "weight[0] requires an nn.Linear weight of shape (N, 8)", lambda: all_gather_linear(x, w.t(), group=g)),
        (ValueError, "bias[1] requires shape (5,)", lambda: all_gather_linear(x, [w, w], [None, w[0]], group=g)),
        (ValueError, "bias requires one entry per weight (2)", lambda: all_gather_linear(x, [w, w], [None], group=g)),
        (ValueError, "gather_dim requires a dim in [-3, 2]", lambda: all_gather_linear(x, w, group=g, gather_dim=3)),
        (ValueError, "x_shard requires a tensor with at least 2 dims", lambda: all_gather_linear(x[0, 0], w, group=g)),
        (TypeError, "save_gathered_input requires a bool", lambda: all_gather_linear(x, w, group=g, save_gathered_input=1)),
        (ValueError, "weight requires an nn.Linear weight of shape (N, 8)", lambda: linear_reduce_scatter(x, w.t(), group=g)),
        (ValueError, f"requires a size divisible by the world size {ws}", lambda: linear_reduce_scatter(x[:1], w, group=g)),
        (ValueError, "bias requires shape (5,)", lambda: linear_reduce_scatter(x, w, w[0, :4], group=g, scatter_dim=1)),
        (TypeError, "ProcessGroup or its name", lambda: all_gather_linear(x, w, group=3)),
    ]
    messages = expect_errors(cases)
    return messages


# ---------------------------------------------------------------- parallel styles on the demo model


def _test_config():
    from asynctp.demo.model import ModelConfig

    # head, kv-head, ffn, vocab and sequence counts divide by 2 and by 3
    return ModelConfig(dim=48, num_layers=2, num_heads=12, num_kv_heads=6, ffn_dim=96, vocab_size=48, seq_len=12, batch_size=2)


def _mesh(device: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (dist.get_world_size(),))


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def styles_match_single_process(device: str, asynchronous: bool, share_gathers: bool = True) -> int:
    """One forward/backward of the sharded model equals the unsharded model: loss and every grad."""
    import copy

    from asynctp.demo.data import MarkovTokens
    from asynctp.demo.model import Transformer
    from asynctp.demo.plan import parallelize

    cfg = _test_config()
    torch.manual_seed(0)
    with torch.device(device):
        ref = Transformer(cfg)
    model = parallelize(copy.deepcopy(ref), _mesh(device), asynchronous, share_gathers=share_gathers)
    tokens = MarkovTokens(cfg.vocab_size, seed=3).batch(cfg.batch_size, cfg.seq_len).to(device)
    loss = _forward_backward(model, tokens)
    ref_loss = F.cross_entropy(ref(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= 1e-5, f"loss {loss} vs {ref_loss.item()}"
    count = 0
    params = dict(model.named_parameters())
    for name, p_ref in ref.named_parameters():
        grad = _full(params[name].grad)
        torch.testing.assert_close(grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        count += 1
    return count


def bf16_grads_track_float32(device: str, batch: int) -> dict[str, float]:
    """One bf16 step of a one-layer model with 128-wide heads (the fused attention kernels' size)
    under the vanilla and the async plans: each gradient's relative error against the unsharded
    float32 model. The async plan's outputs once had a batch stride smaller than the sequence
    stride (batch > 1), and cuDNN's bf16 attention backward returned wrong gradients from them
    (relative error ~1.5 against ~0.02 for vanilla); returns the worst error per plan."""
    import copy

    from asynctp.demo.data import MarkovTokens
    from asynctp.demo.model import ModelConfig, Transformer
    from asynctp.demo.plan import parallelize

    cfg = ModelConfig(dim=1024, num_layers=1, num_heads=8, num_kv_heads=2, ffn_dim=2816, vocab_size=4096,
                      seq_len=1024, batch_size=batch)
    tokens = MarkovTokens(cfg.vocab_size, seed=1).batch(batch, cfg.seq_len).to(device)
    torch.manual_seed(0)
    with torch.device(device):
        ref = Transformer(cfg)
    base = copy.deepcopy(ref)
    loss = F.cross_entropy(ref(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    worst = {}
    for name, asynchronous in (("vanilla", False), ("async", True)):
        model = parallelize(copy.deepcopy(base).to(torch.bfloat16), _mesh(device), asynchronous)
        _forward_backward(model, tokens)
        params = dict(model.named_parameters())
        worst[name] = max(
            ((_full(params[n].grad).float() - p.grad).norm() / p.grad.norm()).item() for n, p in ref.named_parameters()
        )
    return worst


def _forward_backward(model, tokens) -> float:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    logits = model(tokens[:, :-1])
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()


def loss_curves(
    device: str, steps: int, dtype_name: str = "float32", float8: str | None = None, lr: float = 1e-2
) -> tuple[list[float], list[float]]:
    """Training with the vanilla plan, then the async plan, same seed and data (the demo's loop)."""
    from asynctp.demo.train import VARIANTS, TrainSettings, train

    cfg = _test_config()
    if float8 is not None:  # fp8 GEMMs want multiples of 16 per rank
        cfg = dataclasses.replace(cfg, dim=192, ffn_dim=384, vocab_size=96)
    settings = TrainSettings(cfg=cfg, steps=steps, dtype=DTYPES[dtype_name], lr=lr, float8=float8)
    mesh = _mesh(device)
    vanilla = train(VARIANTS["vanilla"], settings, mesh, torch.device(device))
    fused = train(VARIANTS["asynctp"], settings, mesh, torch.device(device))
    return vanilla.losses, fused.losses


def bad_plans(device: str) -> list[str]:
    """Plans the async styles cannot serve fail at parallelize time, with the fix in the message."""
    import pytest
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from asynctp.demo.plan import tp_plan
    from asynctp.parallel import AsyncColwiseParallel, AsyncRowwiseParallel

    mesh = _mesh(device)
    mesh_2d = init_device_mesh(device, (1, dist.get_world_size()))

    def lin():
        return nn.Linear(8, 6 * dist.get_world_size())

    cases = [
        ("input_layouts=Shard(d)", lambda: parallelize_module(lin(), mesh, AsyncColwiseParallel())),
        ("output_layouts=Shard(-1)", lambda: parallelize_module(lin(), mesh, AsyncColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))),
        ("output_layouts=Shard(d)", lambda: parallelize_module(lin(), mesh, AsyncRowwiseParallel())),
        ("requires an nn.Linear module, got Embedding", lambda: parallelize_module(nn.Embedding(12, 4), mesh, AsyncRowwiseParallel(output_layouts=Shard(1)))),
        ("requires a 1-D DeviceMesh", lambda: parallelize_module(lin(), mesh_2d, AsyncColwiseParallel(input_layouts=Shard(1)))),
        ("no-such-recipe", lambda: parallelize_module(lin(), mesh, AsyncColwiseParallel(input_layouts=Shard(1), float8="no-such-recipe"))),
        ("save_gathered_input=False with float8", lambda: parallelize_module(lin(), mesh, AsyncColwiseParallel(input_layouts=Shard(1), float8="rowwise", save_gathered_input=True))),
        ("vanilla plan requires float8=None", lambda: tp_plan(2, asynchronous=False, float8="rowwise")),
    ]
    messages = []
    for text, call in cases:
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        assert text in str(info.value), f"expected {text!r} in {str(info.value)!r}"
        messages.append(str(info.value))
    return messages


# ---------------------------------------------------------------- float8


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - got).pow(2).mean().clamp(min=1e-30)))


def float8_linears(device: str, recipe: str, dtype_name: str) -> dict[str, float]:
    """Both linears with an fp8 recipe vs the same calls in high precision: outputs and grads
    by signal-to-noise ratio (dB); returns the lowest per tensor."""
    rank, ws = world()
    dtype = DTYPES[dtype_name]
    g = dist.group.WORLD
    worst: dict[str, float] = {}
    for dim in (0, 1, 2):
        gen = torch.Generator().manual_seed(10 * dim + rank)
        k = 16 * ws  # fp8 GEMMs want K and N multiples of 16, also per rank when gathering K
        shape = [2, 4, k] if dim != 2 else [2, 4, k // ws]
        if dim != 2:
            shape[dim] *= 2
        x_hp = torch.randn(shape, generator=gen).to(dtype).to(device)
        w1 = (torch.randn(3 * 16, k, generator=gen) / 8).to(dtype).to(device)
        w2 = (torch.randn(16, k, generator=gen) / 8).to(dtype).to(device)
        b1 = torch.randn(48, generator=gen).to(dtype).to(device)
        w_row = (torch.randn(16 * ws, 48, generator=gen) / 8).to(dtype).to(device)
        b_row = torch.randn(16 * ws, generator=gen).to(dtype).to(device)
        results = {}
        for float8 in (None, recipe):
            leaves = [t.clone().requires_grad_() for t in (x_hp, w1, w2, b1, w_row, b_row)]
            x, a, c, b, wr, br = leaves
            h1, h2 = all_gather_linear(x, [a, c], [b, None], group=g, gather_dim=dim, float8=float8)
            y = linear_reduce_scatter(h1 * torch.sigmoid(h1), wr, br, group=g, scatter_dim=dim, float8=float8)
            loss = (y.float() ** 2).sum() + h2.float().sum()
            loss.backward()
            results[float8] = [y.detach()] + [t.grad for t in leaves]
        names = ["out", "grad_x", "grad_w1", "grad_w2", "grad_b1", "grad_w_row", "grad_b_row"]
        for name, ref, got in zip(names, results[None], results[recipe]):
            assert got.dtype == ref.dtype and got.shape == ref.shape, name
            worst[name] = min(worst.get(name, 1e9), _sqnr(ref, got))
    return worst


def gather_calls_per_forward(device: str, share_gathers: bool) -> int:
    """How many all_gather_linear calls one forward of the async plan makes."""
    from asynctp.demo.data import MarkovTokens
    from asynctp.demo.model import Transformer
    from asynctp.demo.plan import parallelize
    from tests.cases_plans import counting_fused_gathers

    cfg = _test_config()
    torch.manual_seed(0)
    with torch.device(device):
        model = parallelize(Transformer(cfg), _mesh(device), True, share_gathers=share_gathers)
    with counting_fused_gathers() as calls:
        tokens = MarkovTokens(cfg.vocab_size).batch(cfg.batch_size, cfg.seq_len).to(device)
        _forward_backward(model, tokens)
    return len(calls)


def compiled_styles_share_gathers(device: str) -> int:
    """The async plan with shared gathers under torch.compile(fullgraph=True): no graph break, the
    same loss and grads as the unsharded model, and at run time exactly the fused calls eager
    makes (wq / wk / wv and w1 / w3 share one gather each; before, compiled members each gathered
    for themselves and the small ones ran serially). Returns the gather calls of one step."""
    import copy
    import sys

    import torch._dynamo

    from asynctp.demo.data import MarkovTokens
    from asynctp.demo.model import Transformer
    from asynctp.demo.plan import parallelize

    module = sys.modules["asynctp.ops.all_gather_matmul"]  # the package re-exports a function of that name
    cfg = _test_config()
    torch.manual_seed(0)
    with torch.device(device):
        ref = Transformer(cfg)
    tokens = MarkovTokens(cfg.vocab_size, seed=3).batch(cfg.batch_size, cfg.seq_len).to(device)
    ref_loss = F.cross_entropy(ref(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    ref_loss.backward()
    counts = {}
    original = module._run
    for mode in ("eager", "compiled"):
        model = parallelize(copy.deepcopy(ref), _mesh(device), True, share_gathers=True)
        model.zero_grad(set_to_none=True)
        calls = []

        def counting(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        torch._dynamo.reset()
        run = torch.compile(model, fullgraph=True) if mode == "compiled" else model
        module._run = counting
        try:
            loss = _forward_backward(run, tokens)
        finally:
            module._run = original
        counts[mode] = len(calls)
        assert abs(loss - ref_loss.item()) <= 1e-5, f"{mode}: loss {loss} vs {ref_loss.item()}"
        params = dict(model.named_parameters())
        for name, p_ref in ref.named_parameters():
            torch.testing.assert_close(_full(params[name].grad), p_ref.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{mode} {name}: {m}")
    assert counts["compiled"] == counts["eager"], counts
    return counts["compiled"]


def shared_gather_misuse(device: str) -> str:
    import pytest
    from torch import nn
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from asynctp.parallel import AsyncColwiseParallel, SharedGather

    mesh, shared = _mesh(device), SharedGather()
    ws = dist.get_world_size()
    parallelize_module(nn.Linear(8, 2 * ws), mesh, AsyncColwiseParallel(input_layouts=Shard(1), shared_gather=shared))
    with pytest.raises(ValueError, match="one in_features") as info:
        parallelize_module(nn.Linear(4, 2 * ws), mesh, AsyncColwiseParallel(input_layouts=Shard(1), shared_gather=shared))
    with pytest.raises(ValueError, match="the same input_layouts"):
        parallelize_module(nn.Linear(8, 2 * ws), mesh, AsyncColwiseParallel(input_layouts=Shard(0), shared_gather=shared))
    with pytest.raises(TypeError, match="SharedGather"):
        AsyncColwiseParallel(input_layouts=Shard(1), shared_gather=object())
    return str(info.value)


def float8_training_paths_agree(device: str, recipe: str, steps: int = 8) -> dict[str, dict[str, int]]:
    """fp8 training with asynctp's styles (pipelined) three ways: CUDA graphs + the Triton
    quantization kernels (the default), graphs off (ASYNCTP_GRAPHS=0), torch-op quantization
    (asynctp.float8.quantize.torch_formulas). The loss curves must be identical: replays, kept quantization
    buffers and the kernels change where work runs, not what it computes. With graphs on, the
    last step must replay nearly every pipelined call (the fp8 operands live in buffers the
    modules keep, so their addresses recur; high-precision operands such as the wgrad's gathered
    activations come from the caching allocator, whose addresses may still shift once after the
    captures: at most one call in ten may be captured or eager). Returns each run's last-step
    graph counts."""
    from asynctp.demo.train import TrainSettings, Variant, train

    cfg = dataclasses.replace(_test_config(), dim=192, ffn_dim=384, vocab_size=96)
    settings = TrainSettings(cfg=cfg, steps=steps, dtype=torch.bfloat16, lr=1e-3, float8=recipe)
    variant = Variant("asynctp pipelined", asynchronous=True, strategy="pipeline")
    runs: dict[str, Any] = {}
    from asynctp.float8.quantize import torch_formulas

    def torch_quantization(*args):
        with torch_formulas():
            return train(*args)

    for name, env, run in (("default", {}, train), ("no graphs", {"ASYNCTP_GRAPHS": "0"}, train),
                           ("torch quantization", {}, torch_quantization)):
        runs[name] = under_env(env, run, variant, settings, _mesh(device), torch.device(device))
    reference = runs["default"].losses
    for name, run in runs.items():
        assert run.losses == reference, f"{name}: losses {run.losses} vs default {reference}"
    last = runs["default"].graph_calls_last_step
    calls = last["eager"] + last["captured"] + last["replayed"]  # the other entries break these down or count
    # graphs and moved inputs (graphs.stats)
    assert last["replayed"] >= 0.9 * calls > 0, f"last step's pipelined calls: {last}"
    assert runs["no graphs"].graph_calls["replayed"] == 0
    return {name: run.graph_calls_last_step for name, run in runs.items()}
