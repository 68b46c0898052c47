"""Graph builders and rank-side bodies for the torch.compile pass tests.

Single-process graph tests trace small functions with make_fx (fake tensors) over a "fake"
process group, so the functional collectives appear exactly as in a post-grad graph, and run
asynctp's rewrite on the traced graph. The rank-side bodies (tests/dist, tests/gpu) compile a
tiny sequence-parallel block built with DTensor's ColwiseParallel / RowwiseParallel, with and
without the pass, and compare loss and gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from asynctp.compile import fresh_compiles

FAKE_WORLD = 2


@contextlib.contextmanager
def fake_group(world_size: int = FAKE_WORLD) -> Iterator[dist.ProcessGroup]:
    """A one-process "fake" group of `world_size` ranks (collectives are no-ops)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_group requires no default process group, got one already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _funcol(new: str, old: str) -> Callable[..., Any]:
    """The functional collective under its current name (torch renamed them; the old names warn)."""
    import torch.distributed._functional_collectives as funcol

    return getattr(funcol, new, None) or getattr(funcol, old)


def gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _funcol("all_gather_single", "all_gather_tensor")(x, dim, dist.group.WORLD)


def reduce_scatter(x: torch.Tensor, dim: int, op: str = "sum") -> torch.Tensor:
    return _funcol("reduce_scatter_single", "reduce_scatter_tensor")(x, op, dim, dist.group.WORLD)


def trace(fn: Callable[..., Any], *shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> fx.GraphModule:
    """fn traced with fake tensors of the given shapes (meta["val"] on every node)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    args = [torch.randn(s).to(dtype) for s in shapes]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    # inductor removes these no-ops before its post-grad passes; so do we
    for node in list(gm.graph.nodes):
        if node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    return gm


def targets(gm: fx.GraphModule) -> list[str]:
    """The call_function targets of the graph, as strings (e.g. "asynctp.all_gather_matmul.default")."""
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def nodes_of(gm: fx.GraphModule, name: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == name]


def output_shapes(gm: fx.GraphModule) -> list[tuple[int, ...] | None]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = []
    for arg in fx.node.map_arg(out.args[0], lambda n: n) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]:
        val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        vals.append(tuple(val.shape) if isinstance(val, torch.Tensor) else None)
    return vals


RS_OP = "asynctp.matmul_reduce_scatter.default"  # node targets as targets() names them
C10D_RS = "_c10d_functional.reduce_scatter_tensor.default"


@pytest.fixture(scope="module")
def fake_world() -> Iterator[dist.ProcessGroup]:
    """fake_group() for a whole test module (request it with pytest.mark.usefixtures)."""
    with fake_group(FAKE_WORLD) as group:
        yield group


def rewrite(fn: Callable[..., Any], *shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> tuple[fx.GraphModule, list[Any]]:
    """fn traced, then rewritten by asynctp's pass (in place); the outputs keep their shapes."""
    from asynctp.compile.rewrite import rewrite_graph

    gm = trace(fn, *shapes, dtype=dtype)
    before = output_shapes(gm)
    records = rewrite_graph(gm.graph)
    gm.recompile()
    assert output_shapes(gm) == before  # same outputs, same shapes
    return gm, records


# --- rank side: a tiny sequence-parallel block under DTensor styles -----------------------------


class TinyBlock(nn.Module):
    """Llama-style block without norms: causal attention (fused-gather consumers q, k, v) and a
    SwiGLU-like MLP (w1, w3), with two row-parallel outputs (wo, w2)."""

    def __init__(self, dim: int = 8, hidden: int = 16, num_heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=True)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, S, D] (gathered by the column-parallel q, k, v); heads: this rank's share
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s, local = q.shape
        q, k, v = (t.view(b, s, local // self.head_dim, self.head_dim).transpose(1, 2) for t in (q, k, v))
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(x)
        return h + self.w2(torch.relu(self.w1(h)) * self.w3(h))


def _ints(shape: tuple[int, ...], seed: int, low: int = -1, high: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).float()


def build_block(device: str, seed: int = 0) -> nn.Module:
    """TinyBlock with small-integer weights (heads split over ranks), parallelized with vanilla
    DTensor styles and sequence parallelism on dim 1 (local input and output [B, S / R, D])."""
    world = dist.get_world_size()
    block = TinyBlock(dim=4 * world, hidden=8 * world, num_heads=2 * world)
    with torch.no_grad():
        for i, p in enumerate(block.parameters()):
            p.copy_(_ints(tuple(p.shape), seed * 100 + i))
    return _parallelize(block.to(device), device)


def _parallelize(block: nn.Module, device: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    col = ColwiseParallel(input_layouts=Shard(1))
    row = RowwiseParallel(output_layouts=Shard(1))
    plan = {"wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w3": col, "w2": row}
    return parallelize_module(block, mesh, plan)


def run_block(block: nn.Module, compiled: bool, device: str, seed: int = 1, batch: int = 2) -> dict[str, torch.Tensor]:
    """Loss and every local gradient of one forward/backward on this rank's sequence shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x_full = _ints((batch, 4 * world, 4 * world), seed).to(device)
    x = x_full.chunk(world, dim=1)[rank].clone().requires_grad_()
    fn = torch.compile(block) if compiled else block
    out = fn(x)
    loss = (out * _ints(tuple(out.shape), seed + 7).to(device)).sum()
    loss.backward()
    grads = {name: _local(p.grad).clone() for name, p in block.named_parameters()}
    grads["input"] = x.grad.clone()
    grads["loss"] = loss.detach()
    block.zero_grad(set_to_none=True)
    return grads


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def compiled_block_matches(device: str, batch: int = 2) -> dict[str, Any]:
    """Rank body: the compiled block with the pass gives the same loss and gradients as without
    it (to rounding: a wrong rewrite is off by O(1)); returns the fusion report's counts.
    batch 1 takes funcol's other gather form (a view of the gathered rows, no split + cat)."""
    import torch._dynamo

    import asynctp.compile

    torch._dynamo.reset()
    with fresh_compiles():
        plain = run_block(build_block(device), compiled=True, device=device, batch=batch)
        torch._dynamo.reset()
        asynctp.compile.fusion_report(clear=True)
        with asynctp.compile.enabled(fail_if_unfused=True):
            fused = run_block(build_block(device), compiled=True, device=device, batch=batch)
        torch._dynamo.reset()
    report = asynctp.compile.fusion_report(clear=True)
    for name, ref in plain.items():
        # the rewritten graph's other kernels may fuse differently: softmax rounds differently
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(fused[name], ref, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{name}: {m}")
    return {
        "graphs": [g.kind for g in report.graphs],
        "ag": report.count("asynctp.all_gather_matmul"),
        "rs": report.count("asynctp.matmul_reduce_scatter"),
        "unfused": [r.describe() for r in report.unfused],
        "matmuls": sorted(r.num_matmuls for r in report.fused if r.kind == "all-gather"),
        "rs_matmuls": sorted(r.num_matmuls for r in report.fused if r.kind == "reduce-scatter"),
        "text": str(report),
    }


def demo_model_grads_match(device: str, size: str = "tiny", batch: int = 4, num_layers: int = 2,
                           dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Rank body: the demo model (GQA, RoPE in real arithmetic under compile, SwiGLU, a
    vocabulary-parallel embedding and head) with the vanilla sequence-parallel plan, one forward
    and backward compiled with asynctp's pass against compiled without it. Returns the largest
    relative difference per parameter (max |diff| / max |ref|), the loss difference and the
    fusion report's counts. torch 2.11's own pass gets exactly this wrong at batch 2 (gradients
    off by 0.5-3.4x their magnitude below the second layer's attention, 2xH200;
    benchmarks/probe_torch_async_tp_numerics.py): ours must stay at rounding."""
    import dataclasses

    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import asynctp.compile
    from asynctp.demo.data import MarkovTokens
    from asynctp.demo.model import SIZES, Transformer
    from asynctp.demo.plan import parallelize
    from asynctp.demo.train import loss_and_backward

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    cfg = dataclasses.replace(SIZES[size], num_layers=num_layers, batch_size=batch)
    tokens = MarkovTokens(cfg.vocab_size, seed=0).batch(batch, cfg.seq_len).to(device)

    def step(context: Any) -> tuple[float, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        with torch.device(device):
            model = Transformer(cfg)
        model.to(dtype)
        parallelize(model, mesh, asynchronous=False)
        torch._dynamo.reset()
        with context:
            loss = loss_and_backward(torch.compile(model), tokens)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return loss.item(), {n: _local(p.grad).float().clone() for n, p in model.named_parameters()}

    with fresh_compiles():
        plain_loss, plain = step(contextlib.nullcontext())
        asynctp.compile.fusion_report(clear=True)
        fused_loss, fused = step(asynctp.compile.enabled())
        torch._dynamo.reset()
    report = asynctp.compile.fusion_report(clear=True)
    rel = {n: ((fused[n] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item() for n, ref in plain.items()}
    worst = max(rel, key=rel.get)
    return {
        "max_rel": rel[worst], "worst": worst, "params": len(rel), "loss_diff": abs(fused_loss - plain_loss),
        "fused": len(report.fused), "unfused": [r.describe() for r in report.unfused], "text": str(report),
    }


# --- rank side: fp8 (type-erased gather with rowwise scales, scaled matmul -> reduce-scatter) ---

F8 = torch.float8_e4m3fn


def fp8_step(x_fp8, x_scale, w1_fp8, w1_scale, y_fp8, y_scale, w2_fp8, w2_scale, out_dtype):
    """Colwise: gather x (sent as uint8, dim 1) and its rowwise scale, _scaled_mm with w1.
    Rowwise: _scaled_mm of y with w2 (tensorwise), reduce-scattered along dim 1."""
    b, s, k = x_fp8.shape
    a = _gather_traceable(x_fp8.view(torch.uint8), 1).view(F8)
    scale = _gather_traceable(x_scale, 1)
    h = torch._scaled_mm(a.reshape(-1, k), w1_fp8.t(), scale.reshape(-1, 1), w1_scale, out_dtype=out_dtype)
    p = torch._scaled_mm(y_fp8.reshape(-1, k), w2_fp8.t(), y_scale, w2_scale, out_dtype=out_dtype)
    return h.reshape(b, -1, w1_fp8.shape[0]), reduce_scatter(p.reshape(y_fp8.shape[0], y_fp8.shape[1], -1), 1)


def _gather_traceable(x: torch.Tensor, dim: int) -> torch.Tensor:
    """gather(x, dim) written out as funcol's general case (gather dim 0, chunk, cat): torch 2.11's
    dynamo does not trace into funcol's helper for dim > 0 (torch._utils._maybe_view_chunk_cat is
    skipped, pytorch/pytorch#179722) and breaks the graph there, so the gather runs eagerly and
    never reaches the pass. Same graph as funcol's for batch > 1."""
    rows = gather(x, 0)
    return torch.cat(torch.chunk(rows, dist.get_world_size(), dim=0), dim=dim) if dim else rows


def _fp8_inputs(device: str) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    k, n = 16, 16
    pow2 = lambda shape, seed: 2.0 ** _ints(shape, seed, -1, 2)  # noqa: E731 - exact scales
    return [
        _ints((2, 4, k), 10 + rank).to(F8).to(device), pow2((2, 4, 1), 20 + rank).to(device),
        _ints((n, k), 30).to(F8).to(device), pow2((1, n), 31).to(device),
        _ints((2, 4 * world, k), 40 + rank).to(F8).to(device), pow2((), 41).to(device),
        _ints((n, k), 50 + rank).to(F8).to(device), pow2((), 51).to(device),
    ]


def compiled_fp8_matches(device: str) -> dict[str, Any]:
    """Rank body: fp8_step compiled with the pass gives what it gives without; returns counts."""
    import torch._dynamo

    import asynctp.compile

    # cuBLAS's rowwise _scaled_mm writes bf16 only; the small-integer values are exact in bf16
    args = [*_fp8_inputs(device), torch.bfloat16 if device == "cuda" else torch.float32]
    torch._dynamo.reset()
    with fresh_compiles():
        plain = torch.compile(fp8_step)(*args)
        torch._dynamo.reset()
        asynctp.compile.fusion_report(clear=True)
        with asynctp.compile.enabled():
            fused = torch.compile(fp8_step)(*args)
        torch._dynamo.reset()
    report = asynctp.compile.fusion_report(clear=True)
    for ref, got in zip(plain, fused):
        assert got.shape == ref.shape and torch.equal(got, ref), f"max diff {(got - ref).abs().max()}"
    return {
        "graphs": len(report.graphs),  # more than 1: a graph break left collectives out of the pass
        "ag": report.count("asynctp.all_gather_scaled_matmul"),
        "rs": report.count("asynctp.scaled_matmul_reduce_scatter"),
        "unfused": [r.describe() for r in report.unfused],
        "text": str(report),
    }


# --- rank side (GPU): time one training step of an 8B-shaped block, compiled three ways ---------


def _step_ms(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, iters: int) -> float:
    """Median ms of forward + backward, max over ranks (the slowest rank sets the step time)."""
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x).float().square().mean().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:  # the first calls compile and warm up
            times.append(start.elapsed_time(end))
    median = torch.tensor(sorted(times)[len(times) // 2], device=x.device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def time_block_variants(dim: int = 4096, hidden: int = 14336, num_heads: int = 32, seq: int = 8192,
                        iters: int = 10) -> dict[str, Any]:
    """Rank body: ms per step of the block compiled (vanilla), compiled + torch's async-TP pass,
    compiled + asynctp's pass (bf16, batch 1, the whole sequence split over ranks); the outputs
    of the three agree; asynctp's report lists no unfused collective."""
    import torch._dynamo

    import asynctp.compile

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    block = _parallelize(TinyBlock(dim, hidden, num_heads).to("cuda", torch.bfloat16), "cuda")
    x = torch.randn(1, seq, dim, device="cuda", dtype=torch.bfloat16).chunk(world, dim=1)[rank].contiguous()
    x.requires_grad_()
    results: dict[str, Any] = {"shape": f"dim {dim} hidden {hidden} heads {num_heads} seq {seq} x{world}"}
    outs: dict[str, torch.Tensor] = {}

    def variant(name: str, context: Any) -> None:
        torch._dynamo.reset()
        try:
            with fresh_compiles(), context:
                fn = torch.compile(block)
                results[name] = _step_ms(fn, x, iters)
                outs[name] = fn(x).detach().float()
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
            results[name] = None
            results[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        block.zero_grad(set_to_none=True)

    variant("vanilla", contextlib.nullcontext())
    variant("torch_pass", _torch_async_tp(block.wq.weight.device_mesh.get_group().group_name))
    asynctp.compile.fusion_report(clear=True)
    variant("asynctp_pass", asynctp.compile.enabled())
    torch._dynamo.reset()
    report = asynctp.compile.fusion_report(clear=True)
    results["asynctp_unfused"] = [r.describe() for r in report.unfused]
    results["asynctp_report"] = str(report)
    ref = outs.get("vanilla")
    for name, out in outs.items():
        if ref is not None and name != "vanilla":
            results[f"{name}_max_rel_diff"] = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    return results


@contextlib.contextmanager
def _torch_async_tp(group_name: str) -> Iterator[None]:
    """torch's own pass: on for inductor, with symmetric memory enabled for the TP group."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symm_mem

    symm_mem.enable_symm_mem_for_group(group_name)
    with inductor_config.patch(_micro_pipeline_tp=True):
        yield
