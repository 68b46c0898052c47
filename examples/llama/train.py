"""Train the Llama-style demo model with tensor parallelism, vanilla or async, in ~60 lines.

    torchrun --nproc-per-node 2 examples/llama/train.py --async          # GPUs (NCCL)
    torchrun --nproc-per-node 2 examples/llama/train.py --cpu --steps 20 # CPU (gloo), tiny model

The plan is the vanilla sequence-parallel one (ColwiseParallel(input_layouts=Shard(1)),
RowwiseParallel(output_layouts=Shard(1)), SequenceParallel for the norms); --async swaps the two
linear styles for asynctp.parallel's. `asynctp demo` runs both side by side and reports.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from asynctp.demo.data import MarkovTokens
from asynctp.demo.model import SIZES, Transformer
from asynctp.demo.plan import parallelize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SIZES), default=None)
    parser.add_argument("--async", dest="asynchronous", action="store_true", help="asynctp's styles")
    parser.add_argument("--float8", choices=["rowwise", "tensorwise"], default=None, help="fp8 recipe (with --async)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and not args.cpu
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda" if use_cuda else "cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    cfg = SIZES[args.model or ("small" if use_cuda else "tiny")]
    torch.manual_seed(0)  # same initial weights on every rank; parallelize shards them
    with device:
        model = Transformer(cfg)
    model.to(torch.bfloat16 if use_cuda else torch.float32)
    parallelize(model, mesh, asynchronous=args.asynchronous, float8=args.float8)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = MarkovTokens(cfg.vocab_size, seed=0)  # same batches on every rank

    for step in range(args.steps):
        tokens = data.batch(cfg.batch_size, cfg.seq_len).to(device)
        logits = model(tokens[:, :-1])  # [B, S, V / R], sharded over the vocabulary
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.full_tensor().item():.4f}  (best possible {data.best_loss:.4f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
