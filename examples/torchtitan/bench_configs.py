"""torchtitan 0.3 configs for benchmarks/torchtitan_bench.sh: Llama-3-8B's shape cut to 4 layers (dim 4096,
32 heads, 8 KV heads, FFN 14336, vocab 128256), seq 8192, batch 1, on synthetic tokens, so the trainer
needs no tokenizer files and no dataset.

    torchrun --nproc-per-node 2 examples/torchtitan/train.py --module bench_configs \\
        --config llama3_8b_4layers_dist_gemm --parallelism.tensor_parallel_degree 2

llama3_8b_4layers: torchtitan's default TP linears; llama3_8b_4layers_dist_gemm: its dist_gemm linears
(tp_gemm_backend="dist_gemm"), which examples/torchtitan/train.py runs on asynctp unless --asynctp.off.
Both use parallelism.spmd_backend="spmd_types" (torchtitan's default, and what dist_gemm requires), no
torch.compile (torchtitan's CUDA graphs of forward + backward stay on unless
--training.disable_cuda_graphs), no activation checkpointing, no checkpoints, no validation, no profiler, no TensorBoard; every
field stays overridable with --<section>.<key>. `--module bench_configs` resolves because train.py's
folder is first on sys.path.

No FSDP while the data-parallel degree is 1: torchtitan 0.3 wraps every model in fully_shard even then,
and under spmd_types it passes dp_mesh_dims, which torch 2.11's fully_shard does not take and torch
2.13's rejects for spmd_types' plain-tensor parameters ("When dp_mesh_dims is provided, all parameters
must be DTensors on the full SPMD mesh"). Without FSDP's mixed-precision policy the run trains in
bf16 throughout (training.dtype = "bfloat16": bf16 parameters, gradients and optimizer states), and
without gradient clipping (training.max_norm = inf; see llama3_8b_4layers).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.distributed.utils import get_spmd_context
from torchtitan.models.llama3 import model_registry, parallelize_llama
from torchtitan.models.llama3.config_registry import llama3_8b
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

N_LAYERS = 4


class SyntheticTokenizer(BaseTokenizer):
    """A tokenizer without files: token ids are the bytes of the text (the trainer builds one; the
    synthetic dataloader never calls it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 128256

    def __init__(self, config: Config | None = None, *, tokenizer_path: str = "") -> None:
        super().__init__()
        self.vocab_size = (config or self.Config()).vocab_size
        self.eos_id = self.vocab_size - 1

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class _RandomTokens(IterableDataset):
    """Endless samples of uniform random token ids, one document per sample (positions 0..seq_len-1,
    so the block-causal mask is the plain causal one)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        positions = torch.arange(self.seq_len)
        while True:
            tokens = torch.randint(0, self.vocab_size - 1, (self.seq_len + 1,), generator=gen)  # no EOS id: one document, as the positions say
            yield {"input": tokens[:-1], "positions": positions}, tokens[1:]


class SyntheticTextDataLoader(ParallelAwareDataloader):
    """Random tokens in torchtitan's (inputs, labels) batch format; every DP rank its own stream."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "synthetic"
        vocab_size: int = 128256
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer,
                 seq_len: int, local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs: Any) -> None:
        super().__init__(_RandomTokens(config.vocab_size, seq_len, config.seed + dp_rank),
                         dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                         snapshot_every_n_steps=snapshot_every_n_steps)


def _reuse_attention_masks(model: torch.nn.Module) -> None:
    """One BlockMask object per positions shape, built at its first step.

    torchtitan's CUDA graphs of forward + backward require the mask's flattened structure to stay
    the same across steps, but get_attention_masks builds a new mask_mod closure every step, which
    torch 2.11's BlockMask flattening compares by identity ("CUDA graph BlockMask structure must
    remain constant"). The synthetic loader's positions are 0..seq_len-1 in every sample, so a
    shape's mask never changes: checked once, at its first build (a host sync), not every step."""
    build = model.get_attention_masks
    masks: dict[tuple, Any] = {}

    def get_attention_masks(positions: torch.Tensor) -> Any:
        key = (positions.shape, positions.device)
        if key not in masks:
            expected = torch.arange(positions.shape[-1], device=positions.device).expand_as(positions)
            if not torch.equal(positions, expected):
                raise ValueError("bench_configs reuses one attention mask per shape, which requires positions "
                                 "0..seq_len-1 in every sample (the synthetic loader's)")
            masks[key] = build(positions=positions)
        return masks[key]

    model.get_attention_masks = get_attention_masks


def _parallelize_without_fsdp(model: torch.nn.Module, *, parallel_dims: Any, **kwargs: Any) -> torch.nn.Module:
    """torchtitan's parallelize_llama, minus its fully_shard wrapping where no DP or CP axis is active."""
    import torchtitan.models.llama3.parallelize as parallelize

    _reuse_attention_masks(model)
    if parallel_dims.dp_shard_enabled or parallel_dims.dp_replicate_enabled or parallel_dims.cp_enabled:
        return parallelize_llama(model, parallel_dims=parallel_dims, **kwargs)
    apply_fsdp = parallelize.apply_fsdp_to_decoder
    parallelize.apply_fsdp_to_decoder = lambda *args, **kwargs: None
    try:
        model = parallelize_llama(model, parallel_dims=parallel_dims, **kwargs)
    finally:
        parallelize.apply_fsdp_to_decoder = apply_fsdp
    # the parameters stay local shards (FSDP would have made them DTensors): initialize them inside
    # the SPMD mesh context, as the fused QKV's init needs it to pick this rank's shard
    init_weights = model.init_weights

    def init_weights_in_mesh(*args: Any, **kwargs: Any) -> Any:
        with get_spmd_context(parallel_dims=parallel_dims)():
            return init_weights(*args, **kwargs)

    model.init_weights = init_weights_in_mesh
    return model


def _model_spec(tp_gemm_backend: str) -> ModelSpec:
    spec = model_registry("8B", tp_gemm_backend=tp_gemm_backend)
    spec.model.layers = spec.model.layers[:N_LAYERS]
    spec.parallelize_fn = _parallelize_without_fsdp
    return spec


def llama3_8b_4layers(tp_gemm_backend: str = "default") -> Trainer.Config:
    """torchtitan's llama3_8b with 4 layers, synthetic data and the run-time extras off."""
    config = llama3_8b()
    config.model_spec = _model_spec(tp_gemm_backend)
    vocab = config.model_spec.model.vocab_size
    config.hf_assets_path = ""
    config.tokenizer = SyntheticTokenizer.Config(vocab_size=vocab)
    config.dataloader = SyntheticTextDataLoader.Config(vocab_size=vocab)
    config.training.steps = 30
    config.training.dtype = "bfloat16"
    # no clipping (the norm and the multiply by 1 still run): without FSDP the parameters are plain
    # local tensors, so torchtitan's clip_grad_norm_ takes each rank's norm of its own shards, the
    # ranks would scale their gradients differently, and their replicated weights drift apart
    config.training.max_norm = float("inf")
    config.parallelism.spmd_backend = "spmd_types"
    config.activation_checkpoint = None
    config.profiler.enable_profiling = False
    config.metrics.enable_tensorboard = False
    config.metrics.log_freq = 1
    config.checkpoint.enable = False
    config.validator.enable = False
    return config


def llama3_8b_4layers_dist_gemm() -> Trainer.Config:
    """The same with torchtitan's dist_gemm TP linears (fused QKV / FFN all-gather, row-parallel wo / w2)."""
    return llama3_8b_4layers("dist_gemm")
