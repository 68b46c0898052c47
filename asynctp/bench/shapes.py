"""The benchmark's shape sets: per-rank problem sizes of the two TP patterns, from the world size.

Every row is named "M x N x K" (R = world size):

    gather rows  (all_gather_matmul and its fp8 twin)
        a_shard  [M / R, K]   this rank's slice of the sequence, gathered on dim 0
        b        [K, N]       this rank's column-parallel weight shard (num_bs matrices of
                              N / num_bs columns each when the layer has several, e.g. w1 + w3)
        out      [M, N]
    scatter rows (matmul_reduce_scatter and its fp8 twin)
        a        [M, N]       this rank's activation, its features sharded
        b        [N, K]       this rank's row-parallel weight shard
        out      [M / R, K]   reduce-scatter of a @ b on dim 0

Both patterns do 2 * M * N * K FLOPs per rank and move M * K elements through the collective.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Shape", "SHAPE_SETS", "GPU_SETS", "KINDS", "shapes_for", "expand_sets"]

KINDS = ("gather", "scatter")
SHAPE_SETS = ("seed", "llama8b", "llama70b", "small", "tiny")
# what `--shapes all` means: every set sized for a GPU (tiny is the CPU smoke set)
GPU_SETS = ("seed", "llama8b", "llama70b", "small")


@dataclass(frozen=True)
class Shape:
    """One benchmark row's problem size, per rank (see the module docstring for the layouts)."""

    shape_set: str  # the set it belongs to ("seed", "llama8b", ...)
    layer: str  # the model layer it stands for ("qkv", "w13", "wo", "w2"), "" for synthetic rows
    m: int  # total rows: tokens of the whole sequence (gathered / before the scatter)
    n: int  # per-rank columns of the gather matmul's output / the scatter matmul's inner dim
    k: int  # the gather matmul's inner dim / the scatter output's columns
    num_bs: int = 1  # gather rows: how many matrices share the gather (n split evenly)

    @property
    def dims(self) -> str:
        """The "MxNxK" label used in tables and file rows."""
        return f"{self.m}x{self.n}x{self.k}"

    @property
    def label(self) -> str:
        """The dims, prefixed by the layer name where there is one ("qkv 8192x3072x4096")."""
        return f"{self.layer} {self.dims}" if self.layer else self.dims

    @property
    def flop(self) -> int:
        """Matmul FLOPs per rank (multiply-adds count two)."""
        return 2 * self.m * self.n * self.k


@dataclass(frozen=True)
class _Llama:
    hidden: int
    ffn: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 128
    tokens: int = 8192  # M: the sequence of one step, sharded over the TP group


_LLAMAS = {
    "llama8b": _Llama(hidden=4096, ffn=14336, num_heads=32, num_kv_heads=8),
    "llama70b": _Llama(hidden=8192, ffn=28672, num_heads=64, num_kv_heads=8),
}


def _per_rank(set_name: str, what: str, size: int, world_size: int) -> int:
    if size % world_size:
        raise ValueError(
            f"shape set {set_name!r} requires a world size dividing {what} = {size}, got {world_size}"
        )
    return size // world_size


def _llama(set_name: str, kind: str, world_size: int) -> list[Shape]:
    cfg = _LLAMAS[set_name]
    m = cfg.tokens
    if kind == "gather":
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        return [
            Shape(set_name, "qkv", m, _per_rank(set_name, "the QKV width", qkv, world_size), cfg.hidden),
            Shape(set_name, "w13", m, 2 * _per_rank(set_name, "ffn", cfg.ffn, world_size), cfg.hidden, num_bs=2),
        ]
    attn = cfg.num_heads * cfg.head_dim
    return [
        Shape(set_name, "wo", m, _per_rank(set_name, "the attention width", attn, world_size), cfg.hidden),
        Shape(set_name, "w2", m, _per_rank(set_name, "ffn", cfg.ffn, world_size), cfg.hidden),
    ]


def _synthetic(set_name: str, ms: tuple[int, ...], n: int, k: int) -> list[Shape]:
    return [Shape(set_name, "", m, n, k) for m in ms]


def shapes_for(set_name: str, kind: str, world_size: int) -> list[Shape]:
    """The rows of one set for one pattern ("gather" or "scatter") at this world size."""
    if set_name not in SHAPE_SETS:
        raise ValueError(f"shape set requires one of {list(SHAPE_SETS)}, got {set_name!r}")
    if kind not in KINDS:
        raise ValueError(f"shape kind requires one of {list(KINDS)}, got {kind!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"shapes_for requires a positive int world size, got {world_size!r}")
    if set_name in _LLAMAS:
        shapes = _llama(set_name, kind, world_size)
    elif set_name == "seed":
        shapes = _synthetic(set_name, (2048, 4096, 8192), 3584, 8192)
    elif set_name == "small":
        shapes = _synthetic(set_name, (256, 512, 1024), 3584, 8192)
    else:  # tiny: CPU-sized, exercises the code paths in seconds (second row: two bs)
        # N and N / 2 multiples of 16, as torch._scaled_mm wants for the fp8 ops
        shapes = [Shape("tiny", "", 96, 64, 32), Shape("tiny", "", 192, 64, 32, num_bs=2 if kind == "gather" else 1)]
    for shape in shapes:
        _per_rank(set_name, "M", shape.m, world_size)
    return shapes


def expand_sets(name: str) -> tuple[str, ...]:
    """`--shapes` value -> the set names it stands for ("all" is every GPU-sized set)."""
    if name == "all":
        return GPU_SETS
    if name not in SHAPE_SETS:
        raise ValueError(f"--shapes requires one of {[*SHAPE_SETS, 'all']}, got {name!r}")
    return (name,)
