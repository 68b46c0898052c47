"""Developer probe: one training step's gradients of the demo model under each TP plan against an
unsharded float32 reference, on all local GPUs, for a few model shapes, batch sizes and dtypes.
Prints, per (shape, batch, dtype, plan), the loss and the worst parameters by relative gradient
error ||g - g_ref|| / ||g_ref||. Written to find why vanilla TP and asynctp's loss curves part
at batch 2 on the 8B block (bf16) while they agree at batch 1.

    PROBE_SHAPES=mid,8b PROBE_BATCHES=1,2 python benchmarks/probe_grads.py OUT_DIR
"""

import copy
import dataclasses
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.probe_pipeline import finish  # noqa: E402  (rank 0 writes the JSON, all leave the group)

SHAPES = os.environ.get("PROBE_SHAPES", "mid,8b").split(",")
BATCHES = [int(b) for b in os.environ.get("PROBE_BATCHES", "1,2").split(",")]
DTYPES = os.environ.get("PROBE_DTYPES", "float32,bfloat16").split(",")
CPU = not torch.cuda.is_available()
SEQ = int(os.environ.get("PROBE_SEQ", "0"))  # 0: the shape's own


def configs():
    from asynctp.demo.model import SIZES

    big = SIZES["8b-block"]
    mid = dataclasses.replace(big, dim=1024, num_layers=2, num_heads=8, num_kv_heads=2, ffn_dim=2816, vocab_size=4096,
                              seq_len=1024)
    small8b = dataclasses.replace(big, num_layers=1, seq_len=2048)
    shapes = {"mid": mid, "8b": small8b}
    return {k: dataclasses.replace(v, seq_len=SEQ or v.seq_len) for k, v in shapes.items()}


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def step(model, tokens):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    logits = model(tokens[:, :-1])
    if isinstance(logits, DTensor):
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
        return full(loss).item()
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item()


def main(rank, ws, out):
    from torch.distributed.device_mesh import init_device_mesh

    from asynctp.demo.data import MarkovTokens
    from asynctp.demo.model import Transformer
    from asynctp.demo.plan import parallelize

    dev = "cpu" if CPU else "cuda"
    if not CPU:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if CPU else "nccl", init_method="tcp://127.0.0.1:29536", rank=rank, world_size=ws)
    mesh = init_device_mesh(dev, (ws,))
    rows = []
    plans = {
        "vanilla": dict(asynchronous=False),
        "asynctp-serial": dict(asynchronous=True, strategy="serial"),
        "asynctp-auto-saved": dict(asynchronous=True, save_gathered_input=True),
        "asynctp-auto-regather": dict(asynchronous=True),
    }
    for shape in SHAPES:
        for batch in BATCHES:
            cfg = dataclasses.replace(configs()[shape], batch_size=batch)
            tokens = MarkovTokens(cfg.vocab_size, seed=1).batch(batch, cfg.seq_len).to(dev)
            torch.manual_seed(0)
            with torch.device(dev):
                ref = Transformer(cfg)
            base = copy.deepcopy(ref)
            ref_loss = step(ref, tokens)
            ref_grads = {n: p.grad.float() for n, p in ref.named_parameters()}
            del ref
            for dtype_name in DTYPES:
                for plan, kw in plans.items():
                    model = copy.deepcopy(base).to(getattr(torch, dtype_name))
                    model = parallelize(model, mesh, **kw)
                    loss = step(model, tokens)
                    errs = {}
                    for n, p in model.named_parameters():
                        g = full(p.grad).float()
                        errs[n] = ((g - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)).item()
                    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:4]
                    row = {"shape": shape, "batch": batch, "dtype": dtype_name, "plan": plan, "loss": loss,
                           "ref_loss": ref_loss, "worst": worst, "errs": errs}
                    rows.append(row)
                    if rank == 0:
                        w = ", ".join(f"{n} {e:.2e}" for n, e in worst)
                        print(f"{shape} B{batch} {dtype_name:8} {plan:22} loss {loss:.5f} (ref {ref_loss:.5f}) worst: {w}",
                              flush=True)
                    del model
                    if not CPU:
                        torch.cuda.empty_cache()
    finish(rank, os.path.join(out, "grads.json"), rows)


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    n = 2 if CPU else torch.cuda.device_count()
    mp.spawn(main, args=(n, sys.argv[1]), nprocs=n)
