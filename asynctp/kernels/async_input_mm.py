"""async_input_mm: one persistent GEMM whose A rows arrive in chunks, each announced by a flag.

Shape legend (R = ranks, S = blocks per rank's chunk, n = R * S chunks):
    a          [M, K]     rows of every chunk, chunk c = rows c * chunk_rows : (c + 1) * chunk_rows
    b          [K, N]     any (K, N) view: row-major, or nn.Linear's weight.t() (column-major)
    out        [M, N]     out = a @ b (fp8: scaled, torch._scaled_mm semantics), one rounding
    signals    n flags    chunk c's rows may be read once signals[c] != 0

The GEMM visits chunks in the order pivot, pivot + 1, ... (mod n) and, before a tile's mainloop,
spins on its chunk's flag (an acquire load at system scope: the flag is written by a peer's
stream memory operation after a copy-engine transfer). Nothing it waits for needs an SM, so it
may hold every SM without deadlock: the producers must be copy engines and stream writes.

A chunk map serves the fused all-gather -> matmul (asynctp.ops): chunk c = (src, blk) =
divmod(c, S) reads A rows src * m + blk * chunk_rows of the workspace, its flag at signals +
src * sig_src + blk * sig_blk, and writes out rows src * out_src + blk * out_blk (front order:
out_src = m; batch-major runs: out_src = segment, out_blk = R * segment), so outputs land in the
caller's row order; the local source's flags (src == local_src) are never awaited.
With `counters` (int32, zeroed, one per chunk) the last tile of a chunk resets its flag to 0, so
the flags are ready for the next call without a host-side write.

Two kernels compute the same values in the same order (bit-equal, the Triton one's last wave
unsplit): a Gluon one (kernels/_ag_gluon.py: a hand-written TMA/wgmma pipeline that loads the
next tile's first K-steps under this tile's epilogue where that tile needs no wait) for 16-bit
operands, and fp8 ones with b as weight.t(), in chunks of whole 128x256 tiles; and the Triton one
(kernels/_ag_kernel.py) for fp8 with b [K, N], ragged chunks, other tile shapes, short grids whose
last wave it splits along K (SPLIT_WAVES), or where Gluon fails to build (a warning says so, once).

On CPU tensors `async_input_mm` runs a plain-torch reference in the same chunk order (exactly
a @ b per chunk), which CI tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asynctp.config import get_config
from asynctp.kernels.configs import Config, gluon_takes, pick_config, split_parts, whole_tile
from asynctp.kernels.triton_util import sm_count, triton_available

__all__ = ["async_input_mm", "ChunkMap", "chunk_order", "programs"]


def programs(device: torch.device) -> int:
    """The persistent GEMMs' programs on `device`: one per SM, less ASYNCTP_SM_CARVEOUT (unset: none
    for the fused strategy, as runtime/carveout.py's defaults, which kernels/ may not import), at
    least one. SMs left free let kernels of other streams (NCCL's, the caller's) start beside a GEMM
    whose programs otherwise hold every SM until it ends."""
    return max(1, sm_count(device) - (get_config().sm_carveout or 0))


@dataclass(frozen=True)
class ChunkMap:
    """Where chunk c = (src, blk) = divmod(c, blocks) lives (see the module docstring)."""

    blocks: int = 1  # S: blocks per source rank
    local_src: int = -1  # the source whose flags are never awaited: its rows read from a_local, or staged (-1: none)
    out_src: int | None = None  # output row stride per source (None: rows_per_src)
    out_blk: int | None = None  # output row stride per block (None: chunk_rows)


def chunk_order(num_chunks: int, pivot: int) -> list[int]:
    """The order in which the GEMM visits chunks: pivot, pivot + 1, ... (mod num_chunks)."""
    return [(pivot + i) % num_chunks for i in range(num_chunks)]


def _check(a: torch.Tensor, b: torch.Tensor, signals: torch.Tensor, pivot: int) -> int:
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"async_input_mm requires 2-D a and b, got {a.ndim}-D and {b.ndim}-D")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"async_input_mm requires a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    n = signals.numel()
    if n < 1 or a.shape[0] % n:
        raise ValueError(f"async_input_mm requires M divisible by the number of chunk signals, got M {a.shape[0]} "
                         f"and {n} signals")
    if not 0 <= pivot < n:
        raise ValueError(f"async_input_mm requires 0 <= pivot < {n}, got {pivot}")
    return n


def async_input_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_chunk_signals: torch.Tensor,
    a_chunk_pivot: int,
    *,
    out: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """out = a @ b, computed chunk by chunk from `a_chunk_pivot` on, each chunk's rows read only
    once its flag in `a_chunk_signals` (n flags, int32/uint32, M divisible by n) is non-zero.

    Equivalent to the following plain PyTorch code (once every flag is set)::

        out = a @ b                                        # bf16 / fp16
        out = torch._scaled_mm(a, b, a_scale, b_scale, bias, out_dtype)   # fp8

    fp8: a_scale numel 1 (tensorwise) or [M, 1] (rowwise), b_scale numel 1 or [1, N], fp32;
    fp32 accumulation, scales and bias in the epilogue, one rounding. The flags are not reset.
    """
    n = _check(a, b, a_chunk_signals, a_chunk_pivot)
    scaled = a_scale is not None
    if scaled != (b_scale is not None):
        raise ValueError("async_input_mm requires both a_scale and b_scale or neither")
    dtype = out_dtype or (torch.bfloat16 if scaled else a.dtype)
    m, k = a.shape
    if out is None:
        out = torch.empty((m, b.shape[1]), dtype=dtype, device=a.device)
    if a.device.type != "cuda":
        return _reference(a, b, n, a_chunk_pivot, out, a_scale, b_scale, bias)
    chunk_rows = m // n
    target = tma_ready(out)
    launch(tma_ready(a), tma_ready(b), target, a_chunk_signals.view(-1), (n, 1, 0), chunk_rows, a_chunk_pivot,
           ChunkMap(), a_scale=a_scale, b_scale=b_scale, bias=bias, config=config)
    if target is not out:
        out.copy_(target)
    return out


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it whose rows start 16-byte aligned (TMA's rule; the copy's row pitch is
    padded): ragged widths such as N = 300 in bf16 need it. Keeps weight.t() column-major."""
    if t.stride(0) == 1 and t.ndim == 2 and t.shape[1] > 1:  # weight.t(): align the weight
        return tma_ready(t.t()).t()
    pitch_ok = (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(1) == 1
    if pitch_ok and t.data_ptr() % 16 == 0:
        return t
    per_row = 16 // t.element_size()
    cols = -(-t.shape[1] // per_row) * per_row
    padded = t.new_empty((t.shape[0], cols))[:, : t.shape[1]]
    return padded.copy_(t)


def _reference(a, b, n, pivot, out, a_scale, b_scale, bias) -> torch.Tensor:
    """The CPU path: the same chunk order, each chunk's rows exactly a[rows] @ b."""
    rows = a.shape[0] // n
    for c in chunk_order(n, pivot):
        lo, hi = c * rows, (c + 1) * rows
        if a_scale is None:
            prod = a[lo:hi] @ b
            out[lo:hi] = prod if bias is None else prod + bias
            continue
        acc = a[lo:hi].float() @ b.float()
        sa = a_scale.float().reshape(-1)[lo:hi, None] if a_scale.numel() > 1 else a_scale.float().reshape(())
        acc = acc * sa * b_scale.float().reshape(1, -1 if b_scale.numel() > 1 else 1)
        if bias is not None:
            acc = acc + bias.float()
        out[lo:hi] = acc.to(out.dtype)
    return out


_gluon_failed: str | None = None  # why the Gluon kernel cannot run in this process (None: it may)


# the Triton kernel's split last wave beats the Gluon kernel's whole tiles below this many full
# waves (one H100, 128x256 tiles: 3 full waves + 52 tiles, 4096x3584x8192: 312.9 us split against
# 330.4; 27 full waves + 20, 8192x14336x4096: 1473.1 against 1388.2; the split saves part of one
# wave, the Gluon kernel 3-4% of every wave)
SPLIT_WAVES = 6


def _gluon_serves(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scaled: bool, chunk_rows: int,
                  cfg: Config, num_sms: int) -> bool:
    """The Gluon kernel takes the operands (configs.gluon_takes) in chunks of whole tiles, where it
    has not failed to build and the Triton kernel would not split a last wave of a short grid
    (SPLIT_WAVES)."""
    if not (gluon_takes(a, b, out, scaled, cfg, half_out=True) and chunk_rows % cfg.block_m == 0
            and _gluon_failed is None):
        return False
    tiles = a.shape[0] // cfg.block_m * -(-out.shape[1] // cfg.block_n)
    split = cfg.split and split_parts(tiles, num_sms, -(-a.shape[1] // cfg.block_k)) > 1
    return not (split and tiles // num_sms < SPLIT_WAVES)


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    signals: torch.Tensor | None,
    sig_strides: tuple[int, int, int],
    chunk_rows: int,
    pivot: int,
    cmap: ChunkMap,
    *,
    a_local: torch.Tensor | None = None,
    a_local_scale: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: Config | None = None,
    gluon: bool | None = None,
    gathered: torch.Tensor | None = None,
) -> bool:
    """Launch the GEMM (CUDA tensors, arguments already checked by the caller). Returns whether
    it also wrote `gathered` (the rows [R * m, K] in out's row order, stored from the a tiles the
    GEMM loads: the Gluon kernel only; otherwise the caller copies them).

    sig_strides: (number of chunks n, flag stride per source, flag stride per block), in flags;
    signals None: no waits (every row already in place). a: the workspace rows (rank-major);
    a_local: the local source's rows (cmap.local_src), read in place of a's (no staging copy);
    a_local_scale: their rowwise scales (default: their rows of a_scale). gluon: None picks the
    Gluon kernel where it serves, False the Triton kernel (tests), True the Gluon kernel's
    failures raise."""
    global _gluon_failed
    from asynctp.kernels import _ag_kernel as kern

    n, sig_src, sig_blk = sig_strides
    m_total, k = a.shape
    nn_ = b.shape[1]
    cfg = config or pick_config(a.dtype, m_total, nn_, k, chunk_rows)
    b, b_trans = kern.b_operand(b)  # nn.Linear's weight.t() read as [N, K] row-major
    num_sms = programs(a.device)
    args = (a, b, b_trans, out, signals, n, sig_src, sig_blk, chunk_rows, pivot, cmap, counters, a_scale, b_scale, bias)
    if gluon is not False and _gluon_serves(a, b, out, a_scale is not None or b_scale is not None, chunk_rows, cfg,
                                            num_sms):
        from asynctp.kernels import _ag_gluon

        run = lambda: _ag_gluon.launch(*args, cfg, num_sms, a_local=a_local,  # noqa: E731
                                       a_local_scale=a_local_scale, a_gathered=gathered)
        ran, _, _gluon_failed = kern.try_gluon(run, bool(gluon), "the all-gather")
        if ran:
            return gathered is not None
    # the Triton kernel stages a whole output tile: a Gluon-only deeper ring runs with fewer stages
    kern.launch(*args, whole_tile(cfg, a.element_size(), out.element_size()), num_sms, a_local=a_local,
                a_local_scale=a_local_scale)
    return False


def available(a: torch.Tensor, chunk_rows: int, config: Config | None = None) -> str | None:
    """None where the GEMM can run on `a`'s device for chunks of `chunk_rows`, else why not."""
    if a.device.type != "cuda":
        return "the GEMM runs on CUDA devices only"
    if not triton_available():
        return "Triton is not installed"
    if torch.cuda.get_device_capability(a.device) < (9, 0):
        return "the GEMM needs TMA (sm_90 or newer)"
    cfg = config or pick_config(a.dtype, chunk_rows, 1, a.shape[1], chunk_rows)
    if chunk_rows % cfg.block_m:
        return f"chunks of {chunk_rows} rows are not a multiple of the {cfg.block_m}-row tile"
    return None
