"""A compact Llama-3-style decoder (RMSNorm, RoPE, GQA attention with SDPA, SwiGLU), written so
that tensor-parallel plans can shard it: one nn.Linear per projection, heads inferred from the
local projection width, activations [batch, seq, dim].

Shape legend: B batch, S sequence, D model dim, H / H_kv query / key-value heads (local ones
under tensor parallelism), Dh head dim, F feed-forward dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "SIZES", "Transformer", "RMSNorm", "Attention", "FeedForward", "Block"]


@dataclass(frozen=True)
class ModelConfig:
    """Model shape; every field is keyword-only in spirit: use SIZES or dataclasses.replace."""

    dim: int  # D, model width
    num_layers: int
    num_heads: int  # H, query heads
    num_kv_heads: int  # H_kv, key/value heads (grouped-query attention: H % H_kv == 0)
    ffn_dim: int  # F, SwiGLU hidden width
    vocab_size: int  # V
    seq_len: int  # S, training sequence length (RoPE tables are built for it)
    batch_size: int = 1  # B, sequences per step (what the demo trains with)
    rope_theta: float = 500000.0  # Llama 3's RoPE base
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim requires a multiple of num_heads {self.num_heads}, got {self.dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads requires a multiple of num_kv_heads {self.num_kv_heads}, got {self.num_heads}")
        if (self.dim // self.num_heads) % 2:
            raise ValueError(f"head dim requires an even size (RoPE pairs), got {self.dim // self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def check_tp(self, world_size: int) -> None:
        """ValueError unless a tensor-parallel plan over world_size ranks can shard this shape."""
        sizes = {
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "ffn_dim": self.ffn_dim,
            "vocab_size": self.vocab_size, "seq_len": self.seq_len,
        }
        for name, size in sizes.items():
            if size % world_size:
                raise ValueError(f"tensor parallelism over {world_size} ranks requires {name} divisible by {world_size}, got {size}")

    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        block = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return self.num_layers * block + 2 * self.vocab_size * self.dim + self.dim


SIZES: dict[str, ModelConfig] = {
    # CPU-sized: a few ms per step on 2 gloo processes
    "tiny": ModelConfig(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=192,
                        vocab_size=64, seq_len=64, batch_size=4),
    # one GPU-sized step, quick to try
    "small": ModelConfig(dim=1024, num_layers=4, num_heads=16, num_kv_heads=4, ffn_dim=3584,
                         vocab_size=8192, seq_len=2048, batch_size=2),
    # Llama 3 8B's layer shapes (dim 4096, ffn 14336, 32 / 8 heads) at seq 8192, 4 layers
    "8b-block": ModelConfig(dim=4096, num_layers=4, num_heads=32, num_kv_heads=8, ffn_dim=14336,
                            vocab_size=32768, seq_len=8192, batch_size=1),
}


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and rounded once to x's dtype: torch's
    F.rms_norm, one fused kernel forward and one backward on CUDA (torch >= 2.11; DTensor shards
    it by sequence). The plain-op version this replaced took ~7 passes over the activations each
    way, a few ms a step of the 8B-shaped demo at batch 2 in eager mode."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """[S, Dh / 2, 2] (cos, sin) of the rotation for each position and frequency pair."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [B, S, H, Dh] by the angles of tables [S, Dh / 2, 2],
    in float32. Eager: one complex multiplication (three kernels each way, not ten). Compiled:
    the same rotation in real arithmetic, which inductor fuses (it generates no code for complex
    operators and falls back to eager kernels for them)."""
    return rope_real(x, tables) if torch.compiler.is_compiling() else rope_complex(x, tables)


def rope_real(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """apply_rope in real arithmetic (what inductor fuses)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = tables[: x.shape[1], None, :, 0], tables[: x.shape[1], None, :, 1]
    real = pairs[..., 0] * cos - pairs[..., 1] * sin
    imag = pairs[..., 0] * sin + pairs[..., 1] * cos
    return torch.stack([real, imag], dim=-1).flatten(-2).type_as(x)


def rope_complex(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """apply_rope as one complex multiplication (few eager kernels)."""
    rotation = torch.view_as_complex(tables[: x.shape[1], None])  # [S, 1, Dh / 2]
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention; local head counts come from the projections' widths, so
    the same code runs unsharded and with column-sharded wq / wk / wv."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]  # global sizes also when x is sequence-sharded
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        repeats = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(repeats, dim=2)
        v = v.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens [B, S] -> logits [B, S, V]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # not a buffer: module.to(bfloat16) would round the angles' cos/sin
        self._rope: dict[torch.device, torch.Tensor] = {}
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic under torch.manual_seed; output projections scaled by depth (GPT-2 style)."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight")):
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.num_layers))
            else:
                p.normal_(0.0, std)

    def rope(self, device: torch.device) -> torch.Tensor:
        """The RoPE tables in float32 on `device`, built once per device."""
        if device not in self._rope:
            self._rope[device] = rope_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta).to(device)
        return self._rope[device]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        rope = self.rope(tokens.device)
        for layer in self.layers:
            h = layer(h, rope)
        return self.output(self.norm(h))
