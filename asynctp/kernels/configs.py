"""Tile configurations of the persistent GEMMs: a small table per operand type, and a tuner
that times the candidates once per problem and remembers the fastest."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace

import torch

__all__ = ["Config", "split_parts", "gluon_fits", "gluon_takes", "whole_tile", "candidates", "pick_config", "remember",
           "load_tuned", "save_tuned", "tuned", "tune"]


@dataclass(frozen=True)
class Config:
    """One tile shape of the persistent GEMM (Triton meta-parameters)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8  # m-tiles per group of the tile order (L2 reuse of b)
    stages: int = 3  # software-pipelining depth of the K loop
    warps: int = 8
    flatten: bool = True  # one software pipeline across the tile loop and the K loop
    split: bool = True  # split the tiles of a last, partial wave along K (split_parts)


def split_parts(tiles: int, num_sms: int, k_tiles: int) -> int:
    """Into how many K-parts the tiles of the last wave are split (1: none). A persistent grid
    of num_sms programs runs tiles // num_sms full waves and then a partial one that leaves SMs
    idle (448 128x256 tiles on 132 SMs: 52 tiles in a fourth wave, 80 SMs idle); split into
    parts, the last wave's tiles keep more SMs busy for a fraction of a tile's time. Two parts
    at most (four measured slower than none at 8192x14336x4096 on an H100: 1448 against 1393
    us); each keeps at least 4 K-tiles, so its software pipeline still fills."""
    tail = tiles % num_sms
    if tail == 0:
        return 1
    parts = min(num_sms // tail, 2, k_tiles // 4)
    return parts if parts >= 2 else 1


def gluon_fits(cfg: Config, itemsize: int, out_itemsize: int = 2, half_out: bool = False) -> bool:
    """Whether a Gluon GEMM's ring (cfg.stages K-steps of a's and b's tiles) and its epilogue
    buffer (one output tile, or half of one: half_out) fit Hopper's 227 KiB of shared memory,
    less 2 KiB for barriers and layout scratch."""
    ring = cfg.stages * (cfg.block_m + cfg.block_n) * cfg.block_k * itemsize
    return ring + cfg.block_m * cfg.block_n * out_itemsize // (2 if half_out else 1) <= 227 * 1024 - 2048


def gluon_takes(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scaled: bool, cfg: Config,
                half_out: bool = False) -> bool:
    """Whether the Gluon GEMMs take these operands with cfg: on CUDA, 16-bit ones (out too)
    without scales, or fp8 e4m3 ones with b as nn.Linear's weight.t() (wgmma reads fp8 K-major),
    any scales and bf16 out, where the ring and epilogue buffer fit shared memory (half_out: the
    all-gather's GEMM stages half an output tile where a whole one does not fit); 128x256 tiles
    on 8 warps."""
    fits = gluon_fits(cfg, a.element_size(), out.element_size(), half_out)
    sixteen = a.dtype in (torch.bfloat16, torch.float16) and out.dtype == a.dtype and not scaled
    fp8 = a.dtype == torch.float8_e4m3fn and out.dtype == torch.bfloat16 and b.stride(0) == 1 and b.shape[1] > 1
    return a.is_cuda and fits and (sixteen or fp8) and b.dtype == a.dtype and (
        cfg.block_m, cfg.block_n, cfg.warps) == (128, 256, 8)


# Shapes that fit Hopper's 227 KiB of shared memory with the epilogue's staging buffer, and last
# the all-gather's Gluon GEMM with a 4-stage ring beside half an output tile (other kernels stage a
# whole tile: they run it with 3 stages, whole_tile; the reduce-scatter's tuning skips it).
_TABLE: dict[str, list[Config]] = {
    "16bit": [Config(128, 256, 64, stages=3, warps=8), Config(64, 256, 64, stages=4, warps=4),
              Config(128, 256, 64, stages=3, warps=8, flatten=False),
              Config(128, 256, 64, stages=3, warps=8, split=False),
              Config(128, 256, 64, stages=4, warps=8, split=False)],
    "fp8": [Config(128, 256, 128, stages=3, warps=8), Config(128, 128, 128, stages=4, warps=4),
            Config(256, 128, 128, stages=3, warps=8), Config(128, 256, 128, stages=3, warps=8, split=False),
            Config(128, 256, 128, stages=4, warps=8, split=False)],
}

_tuned: dict[tuple, Config] = {}


def whole_tile(cfg: Config, itemsize: int, out_itemsize: int = 2) -> Config:
    """cfg for the kernels that stage a whole output tile beside their ring (the Triton kernels,
    the reduce-scatter's Gluon GEMM): cfg where both fit shared memory (gluon_fits), else with as
    many stages fewer as it takes."""
    stages = cfg.stages
    while stages > 2 and not gluon_fits(replace(cfg, stages=stages), itemsize, out_itemsize):
        stages -= 1
    return cfg if stages == cfg.stages else replace(cfg, stages=stages)


def _kind(dtype: torch.dtype) -> str:
    return "fp8" if dtype.itemsize == 1 else "16bit"


def candidates(dtype: torch.dtype, whole: bool = False) -> list[Config]:
    """The configurations worth timing for operands of `dtype`, the default first; whole: only
    those that stage a whole output tile as they are (whole_tile)."""
    table = _TABLE[_kind(dtype)]
    return [c for c in table if whole_tile(c, dtype.itemsize) == c] if whole else list(table)


def _key(dtype: torch.dtype, m: int, n: int, k: int, scatter: bool = False) -> tuple:
    """A problem's key: the reduce-scatter's producer tunes apart from the all-gather's GEMM."""
    return (_kind(dtype) + ("-rs" if scatter else ""), m, n, k)


def pick_config(dtype: torch.dtype, m: int, n: int, k: int, chunk_rows: int | None = None,
                scatter: bool = False) -> Config:
    """The tuned configuration of this problem (scatter: the reduce-scatter's) if one was timed,
    else the table's default whose tile divides the chunks (so no tile spans two chunks)."""
    cfg = _tuned.get(_key(dtype, m, n, k, scatter))
    if cfg is not None and (chunk_rows is None or chunk_rows % cfg.block_m == 0):
        return cfg
    for cfg in candidates(dtype):
        if chunk_rows is None or chunk_rows % cfg.block_m == 0:
            return cfg
    return candidates(dtype)[0]


def remember(dtype: torch.dtype, m: int, n: int, k: int, cfg: Config, scatter: bool = False) -> None:
    _tuned[_key(dtype, m, n, k, scatter)] = cfg


def tuned() -> dict[str, dict]:
    """The remembered choices, JSON-ready (kind, M, N, K -> config)."""
    return {"/".join(map(str, key)): asdict(cfg) for key, cfg in _tuned.items()}


def load_tuned(path: str) -> None:
    """Adopt the choices saved by `save_tuned` (a missing file is no error)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        for key, fields in json.load(f).items():
            kind, m, n, k = key.split("/")
            _tuned[(kind, int(m), int(n), int(k))] = Config(**fields)


def save_tuned(path: str) -> None:
    """Write the remembered choices to `path` (atomically: ranks of one host may write at once)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(tuned(), f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def tune(dtype: torch.dtype, m: int, n: int, k: int, chunk_rows: int, time_us, path: str | None = None,
         scatter: bool = False) -> Config:
    """The fastest candidate for this problem, timed once: `time_us(cfg)` runs the GEMM with cfg
    and returns its median time (raising where cfg cannot run). Remembered for the process and,
    with `path`, saved there and read back by later processes (the first use of a shape on a
    machine pays the compiles and timings). Candidates whose tile does not divide the chunks are
    skipped; scatter: the reduce-scatter producer's problem (whole-tile candidates, its own key)."""
    key = _key(dtype, m, n, k, scatter)
    if path is not None and key not in _tuned:
        load_tuned(path)
    if key in _tuned and chunk_rows % _tuned[key].block_m == 0:
        return _tuned[key]
    best, best_us = None, float("inf")
    for cfg in candidates(dtype, whole=scatter):
        if chunk_rows % cfg.block_m:
            continue
        try:
            us = time_us(cfg)
        except Exception:  # a candidate that does not compile or fit this GPU is not a choice
            continue
        if us < best_us:
            best, best_us = cfg, us
    best = best or pick_config(dtype, m, n, k, chunk_rows, scatter)
    remember(dtype, m, n, k, best, scatter)
    if path is not None:
        save_tuned(path)
    return best
