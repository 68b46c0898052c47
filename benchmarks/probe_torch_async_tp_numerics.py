"""Reproduction (>= 2 GPUs): does torch's own async-TP pass (inductor's micro-pipeline TP) compute
what the unfused graph computes, at batch 1 and batch 2, sequence-sharded (gather / scatter dim 1)?

Why: in the demo on 2xH200 (torch 2.11), vanilla TP compiled with torch's pass ends 30 steps at
batch 2 with a loss 2.6% above vanilla's, while asynctp's stays within 3e-4; at batch 1 all
agree (docs/performance.md). Checks (PROBE_PARTS picks; default 1-3):

1. ops, exact: all_gather(dim 1) -> matmul and matmul -> reduce_scatter(dim 1) on small-integer
   bf16 inputs (every dot product exact in fp32, so any correct schedule gives identical bits),
   compiled with the pass against eager; the generated code is searched for torch's fused ops,
   so "not fused" and "fused but wrong" are told apart.
2. exact, per parameter: an embedding (RowwiseParallel to a sequence shard) -> column-parallel ->
   row-parallel linear + residual, small-integer values, compiled with the pass against without;
   and the same with attention's view to heads and transposes between the two linears, and with
   causal SDPA there (compared by relative difference).
3. the demo model (vanilla sequence-parallel plan), one forward + backward at batch 1 and 2:
   eager, compiled, compiled with torch's pass, compiled with asynctp's; loss and the relative
   gradient difference per parameter (those over 5e-2 listed).
4. (PROBE_PARTS=ablate, PROBE_CASES=a comma list of case names to run only those) the demo model
   at batch 2 without RoPE, without GQA, with the complex RoPE under compile, with cuDNN's
   attention off: which feature the wrong gradients need.
5. (PROBE_PARTS=code, PROBE_LAYERS=1) inductor's generated code with and without the pass, for
   diffing (which rewritten op feeds the wrong gradient), and that case's gradient differences.

    [PROBE_PARTS=ops,exact_block,model] python benchmarks/probe_torch_async_tp_numerics.py OUT_DIR
"""

import contextlib
import dataclasses
import functools
import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


@contextlib.contextmanager
def torch_pass(group_name):
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        enable(group_name)
    with inductor_config.patch(_micro_pipeline_tp=True):
        yield


def op_checks(pg, rank, world):
    import torch._dynamo
    import torch.distributed._functional_collectives as funcol
    from torch._inductor.utils import run_and_get_code

    rows = []
    S, D, N = 4096, 512, 1024
    for batch in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(batch)
        x = torch.randint(-1, 2, (batch, S, D), device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randint(-1, 2, (N, D), device="cuda", generator=g).to(torch.bfloat16)
        w_rs = torch.randint(-1, 2, (N, D), device="cuda", generator=g).to(torch.bfloat16) * (rank + 1)
        shard = x.chunk(world, dim=1)[rank].contiguous()

        def ag_mm(shard, w):
            return funcol.all_gather_tensor(shard, 1, pg) @ w.t()

        def mm_rs(x, w):
            return funcol.reduce_scatter_tensor(x @ w.t(), "sum", 1, pg)

        for name, fn, args, fused_name in (("ag_mm", ag_mm, (shard, w), "fused_all_gather_matmul"),
                                           ("mm_rs", mm_rs, (x, w_rs), "fused_matmul_reduce_scatter")):
            ref = fn(*args)
            ref = ref.wait() if hasattr(ref, "wait") else ref
            torch._dynamo.reset()
            with torch_pass(pg.group_name):
                got, code = run_and_get_code(torch.compile(fn), *args)
            fused = any(fused_name in c for c in code)
            diff = (got.float() - ref.float()).abs()
            bad = diff > 0
            rows.append({"op": name, "batch": batch, "fused": fused, "exact": not bool(bad.any()),
                         "mismatched": int(bad.sum()), "of": diff.numel(), "max_abs_diff": float(diff.max()),
                         "first_bad_index": bad.nonzero()[0].tolist() if bad.any() else None})
    return rows


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the code, no pass


@functools.lru_cache(maxsize=None)
def _mesh(world):
    """One mesh for every model of the process (a compile after an eager step on a second mesh
    failed in inductor on CPU: "Node tangents_2 was invalid, but is output")."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(_device(), list(range(world)))


def _demo_model(cfg, world):
    """The demo model from seed 0, bf16, sharded with the vanilla sequence-parallel plan."""
    import torch._dynamo

    import asynctp.demo.model as demo_model
    from asynctp.demo.plan import parallelize

    torch.manual_seed(0)
    with torch.device(_device()):
        model = demo_model.Transformer(cfg)
    model.to(torch.bfloat16)
    parallelize(model, _mesh(world), asynchronous=False)
    torch._dynamo.reset()
    return model


def _tokens(cfg):
    from asynctp.demo.data import MarkovTokens

    return MarkovTokens(cfg.vocab_size, seed=0).batch(cfg.batch_size, cfg.seq_len).to(_device())


def _step(run, tokens):
    """The demo's forward, loss and backward (asynctp.demo.train); the loss (a float)."""
    from asynctp.demo.train import loss_and_backward

    loss = loss_and_backward(run, tokens)
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()


def _grads(model):
    return {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).float().clone()
            for n, p in model.named_parameters()}


def _rel(grads, ref):
    """max |grad - ref| / max |ref| per parameter."""
    return {n: ((g - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)).item() for n, g in grads.items()}


def _context(variant, pg):
    if variant.endswith("torch pass") and _device() == "cuda":
        return torch_pass(pg.group_name)
    if variant.endswith("asynctp pass"):
        import asynctp.compile

        return asynctp.compile.enabled()
    return contextlib.nullcontext()


def model_checks(pg, rank, world):
    from asynctp.demo.model import SIZES

    rows = []
    for batch in (1, 2):
        cfg = dataclasses.replace(SIZES["small" if _device() == "cuda" else "tiny"], num_layers=2, batch_size=batch)
        tokens = _tokens(cfg)
        results = {}
        variants = ("eager", "compiled", "compiled+torch pass", "compiled+asynctp pass")
        for variant in variants if _device() == "cuda" else ("eager", "eager again"):
            model = _demo_model(cfg, world)
            with _context(variant, pg):
                loss = _step(model if variant.startswith("eager") else torch.compile(model), tokens)
            results[variant] = (loss, _grads(model))
            del model
        ref_loss, ref_grads = results["eager"]
        for variant, (loss, grads) in results.items():
            rel = _rel(grads, ref_grads)
            where = max(rel, key=rel.get)
            rows.append({"batch": batch, "variant": variant, "loss": loss, "loss_rel_diff_vs_eager": abs(loss - ref_loss) / abs(ref_loss),
                         "max_grad_rel_diff_vs_eager": rel[where], "worst_param": where,
                         "params_over_5e-2": {n: round(v, 4) for n, v in rel.items() if v > 5e-2}})
    return rows


def exact_block_checks(pg, rank, world):
    """An embedding (vocab-parallel, RowwiseParallel to a sequence shard) -> column-parallel ->
    row-parallel linear with a residual, on small-integer bf16 values and an integer output
    gradient, so every gradient is exact in fp32 whatever the schedule: compiled with torch's
    pass against compiled without it, per parameter, batch 1 and 2."""
    import torch._dynamo
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Mini(nn.Module):
        def __init__(self, vocab, dim, hidden):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)

        def forward(self, tokens):
            h = self.emb(tokens)
            return self.w2(self.w1(h)) + h

    class Heads(Mini):
        """The same, with what attention does between the two linears: a view to heads and a
        transpose there and back around a pointwise op (exact: a multiplication by 2)."""

        def forward(self, tokens):
            h = self.emb(tokens)
            q = self.w1(h)
            b, s, _ = q.shape
            heads = q.view(b, s, -1, 64).transpose(1, 2) * 2
            return self.w2(heads.transpose(1, 2).reshape(b, s, -1)) + h

    class Attn(Mini):
        """Heads, with causal SDPA (q = k = v) in place of the multiplication: not exact, so
        compared by the largest relative difference (rounding: ~1e-2 at most; wrong: ~1)."""

        def forward(self, tokens):
            h = self.emb(tokens)
            q = self.w1(h)
            b, s, _ = q.shape
            heads = q.view(b, s, -1, 64).transpose(1, 2)
            att = F.scaled_dot_product_attention(heads, heads, heads, is_causal=True)
            return self.w2(att.transpose(1, 2).reshape(b, s, -1)) + h

    mesh = _mesh(world)
    plan = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "w1": ColwiseParallel(input_layouts=Shard(1)), "w2": RowwiseParallel(output_layouts=Shard(1))}
    rows = []
    V, D, H, S = 256, 512, 1024, 4096
    for (batch, cls) in ((1, Mini), (2, Mini), (1, Heads), (2, Heads), (1, Attn), (2, Attn)):
        g = torch.Generator(device="cuda").manual_seed(10 + batch)
        tokens = torch.randint(0, V, (batch, S), device="cuda", generator=g)
        grad_out = torch.randint(-1, 2, (batch, S // world, D), device="cuda", generator=g).to(torch.bfloat16)
        grads = {}
        for variant in ("compiled", "compiled+torch pass"):
            torch.manual_seed(0)
            model = cls(V, D, H).to("cuda")
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randint(-1, 2, p.shape, generator=torch.Generator().manual_seed(p.numel())).float())
                    if cls is Attn:
                        p.mul_(1 / 64)
            model.to(torch.bfloat16)
            parallelize_module(model, mesh, plan)
            torch._dynamo.reset()
            ctx = torch_pass(pg.group_name) if variant.endswith("pass") else contextlib.nullcontext()
            with ctx:
                out = torch.compile(model)(tokens)
                out = out.to_local() if hasattr(out, "to_local") else out
                out.backward(grad_out)
            grads[variant] = _grads(model)
        for n, ref in grads["compiled"].items():
            got = grads["compiled+torch pass"][n]
            bad = got != ref
            rows.append({"model": cls.__name__, "batch": batch, "param": n, "exact": not bool(bad.any()), "mismatched": int(bad.sum()),
                         "of": bad.numel(), "max_abs_diff": float((got - ref).abs().max()),
                         "ref_max_abs": float(ref.abs().max()),
                         "rel_diff": float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))})
    return rows


def ablation_checks(pg, rank, world):
    """The demo model at batch 2 with one attention feature taken out at a time: compiled with
    torch's pass against compiled without it, the parameters whose gradients differ by > 5e-2."""
    import asynctp.demo.model as demo_model

    base = dataclasses.replace(demo_model.SIZES["small"], num_layers=2, batch_size=2)
    rope = demo_model.apply_rope
    cases = (("as is", base, rope, True), ("no RoPE", base, lambda x, tables: x, True),
             ("no GQA", dataclasses.replace(base, num_kv_heads=base.num_heads), rope, True),
             ("RoPE as in eager (complex)", base, demo_model.rope_complex, True),  # under compile too
             # cuDNN's bf16 attention backward returns wrong gradients for an output gradient
             # whose batch stride is below its sequence stride (benchmarks/probe_sdpa_strides.py)
             ("cuDNN attention off", base, rope, False))
    only = os.environ.get("PROBE_CASES")
    cases = [c for c in cases if only is None or c[0] in only.split(",")]
    rows = []
    for name, cfg, apply, cudnn in cases:
        tokens = _tokens(cfg)
        grads = {}
        for variant in ("compiled", "compiled+torch pass"):
            demo_model.apply_rope = apply
            cudnn_was = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            try:
                model = _demo_model(cfg, world)
                with _context(variant, pg):
                    _step(torch.compile(model), tokens)
            finally:
                demo_model.apply_rope = rope
                torch.backends.cuda.enable_cudnn_sdp(cudnn_was)
            grads[variant] = _grads(model)
            del model
        rel = _rel(grads["compiled+torch pass"], grads["compiled"])
        rows.append({"case": name, "max_rel": max(rel.values()),
                     "params_over_5e-2": {n: round(v, 3) for n, v in rel.items() if v > 5e-2}})
    return rows


def code_dump(pg, rank, world, out=None):
    """The demo model (`small`, PROBE_LAYERS layers, default 1) at batch 2, one forward + backward
    compiled with and without torch's pass: inductor's generated code of every graph (forward and
    backward) written to OUT/code_<variant>_<i>.py on rank 0 (to diff: which rewrite feeds what),
    and the gradient differences as in ablation_checks."""
    from torch._inductor.utils import run_and_get_code

    from asynctp.demo.model import SIZES

    size = "small" if _device() == "cuda" else "tiny"
    cfg = dataclasses.replace(SIZES[size], num_layers=int(os.environ.get("PROBE_LAYERS", "1")), batch_size=2)
    tokens = _tokens(cfg)
    grads, files = {}, []
    for variant in ("compiled", "torch pass"):
        model = _demo_model(cfg, world)
        with _context(variant, pg):
            _, codes = run_and_get_code(_step, torch.compile(model), tokens)
        if rank == 0 and out is not None:
            for i, code in enumerate(codes):
                path = os.path.join(out, f"code_{variant.replace(' ', '_')}_{i}.py")
                with open(path, "w") as f:
                    f.write(code)
                files.append(os.path.basename(path))
        grads[variant] = _grads(model)
        del model
    rel = _rel(grads["torch pass"], grads["compiled"])
    return [{"layers": cfg.num_layers, "max_rel": max(rel.values()),
             "params_over_5e-2": {n: round(v, 3) for n, v in rel.items() if v > 5e-2}, "code_files": files}]


def main(rank, world, out):
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="tcp://127.0.0.1:29541", rank=rank, world_size=world)
    pg = dist.group.WORLD
    result = {"torch": torch.__version__}
    parts = os.environ.get("PROBE_PARTS", "ops,exact_block,model").split(",")  # which checks run
    checks = (("ops", op_checks), ("exact_block", exact_block_checks), ("model", model_checks),
              ("ablate", ablation_checks), ("code", lambda *a: code_dump(*a, out=out)))
    for name, fn in ((n, f) for n, f in checks if n in parts and (cuda or n in ("model", "code"))):
        try:
            result[name] = fn(pg, rank, world)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next check
            result[name] = f"{type(exc).__name__}: {str(exc)[:500]}"
        if rank == 0:
            rows = result[name]
            print(name, *(rows if isinstance(rows, list) else [rows]), sep="\n  ", flush=True)
    if rank == 0:
        with open(os.path.join(out, "torch_async_tp_numerics.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    n = torch.cuda.device_count() or 2
    mp.spawn(main, args=(n, sys.argv[1]), nprocs=n)
