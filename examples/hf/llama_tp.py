"""Hugging Face LlamaForCausalLM with its own tp_plan made async (sequence-parallel, TP over all ranks).

    torchrun --nproc-per-node 2 examples/hf/llama_tp.py                 # GPUs (NCCL), bf16, 1B-like
    torchrun --nproc-per-node 2 examples/hf/llama_tp.py --cpu --tiny    # CPU (gloo), float32

The model is built from a config (no download). --vanilla runs HF's plan through torch's plain
styles instead (not sequence-parallel), for comparison; --check compares the first step's loss
with the unsharded model on every rank (tiny models only).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from asynctp.integrations import hf


def build(tiny: bool, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    else:  # Llama-3.2-1B's shape
        config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU, float32")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of width 64")
    parser.add_argument("--vanilla", action="store_true", help="HF's own plan through torch's styles")
    parser.add_argument("--check", action="store_true", help="compare the first loss with the unsharded model")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if not args.cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo" if args.cpu else "nccl")
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model = build(args.tiny, dtype).to(device)
    ref = copy.deepcopy(model) if args.check else None
    if args.vanilla:
        from torch.distributed.tensor.parallel import parallelize_module

        from asynctp.parallel.hf_plan import vanilla_plan

        parallelize_module(model, mesh, vanilla_plan(model))
    else:
        hf.parallelize(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()
        if ref is not None and step == 0:
            expected = ref(input_ids=tokens, labels=tokens).loss.item()
            assert abs(value - expected) <= 1e-4 * max(1.0, abs(expected)), f"loss {value} vs unsharded {expected}"
        if dist.get_rank() == 0:
            print(f"step {step}: loss {value:.4f}  {1e3 * (time.perf_counter() - start):.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
