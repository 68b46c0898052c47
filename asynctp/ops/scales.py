"""fp8 operands of the scaled ops: argument checks (before any communication) and scale layouts.

Scale conventions are torch._scaled_mm's: a scale is the dequantization multiplier, float32,
    a_hp ~= a_fp8.float() * a_scale        b_hp ~= b_fp8.float() * b_scale
Shape legend (R = world size):
    a_scale   tensorwise: numel 1 (identical on every rank)
              rowwise:    a.shape[:-1] + (1,), sharded with a (one scale per row of a)
    b_scale   tensorwise: numel 1        per column: (1, N)
A rowwise scale goes through the same movedim/reshape as a (see layout.py), so scale row i
always belongs to row i of a_2d, and in the gather it travels with its rows.

Messages read "<argument> requires <what>, got <what was given>".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from asynctp.config import warn_once
from asynctp.ops.validate import check_dim, check_strategy, check_tensor

__all__ = [
    "FP8_DTYPES",
    "OUT_DTYPES",
    "CUDA_DIM_MULTIPLE",
    "is_rowwise",
    "column_major",
    "aligned",
    "expand_rows",
    "expand_cols",
    "check_all_gather_scaled_matmul",
    "check_scaled_matmul_reduce_scatter",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# bf16 for training, fp32 where the caller accumulates further; the CUTLASS rowwise kernel of
# some torch releases has no fp16 output, so fp16 is not offered
OUT_DTYPES = (torch.bfloat16, torch.float32)
REDUCE_OPS = ("sum", "avg")
# cuBLAS (and the CUTLASS rowwise kernel) read operands and scales with 16-byte vector loads
_SCALE_ALIGN = 16
# torch._scaled_mm on CUDA: mat1's K, and mat2's K and N, multiples of 16 (M is free)
CUDA_DIM_MULTIPLE = 16


def is_rowwise(a_scale: torch.Tensor, a: torch.Tensor) -> bool:
    """A scale of shape a.shape[:-1] + (1,) is rowwise, even when it has one element (a one-row
    shard's scale still differs per rank, so it must travel with its row)."""
    return tuple(a_scale.shape) == (*a.shape[:-1], 1)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy of it where its data pointer breaks the 16-byte alignment that
    cuBLAS wants for scales (a row slice of a scale starting at row i is 4 * i bytes in)."""
    if t.is_contiguous() and t.data_ptr() % _SCALE_ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def column_major(b: torch.Tensor) -> torch.Tensor:
    """b ([K, N]) in the layout cuBLAS's fp8 GEMM reads (b.t() contiguous, as weight.t() is);
    copied, with a one-time warning, where it is not. The CPU kernel takes either layout."""
    if b.device.type != "cuda" or (b.stride(0) == 1 and b.stride(1) >= max(1, b.shape[0])):
        return b
    warn_once(
        f"fp8-row-major-b:{tuple(b.shape)}",
        f"asynctp: a float8 b of shape {tuple(b.shape)} is row-major; cuBLAS needs it column-major "
        f"(pass weight_fp8.t() of a contiguous (N, K) weight), so it is copied on every call",
    )
    return b.t().contiguous().t()


def expand_rows(scale: torch.Tensor, m: int) -> torch.Tensor:
    """A tensorwise scale as an (m, 1) rowwise one: _scaled_mm pairs rowwise only with rowwise."""
    return scale.reshape(1, 1).expand(m, 1).contiguous()


def expand_cols(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A tensorwise scale as a (1, n) per-column one."""
    return scale.reshape(1, 1).expand(1, n).contiguous()


# -- checks ------------------------------------------------------------------------------------


def _check_fp8(name: str, t: Any, min_ndim: int) -> torch.Tensor:
    check_tensor(name, t, min_ndim=min_ndim)
    if t.dtype not in FP8_DTYPES:
        raise TypeError(f"{name} requires a float8 dtype {[str(d) for d in FP8_DTYPES]}, got {t.dtype}")
    return t


def _check_device(name: str, t: torch.Tensor, a: torch.Tensor) -> None:
    if t.device != a.device:
        raise ValueError(f"{name} requires device {a.device} (the device of a), got {t.device}")


def _check_scale_tensor(name: str, s: Any, a: torch.Tensor) -> torch.Tensor:
    check_tensor(name, s)
    if s.dtype != torch.float32:
        raise TypeError(f"{name} requires dtype torch.float32 (a dequantization multiplier), got {s.dtype}")
    _check_device(name, s, a)
    return s


def _check_a_scale(name: str, s: Any, a: torch.Tensor, a_name: str) -> bool:
    """Returns whether the scale is rowwise."""
    _check_scale_tensor(name, s, a)
    if is_rowwise(s, a):
        return True
    if s.numel() != 1:
        rowwise = (*a.shape[:-1], 1)
        raise ValueError(
            f"{name} requires numel 1 (tensorwise) or shape {rowwise} ({a_name}.shape[:-1] + (1,), "
            f"rowwise), got shape {tuple(s.shape)}"
        )
    return False


def _check_b_scale(name: str, s: Any, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    _check_scale_tensor(name, s, a)
    n = b.shape[1]
    if tuple(s.shape) != (1, n) and s.numel() != 1:
        raise ValueError(
            f"{name} requires numel 1 (tensorwise) or shape (1, {n}) (per column), got shape {tuple(s.shape)}"
        )
    return s


def _check_b(name: str, b: Any, a: torch.Tensor, k: int) -> torch.Tensor:
    _check_fp8(name, b, 0)
    if b.ndim != 2:
        raise ValueError(f"{name} requires a 2-D (K, N) matrix, got shape {tuple(b.shape)}")
    _check_device(name, b, a)
    if b.shape[0] != k:
        raise ValueError(f"{name} requires shape[0] == K = {k} (a's last dim), got {tuple(b.shape)}")
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise TypeError(
            f"{name} requires float8_e4m3fn when a is float8_e5m2 (cuBLAS has no e5m2 x e5m2 GEMM), got {b.dtype}"
        )
    return b


def _check_bias(name: str, bias: Any, n: int, a: torch.Tensor, out_dtype: torch.dtype) -> None:
    check_tensor(name, bias)
    if tuple(bias.shape) != (n,):
        raise ValueError(f"{name} requires shape ({n},) (b's N), got {tuple(bias.shape)}")
    if bias.dtype != out_dtype:
        raise TypeError(f"{name} requires dtype {out_dtype} (out_dtype), got {bias.dtype}")
    _check_device(name, bias, a)


def _check_out_dtype(out_dtype: Any) -> torch.dtype:
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype requires a torch.dtype, got {type(out_dtype).__name__}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype requires one of {[str(d) for d in OUT_DTYPES]}, got {out_dtype}")
    return out_dtype


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} requires a bool, got {type(value).__name__}")


def _check_list(name: str, value: Any, what: str) -> list:
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} requires a list of {what}, got {type(value).__name__}")
    return list(value)


def _check_cuda_dims(a: torch.Tensor, sizes: Sequence[tuple[str, int]]) -> None:
    """torch._scaled_mm's CUDA rule (K and N multiples of 16), checked before communicating."""
    if a.device.type != "cuda":
        return
    for what, size in sizes:
        if size % CUDA_DIM_MULTIPLE:
            raise ValueError(
                f"{what} requires a multiple of {CUDA_DIM_MULTIPLE} (torch._scaled_mm on CUDA), got {size}"
            )


def check_all_gather_scaled_matmul(
    a_shard: Any,
    bs: Any,
    a_scale: Any,
    b_scales: Any,
    gather_dim: Any,
    world_size: int,
    out_dtype: Any,
    biases: Any,
    use_fast_accum: Any,
    return_a: Any,
    strategy: Any,
) -> tuple[int, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None], bool]:
    """Returns (normalized gather_dim, bs, b_scales, biases, whether a_scale is rowwise)."""
    _check_fp8("a_shard", a_shard, 2)
    dim = check_dim("gather_dim", gather_dim, a_shard.ndim)
    k_mode = dim == a_shard.ndim - 1
    k = a_shard.shape[-1] * (world_size if k_mode else 1)
    bs = _check_list("bs", bs, "(K, N) float8 tensors")
    if not bs:
        raise ValueError("bs requires at least one (K, N) matrix, got an empty list")
    for i, b in enumerate(bs):
        _check_b(f"bs[{i}]", b, a_shard, k)
    rowwise = _check_a_scale("a_scale", a_scale, a_shard, "a_shard")
    b_scales = _check_list("b_scales", b_scales, "float32 scales (one per b)")
    if len(b_scales) != len(bs):
        raise ValueError(f"b_scales requires one scale per b ({len(bs)}), got {len(b_scales)}")
    for i, (s, b) in enumerate(zip(b_scales, bs)):
        _check_b_scale(f"b_scales[{i}]", s, b, a_shard)
    out_dtype = _check_out_dtype(out_dtype)
    if biases is None:
        biases = [None] * len(bs)
    biases = _check_list("biases", biases, "(N,) tensors or None (one per b)")
    if len(biases) != len(bs):
        raise ValueError(f"biases requires one entry per b ({len(bs)}), got {len(biases)}")
    for i, (bias, b) in enumerate(zip(biases, bs)):
        if bias is not None:
            _check_bias(f"biases[{i}]", bias, b.shape[1], a_shard, out_dtype)
    _check_bool("use_fast_accum", use_fast_accum)
    _check_bool("return_a", return_a)
    check_strategy(strategy)
    k_name = "K per rank (a_shard's last dim, the gather dim)" if k_mode else "K (a_shard's last dim)"
    _check_cuda_dims(a_shard, [(k_name, a_shard.shape[-1])] + [(f"bs[{i}]'s N", b.shape[1]) for i, b in enumerate(bs)])
    return dim, bs, b_scales, biases, rowwise


def check_scaled_matmul_reduce_scatter(
    a: Any,
    b: Any,
    a_scale: Any,
    b_scale: Any,
    scatter_dim: Any,
    world_size: int,
    out_dtype: Any,
    bias: Any,
    reduce_op: Any,
    use_fast_accum: Any,
    strategy: Any,
) -> tuple[int, bool]:
    """Returns (normalized scatter_dim, whether a_scale is rowwise)."""
    _check_fp8("a", a, 2)
    _check_b("b", b, a, a.shape[-1])
    rowwise = _check_a_scale("a_scale", a_scale, a, "a")
    _check_b_scale("b_scale", b_scale, b, a)
    dim = check_dim("scatter_dim", scatter_dim, a.ndim)
    n_mode = dim == a.ndim - 1
    size = b.shape[1] if n_mode else a.shape[dim]
    if size % world_size:
        raise ValueError(
            f"scatter_dim {scatter_dim} requires a size divisible by the world size {world_size}, got {size}"
        )
    out_dtype = _check_out_dtype(out_dtype)
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"reduce_op requires one of {list(REDUCE_OPS)}, got {reduce_op!r}")
    if bias is not None:
        _check_bias("bias", bias, b.shape[1], a, out_dtype)
    _check_bool("use_fast_accum", use_fast_accum)
    check_strategy(strategy)
    n = b.shape[1] // world_size if n_mode else b.shape[1]
    n_name = "N per rank (b's N / R, the scatter dim)" if n_mode else "N (b's last dim)"
    _check_cuda_dims(a, [("K (a's last dim)", a.shape[-1]), (n_name, n)])
    return dim, rowwise
