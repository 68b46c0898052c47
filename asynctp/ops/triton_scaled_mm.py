"""An fp8 GEMM with the reduce-scatter's addition in its epilogue (Triton), for measurement.

    out = (a @ b) * a_scale * b_scale + addend      (fp32 accumulation, one rounding to out's dtype)

Why: on 2 ranks the fp8 reduce-scatter adds each own block's partial to the partial its peer
pushed in a separate elementwise kernel, because torch._scaled_mm has no accumulate epilogue.
cuBLAS's GEMMs are persistent (they hold every SM until their tail), so those additions run
after the last GEMM: 21 + 12 us of a ~237 us call at M 4096 on 2xH200 (eleventh session's trace,
benchmarks/results/NOTES.md), a good part of what keeps the op below 0.9 efficiency. A GEMM that
adds the received partial as it stores its tile removes them, if it is about as fast as cuBLAS.

Status: NOT used by the ops; measured slower. Twelfth session, H200, K 3584 x N 8192
(`benchmarks/probe_fp8_epilogue.py`, benchmarks/results/session12_2026-11-22/): the best precise
config took 73 / 138 / 270 us at rows 1024 / 2048 / 4096 (rowwise) against 65 / 118 / 242 for
torch._scaled_mm + the addition (1.1-1.2x slower over two runs and both scale kinds), and the
2-rank fp8 reduce-scatter with ASYNCTP_FP8_EPILOGUE=1 took 179 / 250 / 461 us at seed M 2048 / 4096 / 8192
against 129 / 227 / 427 without. Numerics differ from the serial reference (which rounds the
partial to bf16 before the sum) by one rounding, and by how the tensor cores accumulate:

Accumulation (config key PROMOTE_K). Hopper's fp8 MMA accumulates in reduced precision; Triton's
default for fp8 dots on sm_90 never moves the sum to fp32 registers (max_num_imprecise_acc =
2^30), like cuBLAS with use_fast_accum=True. Under that default every tile config failed the
probe's one-rounding check: worst element 58.6 of its units against cuBLAS's 8.4 (cuBLAS with
use_fast_accum: 58.6 too). PROMOTE_K = n adds the tensor cores' partial sum to an fp32
accumulator every n elements of K (0: after every MMA instruction; BLOCK_K: once per loop step,
the default, which matched cuBLAS's error); None keeps the fast accumulation (what the ops pass
for use_fast_accum=True). Runs under TRITON_INTERPRET=1 on CPU (the tests; the variable must be
set before triton is first imported), which accumulates in fp32 whatever PROMOTE_K says.

Operands: a [M, K] float8 (any strides; row-major is the fast layout), b [K, N] float8 (column-major
is the fast layout, as torch._scaled_mm requires), a_scale float32 with numel 1 or shape [M, 1],
b_scale float32 with numel 1 or shape [1, N], addend [M, N] or None, out [M, N] bf16 / fp16 / fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["scaled_mm_add", "default_config"]


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile (pid_m, pid_n): tiles in groups of GROUP_M rows of tiles, so
    neighbouring programs share b's columns in L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, add_ptr, out_ptr, s_sa, s_sb, s_addm, s_addn, s_om, s_on,
              HAS_ADD: tl.constexpr):
    """Scale the fp32 tile (stride 0 broadcasts a tensorwise scale), add the addend's tile, round
    once, store the rows and columns inside [M, N]."""
    sa = tl.load(sa_ptr + (offs_m % M) * s_sa)
    sb = tl.load(sb_ptr + (offs_n % N) * s_sb)
    acc = acc * sa[:, None] * sb[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_ADD:
        acc += tl.load(add_ptr + offs_m[:, None] * s_addm + offs_n[None, :] * s_addn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * s_om + offs_n[None, :] * s_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scaled_mm_add_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, add_ptr, out_ptr,
    M, N,
    s_am, s_ak, s_bk, s_bn, s_sa, s_sb, s_addm, s_addn, s_om, s_on,
    K: tl.constexpr,  # a compile-time trip count (one kernel per inner dim: a model has few)
    HAS_ADD: tl.constexpr,
    PROMOTE_K: tl.constexpr,  # see the module docstring
    EVEN_K: tl.constexpr,  # K a multiple of BLOCK_K: no masks in the loop
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m % M  # out-of-range rows / columns read row 0 / column 0; their results are not stored
    cols = offs_n % N
    a_ptrs = a_ptr + rows[:, None] * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + offs_k[:, None] * s_bk + cols[None, :] * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_K)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk

    _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, add_ptr, out_ptr, s_sa, s_sb, s_addm, s_addn, s_om, s_on,
              HAS_ADD)


@triton.jit
def _scaled_mm_add_tma_kernel(
    a_desc, bt_desc, sa_ptr, sb_ptr, add_ptr, out_ptr,
    M, N,
    s_sa, s_sb, s_addm, s_addn, s_om, s_on,
    K: tl.constexpr,
    HAS_ADD: tl.constexpr,
    PROMOTE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The kernel above with a and b read by the tensor memory accelerator (host-made
    descriptors over a [M, K] and b^T [N, K], both K-contiguous; tiles past the edges read zeros)."""
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        bt = bt_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
        acc = tl.dot(a, bt.T, acc, max_num_imprecise_acc=PROMOTE_K)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, add_ptr, out_ptr, s_sa, s_sb, s_addm, s_addn, s_om, s_on,
              HAS_ADD)


def default_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tile sizes for Hopper at the reduce-scatter's block shapes: among the fastest precise
    configs of `benchmarks/probe_fp8_epilogue.py` on an H200 at rows 1024-4096 x K 3584 x N 8192
    (twelfth session; 128 x 256 tiles with 8 warps, the fastest with fast accumulation, took about
    twice as long with the fp32 promotion)."""
    return {"BLOCK_M": 256 if m > 128 else 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
            "num_warps": 8, "num_stages": 3}


def scaled_mm_add(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    addend: torch.Tensor | None,
    out: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """out = (a @ b) * a_scale * b_scale (+ addend), see the module docstring; returns out.
    config: BLOCK_M / BLOCK_N / BLOCK_K / GROUP_M, num_warps / num_stages, PROMOTE_K (default
    BLOCK_K; None: fast accumulation) and TMA=1 for the kernel that reads a and b through tensor
    descriptors (default_config() when None)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"scaled_mm_add requires a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    n = b.shape[1]
    if a.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or b.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"scaled_mm_add requires float8 a and b, got {a.dtype} and {b.dtype}")
    if tuple(out.shape) != (m, n) or (addend is not None and tuple(addend.shape) != (m, n)):
        raise ValueError(f"scaled_mm_add requires out and addend of shape {(m, n)}, got "
                         f"{tuple(out.shape)} and {None if addend is None else tuple(addend.shape)}")
    for name, t in (("a", a), ("b", b), ("out", out), ("addend", addend)):
        # the kernels index in int32: element offsets (strides included) must stay below 2^31
        if t is not None and sum((size - 1) * abs(st) for size, st in zip(t.shape, t.stride())) >= 2**31:
            raise ValueError(f"scaled_mm_add requires {name} to span under 2^31 elements (int32 offsets), "
                             f"got shape {tuple(t.shape)} strides {t.stride()}")
    s_sa = _scale_stride(a_scale, (m, 1), "a_scale", 0)
    s_sb = _scale_stride(b_scale, (1, n), "b_scale", 1)
    cfg = dict(config or default_config(m, n, k))
    tma = bool(cfg.pop("TMA", 0))
    meta = {key: cfg.pop(key) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
    meta["PROMOTE_K"] = cfg.pop("PROMOTE_K", meta["BLOCK_K"])
    if meta["PROMOTE_K"] is not None and not 0 <= meta["PROMOTE_K"] <= meta["BLOCK_K"]:
        raise ValueError(f"scaled_mm_add requires PROMOTE_K in [0, BLOCK_K] or None, got {meta['PROMOTE_K']}")
    grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    add = addend if addend is not None else out  # not read without HAS_ADD
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        bt = b.t()
        if a.stride(1) != 1 or bt.stride(1) != 1 or a.stride(0) % 16 or bt.stride(0) % 16:
            raise ValueError("scaled_mm_add with TMA requires a row-major a and a column-major b with rows of "
                             f"16-byte multiples, got strides {a.stride()} and {b.stride()}")
        _scaled_mm_add_tma_kernel[grid](
            TensorDescriptor.from_tensor(a, [meta["BLOCK_M"], meta["BLOCK_K"]]),
            TensorDescriptor.from_tensor(bt, [meta["BLOCK_N"], meta["BLOCK_K"]]),
            a_scale, b_scale, add, out, m, n, s_sa, s_sb, add.stride(0), add.stride(1), out.stride(0), out.stride(1),
            K=k, HAS_ADD=addend is not None, **meta, **cfg,
        )
        return out
    _scaled_mm_add_kernel[grid](
        a, b, a_scale, b_scale, add, out, m, n,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), s_sa, s_sb,
        add.stride(0), add.stride(1), out.stride(0), out.stride(1),
        K=k, HAS_ADD=addend is not None, EVEN_K=k % meta["BLOCK_K"] == 0, **meta, **cfg,
    )
    return out


def _scale_stride(scale: torch.Tensor, vector: tuple[int, int], name: str, dim: int) -> int:
    """The stride that walks the scale along its vector dim (0: one value for all)."""
    if scale.dtype != torch.float32:
        raise TypeError(f"scaled_mm_add requires a float32 {name}, got {scale.dtype}")
    if scale.numel() == 1:
        return 0
    if tuple(scale.shape) != vector:
        raise ValueError(f"scaled_mm_add requires {name} of numel 1 or shape {vector}, got {tuple(scale.shape)}")
    return scale.stride(dim)
