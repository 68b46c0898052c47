"""Rank-side test bodies for the fp8 ops and recipes, shared by tests/dist (gloo) and tests/gpu.

Exact cases: fp8 values in {-1, 0, 1} (exact in e4m3 and e5m2), power-of-two scales (a in {1, 2},
b in {1/2, 1}) and K = 16 per block keep every product, partial sum and bias sum exactly
representable in bfloat16 and float32, so results are compared with a float64 reference of the
dequantized inputs using torch.equal. Every rank builds every rank's inputs from seeds.
Random cases (the recipes): SQNR against the high-precision matmul, and pipeline == serial.

Every exact case runs under `checked_scaled_mm`, which wraps torch._scaled_mm and asserts the
rules cuBLAS enforces on CUDA (K and N multiples of 16, scales paired, float32, contiguous,
16-byte aligned), so the CPU tier catches what would only crash on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

import asynctp
from asynctp.float8 import Float8Recipe, quantize_activation, quantize_weight
from asynctp.ops.all_gather_scaled_matmul import all_gather_scaled_matmul
from asynctp.ops.scaled_matmul_reduce_scatter import scaled_matmul_reduce_scatter
from tests.cases import expect_errors, ints, shard_shape, world

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OUT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# (a_scale mode, b_scale mode): every pairing, mixed ones included
SCALE_MODES = (("tensorwise", "tensorwise"), ("rowwise", "per_column"), ("rowwise", "tensorwise"),
               ("tensorwise", "per_column"))
K_BLOCK = 16  # torch._scaled_mm on CUDA wants K and N multiples of 16


def fp8_ints(shape, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return ints(shape, seed, torch.float32, device, low=-1, high=2).to(dtype)


def pow2(shape, seed: int, choices: tuple[float, ...], device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(choices), tuple(shape), generator=g)
    return torch.tensor(choices, dtype=torch.float32)[idx].to(device)


def weight_t(n: int, k: int, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """b = w.t() of a contiguous (N, K) weight: column-major, as cuBLAS wants."""
    return fp8_ints((n, k), seed, dtype, device).t()


def deq(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.double()
    return x_fp8.double() * (s.reshape(()) if s.numel() == 1 and s.ndim != x_fp8.ndim else s)


def cat8(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat for float8 tensors, through their bytes (no reliance on float8 cat kernels)."""
    return torch.cat([t.view(torch.uint8) for t in tensors], dim=dim).view(tensors[0].dtype)


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    return torch.equal(x.reshape(-1).contiguous().view(torch.uint8), y.reshape(-1).contiguous().view(torch.uint8))


@contextlib.contextmanager
def checked_scaled_mm() -> Iterator[list[int]]:
    """torch._scaled_mm, asserting cuBLAS's rules on every call; yields a call counter."""
    real = torch._scaled_mm
    calls = [0]

    def checked(a, b, scale_a, scale_b, *args, **kwargs):
        m, n = a.shape[0], b.shape[1]
        # mat2's dims are K and N only in the plain call: the ops may pass a's rows as mat2 (the
        # transposed e5m2 call), and any M of the user's must still pass on CUDA
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and n % 16 == 0, (
            f"mat1 {tuple(a.shape)} x mat2 {tuple(b.shape)}: K and mat2's N must be multiples of 16")
        assert a.is_contiguous(), "a must be row-major"
        if a.device.type == "cuda":
            assert b.stride(0) == 1, f"b must be column-major, got strides {b.stride()}"
        for s in (scale_a, scale_b):
            assert s.dtype == torch.float32
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            assert tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n), (scale_a.shape, scale_b.shape)
            for s in (scale_a, scale_b):
                assert s.is_contiguous() and s.data_ptr() % 16 == 0, f"misaligned scale at {s.data_ptr() % 16}"
        if kwargs.get("bias") is not None:
            assert kwargs.get("out_dtype") != torch.float32, "cuBLAS refuses bias with a float32 output"
        calls[0] += 1
        return real(a, b, scale_a, scale_b, *args, **kwargs)

    torch._scaled_mm = checked
    try:
        yield calls
    finally:
        torch._scaled_mm = real


def _a_scales(mode: str, shapes: list, seed: int, device: str) -> list[torch.Tensor]:
    if mode == "rowwise":
        return [pow2((*s[:-1], 1), seed + r, (1.0, 2.0), device) for r, s in enumerate(shapes)]
    one = pow2((), seed, (1.0, 2.0), device)  # tensorwise: the same on every rank
    return [one.clone() for _ in shapes]


def _b_scale(mode: str, n: int, seed: int, device: str) -> torch.Tensor:
    if mode == "per_column":
        return pow2((1, n), seed, (0.5, 1.0), device)
    return pow2((), seed, (0.5, 1.0), device)


def check_ag(device: str, *, ndim: int, gather_dim: int, a_mode: str, b_mode: str, out_dtype: torch.dtype,
             num_bs: int, with_bias: bool, return_a: bool, strategy: str, seed: int,
             a_dtype: torch.dtype = E4M3, b_dtype: torch.dtype = E4M3, shape: list | None = None) -> None:
    rank, ws = world()
    k_mode = gather_dim % ndim == ndim - 1
    k = K_BLOCK * ws if k_mode else K_BLOCK
    shape = shape or shard_shape(ndim, gather_dim, ws, k)
    shards = [fp8_ints(shape, seed * 100 + r, a_dtype, device) for r in range(ws)]
    a_scales = _a_scales(a_mode, [shape] * ws, seed * 100 + 20, device)
    ns = [16 * (i + 1) for i in range(num_bs)]
    bs = [weight_t(n, k, seed * 100 + 50 + i, b_dtype, device) for i, n in enumerate(ns)]
    b_scales = [_b_scale(b_mode, n, seed * 100 + 60 + i, device) for i, n in enumerate(ns)]
    biases = [ints((n,), seed * 100 + 80 + i, out_dtype, device) if with_bias else None for i, n in enumerate(ns)]
    a_g, outs = all_gather_scaled_matmul(
        shards[rank], bs, a_scales[rank], b_scales, gather_dim, dist.group.WORLD, out_dtype=out_dtype,
        biases=biases if with_bias else None, return_a=return_a, strategy=strategy,
    )
    label = (f"ag ndim={ndim} dim={gather_dim} shape={shape} a={a_mode} b={b_mode} out={out_dtype} "
             f"bs={num_bs} bias={with_bias} {a_dtype}x{b_dtype} {strategy}")
    a_full = torch.cat([deq(s, sc) for s, sc in zip(shards, a_scales)], dim=gather_dim)
    if return_a:
        assert a_g is not None and same_bytes(a_g, cat8(shards, dim=gather_dim)), label
        assert a_g.is_contiguous(), f"{label}: gathered a strides {a_g.stride()}"
    else:
        assert a_g is None, label
    assert len(outs) == num_bs, label
    for o, b, s, bias in zip(outs, bs, b_scales, biases):
        ref = a_full @ deq(b, s)
        ref = (ref + bias.double() if bias is not None else ref).to(out_dtype)
        assert o.shape == ref.shape and o.dtype == ref.dtype, f"{label}: {o.shape} {o.dtype} vs {ref.shape} {ref.dtype}"
        assert torch.equal(o, ref), f"{label}: max diff {(o.double() - ref.double()).abs().max()}"
        assert o.is_contiguous(), f"{label}: output strides {o.stride()}"


def with_scale_cases(device: str) -> int:
    """all_gather_scaled_matmul_with_scale (the fp8 row-parallel backward's gather): its gathered
    a and outputs equal all_gather_scaled_matmul's (exact), its gathered scale equals the ranks'
    scales concatenated along the gather dim, for 2-D / 3-D, gather dims 0 / 1, the front and the
    batch-major order, and every strategy; a tensorwise scale or a gather along K is refused."""
    from asynctp.ops.all_gather_scaled_matmul import all_gather_scaled_matmul_with_scale
    from tests.cases import under_env

    rank, ws = world()
    count = 0
    with checked_scaled_mm():
        for shape, dim, env in (([3, K_BLOCK], 0, {}), ([2, 3, K_BLOCK], 0, {}), ([2, 3, K_BLOCK], 1, {}),
                                ([2, 3, K_BLOCK], 1, {"ASYNCTP_BATCH_MAJOR": "1", "splits": 2})):
            for strategy in ("pipeline", "serial", "ring"):
                shards = [fp8_ints(shape, count * 10 + r, E4M3, device) for r in range(ws)]
                scales = _a_scales("rowwise", [shape] * ws, count * 10 + 5, device)
                b = weight_t(32, K_BLOCK, count * 10 + 8, E4M3, device)
                b_scale = _b_scale("per_column", 32, count * 10 + 9, device)
                args = (shards[rank], [b], scales[rank], [b_scale], dim, dist.group.WORLD)
                a_g, s_g, outs = under_env(env, lambda: all_gather_scaled_matmul_with_scale(*args, strategy=strategy))
                ref_a, ref_outs = under_env(env, lambda: all_gather_scaled_matmul(*args, strategy=strategy))
                label = f"with_scale {shape} dim={dim} {env} {strategy}"
                assert same_bytes(a_g, ref_a) and torch.equal(outs[0], ref_outs[0]), label
                assert torch.equal(s_g, torch.cat(scales, dim=dim)) and s_g.is_contiguous(), f"{label}: scale"
                count += 1
    g = dist.group.WORLD
    x = fp8_ints([4, K_BLOCK], 1, E4M3, device)
    w, ws_ = weight_t(32, K_BLOCK, 2, E4M3, device), _b_scale("per_column", 32, 3, device)
    expect_errors([
        (ValueError, "requires a rowwise a_scale",
         lambda: all_gather_scaled_matmul_with_scale(x, [w], torch.ones((), device=device), [ws_], 0, g)),
        (ValueError, "a gather dim other than the last",
         lambda: all_gather_scaled_matmul_with_scale(x, [weight_t(32, K_BLOCK * ws, 2, E4M3, device)],
                                                     torch.ones(4, 1, device=device), [ws_], 1, g)),
    ])
    return count


def check_rs(device: str, *, ndim: int, scatter_dim: int, a_mode: str, b_mode: str, out_dtype: torch.dtype,
             with_bias: bool, reduce_op: str, strategy: str, seed: int, a_dtype: torch.dtype = E4M3,
             b_dtype: torch.dtype = E4M3, shape: list | None = None) -> None:
    rank, ws = world()
    k, n = K_BLOCK, 16 * ws
    if shape is None:
        shape = [2 * ws, 3, 5][: ndim - 1] + [k]
        if scatter_dim % ndim != ndim - 1:
            shape[scatter_dim % ndim] = ws * (scatter_dim % ndim + 1)
    parts_a = [fp8_ints(shape, seed * 100 + r, a_dtype, device) for r in range(ws)]
    if a_mode == "rowwise":
        a_scales = _a_scales(a_mode, [shape] * ws, seed * 100 + 20, device)
    else:  # tensorwise scales may differ per rank here: partials are dequantized before the sum
        a_scales = [pow2((), seed * 100 + 20 + r, (1.0, 2.0), device) for r in range(ws)]
    parts_b = [weight_t(n, k, seed * 100 + 40 + r, b_dtype, device) for r in range(ws)]
    b_scales = [_b_scale(b_mode, n, seed * 100 + 60 + r, device) for r in range(ws)]
    bias = ints((n,), seed * 100 + 90, out_dtype, device) if with_bias else None
    out = scaled_matmul_reduce_scatter(
        parts_a[rank], parts_b[rank], a_scales[rank], b_scales[rank], scatter_dim, dist.group.WORLD,
        out_dtype=out_dtype, bias=bias, reduce_op=reduce_op, strategy=strategy,
    )
    total = sum(deq(a, sa) @ deq(b, sb) for a, sa, b, sb in zip(parts_a, a_scales, parts_b, b_scales))
    if reduce_op == "avg":
        total = total / ws
    ref = total.chunk(ws, dim=scatter_dim)[rank]
    if bias is not None:
        ref = ref + (bias.double().chunk(ws)[rank] if scatter_dim % ndim == ndim - 1 else bias.double())
    ref = ref.to(out_dtype)
    # avg over R = 3 is inexact: the mean is rounded to out_dtype before the bias is added (one
    # rounding more than the reference); everything else is exact
    rtol = torch.finfo(out_dtype).eps if (reduce_op == "avg" and ws & (ws - 1)) else 0.0
    atol = rtol * float(total.abs().max())
    label = (f"rs ndim={ndim} dim={scatter_dim} shape={shape} a={a_mode} b={b_mode} out={out_dtype} "
             f"bias={with_bias} {reduce_op} {a_dtype}x{b_dtype} {strategy}")
    assert out.shape == ref.shape and out.dtype == ref.dtype, f"{label}: {out.shape} {out.dtype} vs {ref.shape}"
    if rtol:
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol, msg=label)
    else:
        assert torch.equal(out, ref), f"{label}: max diff {(out.double() - ref.double()).abs().max()}"
    assert out.is_contiguous(), f"{label}: output strides {out.stride()}"


def _dtypes(count: int) -> tuple[torch.dtype, torch.dtype]:
    """Mostly e4m3 x e4m3, now and then one e5m2 operand (never both: no such cuBLAS GEMM)."""
    return {3: (E5M2, E4M3), 6: (E4M3, E5M2)}.get(count % 7, (E4M3, E4M3))


def all_gather_scaled_grid(device: str, strategy: str) -> int:
    """Every scale pairing x 2-D/3-D x every gather dim (and -1) x bf16/fp32 outputs."""
    count = 0
    with checked_scaled_mm() as calls:
        for a_mode, b_mode in SCALE_MODES:
            for ndim in (2, 3):
                for gather_dim in list(range(ndim)) + [-1]:
                    for out_dtype in OUT_DTYPES.values():
                        v = count % 4
                        a_dtype, b_dtype = _dtypes(count)
                        check_ag(device, ndim=ndim, gather_dim=gather_dim, a_mode=a_mode, b_mode=b_mode,
                                 out_dtype=out_dtype, num_bs=1 + v % 2, with_bias=v in (1, 2), return_a=v != 3,
                                 strategy=strategy, seed=count, a_dtype=a_dtype, b_dtype=b_dtype)
                        count += 1
    assert calls[0] >= count
    return count


def scaled_matmul_reduce_scatter_grid(device: str, strategy: str) -> int:
    """Every scale pairing x 2-D/3-D x every scatter dim (and -1) x bf16/fp32 x sum/avg."""
    count = 0
    with checked_scaled_mm() as calls:
        for a_mode, b_mode in SCALE_MODES:
            for ndim in (2, 3):
                for scatter_dim in list(range(ndim)) + [-1]:
                    for out_dtype in OUT_DTYPES.values():
                        v = count % 4
                        a_dtype, b_dtype = _dtypes(count)
                        check_rs(device, ndim=ndim, scatter_dim=scatter_dim, a_mode=a_mode, b_mode=b_mode,
                                 out_dtype=out_dtype, with_bias=v in (1, 2), reduce_op="avg" if v >= 2 else "sum",
                                 strategy=strategy, seed=count, a_dtype=a_dtype, b_dtype=b_dtype)
                        count += 1
    assert calls[0] >= count
    return count


@contextlib.contextmanager
def _splits(splits: int | None) -> Iterator[None]:
    """Force the pipelines' row blocks per rank chunk (None: the plan's own)."""
    from asynctp.ops.tuning import forced_splits

    with forced_splits(splits) if splits is not None else contextlib.nullcontext():
        yield


def alignment_cases(device: str, splits: int | None = None) -> int:
    """Rowwise scales with m rows per chunk, m = 1..8: a chunk's scale slice starts 4 * m * src
    bytes in, off cuBLAS's 16-byte rule unless m % 4 == 0 (with splits, each row block's slice
    starts anywhere). Also scales the caller passes as a misaligned view or a stride-0
    expansion. checked_scaled_mm fails any misaligned call."""
    rank, ws = world()
    count = 0
    with checked_scaled_mm(), _splits(splits):
        for m in range(1, 9):
            for strategy in ("pipeline", "ring", "serial"):
                check_ag(device, ndim=2, gather_dim=0, a_mode="rowwise", b_mode="per_column",
                         out_dtype=torch.bfloat16, num_bs=1, with_bias=m % 2 == 0, return_a=True,
                         strategy=strategy, seed=200 + m, shape=[m, K_BLOCK])
                check_ag(device, ndim=3, gather_dim=-1, a_mode="rowwise", b_mode="tensorwise",
                         out_dtype=torch.float32, num_bs=1, with_bias=False, return_a=False,
                         strategy=strategy, seed=300 + m, shape=[m, 1, K_BLOCK])
                check_rs(device, ndim=2, scatter_dim=0, a_mode="rowwise", b_mode="per_column",
                         out_dtype=torch.bfloat16, with_bias=m % 2 == 1, reduce_op="sum",
                         strategy=strategy, seed=400 + m, shape=[m * ws, K_BLOCK])
                check_rs(device, ndim=3, scatter_dim=1, a_mode="rowwise", b_mode="tensorwise",
                         out_dtype=torch.float32, with_bias=False, reduce_op="sum",
                         strategy=strategy, seed=500 + m, shape=[1, m * ws, K_BLOCK])
                count += 4
        # caller-made scales: a slice 4 bytes off alignment, and a stride-0 expansion
        a = fp8_ints((3, K_BLOCK), rank, E4M3, device)
        b = weight_t(16, K_BLOCK, 9, E4M3, device)
        b_scale = torch.ones((1, 16), device=device)
        backing = torch.ones(8, device=device)
        for a_scale in (backing[1:4].view(3, 1), torch.ones((), device=device).expand(3, 1)):
            _, (o,) = all_gather_scaled_matmul(a, [b], a_scale, [b_scale], 0, dist.group.WORLD, strategy="pipeline")
            full = cat8([fp8_ints((3, K_BLOCK), r, E4M3, device) for r in range(ws)])
            assert torch.equal(o, (full.double() @ b.double()).to(torch.bfloat16))
            count += 1
    return count


def bad_inputs(device: str) -> list[str]:
    """Each bad call raises the documented error on every rank before any communication; the
    group works afterwards. Returns the messages (the test checks they agree across ranks)."""

    rank, ws = world()
    g = dist.group.WORLD
    a = fp8_ints((4, 16), rank, E4M3, device)
    b = weight_t(16, 16, 7, E4M3, device)
    s = torch.ones((), device=device)
    s_row = torch.ones((4, 1), device=device)
    s_col = torch.ones((1, 16), device=device)
    m = 6 if ws in (2, 3) else 2 * ws  # rows of the reduce-scatter input: divisible by R
    a6 = fp8_ints((m, 16), rank, E4M3, device)
    ag, rs = all_gather_scaled_matmul, scaled_matmul_reduce_scatter
    cases = [
        (TypeError, "a_shard requires a float8 dtype", lambda: ag(a.float(), [b], s, [s], 0, g)),
        (TypeError, "bs[0] requires a float8 dtype", lambda: ag(a, [b.float()], s, [s], 0, g)),
        (TypeError, "a_scale requires dtype torch.float32", lambda: ag(a, [b], s.double(), [s], 0, g)),
        (TypeError, "a_scale requires dtype torch.float32", lambda: ag(a, [b], s_row.bfloat16(), [s], 0, g)),
        (ValueError, "a_scale requires numel 1 (tensorwise) or shape (4, 1)", lambda: ag(a, [b], s_row[:3], [s], 0, g)),
        (ValueError, "a_scale requires numel 1 (tensorwise) or shape (4, 1)", lambda: ag(a, [b], s_row.t(), [s], 0, g)),
        (ValueError, "b_scales[0] requires numel 1 (tensorwise) or shape (1, 16)", lambda: ag(a, [b], s, [s_col.t()], 0, g)),
        (ValueError, "b_scales requires one scale per b (1), got 2", lambda: ag(a, [b], s, [s, s], 0, g)),
        (TypeError, "b_scales requires a list", lambda: ag(a, [b], s, s, 0, g)),
        (ValueError, "shape[0] == K = 16", lambda: ag(a, [b[:8]], s, [s], 0, g)),
        (ValueError, f"shape[0] == K = {16 * ws}", lambda: ag(a, [b], s, [s], 1, g)),
        (ValueError, "out_dtype requires one of", lambda: ag(a, [b], s, [s], 0, g, out_dtype=torch.float16)),
        (TypeError, "out_dtype requires a torch.dtype", lambda: ag(a, [b], s, [s], 0, g, out_dtype="bf16")),
        (TypeError, "biases[0] requires dtype torch.float32 (out_dtype)",
         lambda: ag(a, [b], s, [s], 0, g, out_dtype=torch.float32, biases=[torch.zeros(16, dtype=torch.bfloat16, device=device)])),
        (ValueError, "biases[0] requires shape (16,)", lambda: ag(a, [b], s, [s], 0, g, biases=[torch.zeros(8, dtype=torch.bfloat16, device=device)])),
        (TypeError, "no e5m2 x e5m2 GEMM", lambda: ag(a.to(E5M2), [b.to(E5M2)], s, [s], 0, g)),
        (ValueError, "gather_dim requires a dim in [-2, 1]", lambda: ag(a, [b], s, [s], 2, g)),
        (TypeError, "use_fast_accum requires a bool", lambda: ag(a, [b], s, [s], 0, g, use_fast_accum=1)),
        (ValueError, "strategy requires one of", lambda: ag(a, [b], s, [s], 0, g, strategy="fast")),
        (TypeError, "ProcessGroup or its name", lambda: ag(a, [b], s, [s], 0, 3)),
        (TypeError, "a requires a float8 dtype", lambda: rs(a6.bfloat16(), b, s, s, 0, g)),
        (ValueError, f"a_scale requires numel 1 (tensorwise) or shape ({m}, 1)", lambda: rs(a6, b, s_row[:2], s, 0, g)),
        (ValueError, "b_scale requires numel 1 (tensorwise) or shape (1, 16)", lambda: rs(a6, b, s, s_col[:, :8], 0, g)),
        (TypeError, "b_scale requires dtype torch.float32", lambda: rs(a6, b, s, s_col.half(), 0, g)),
        (ValueError, "shape[0] == K = 16", lambda: rs(a6, b[:8], s, s, 0, g)),
        (ValueError, f"divisible by the world size {ws}", lambda: rs(a6[: ws + 1], b, s, s, 0, g)),
        (ValueError, "reduce_op requires one of", lambda: rs(a6, b, s, s, 0, g, reduce_op="max")),
        (TypeError, "bias requires dtype torch.bfloat16 (out_dtype)", lambda: rs(a6, b, s, s, 0, g, bias=torch.zeros(16, device=device))),
        (ValueError, "out_dtype requires one of", lambda: rs(a6, b, s, s, 0, g, out_dtype=E4M3)),
    ]
    if device == "cuda":
        cases += [
            (ValueError, "requires device", lambda: ag(a, [b], s.cpu(), [s], 0, g)),
            (ValueError, "K (a_shard's last dim) requires a multiple of 16",
             lambda: ag(a[:, :8].contiguous(), [b[:8]], s, [s], 0, g)),
            (ValueError, "N (b's last dim) requires a multiple of 16", lambda: rs(a6, b[:, :8], s, s, 0, g)),
        ]
    messages = expect_errors(cases)
    # the group still works, for both ops
    a_g, (o,) = ag(a, [b], s, [s], 0, g)
    assert same_bytes(a_g, cat8([fp8_ints((4, 16), r, E4M3, device) for r in range(ws)]))
    assert rs(a6, b, s, s, 0, g).shape == (m // ws, 16)
    return messages


# opcheck's test_schema compares inputs with torch.allclose, which has no float8 kernel; the
# same property (inputs unchanged, outputs alias no input) is checked by _check_schema instead
_OPCHECK_TESTS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _flat(args) -> list[torch.Tensor]:
    out = []
    for x in args:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(_flat(x))
    return out


def _check_schema(op, args) -> None:
    inputs = _flat(args)
    before = [t.clone() for t in inputs]
    outputs = _flat([op(*args)])
    for t, copy in zip(inputs, before):
        assert same_bytes(t, copy), f"{op} mutated an input"
    storages = {t.untyped_storage().data_ptr() for t in inputs}
    assert not any(o.untyped_storage().data_ptr() in storages for o in outputs), f"{op} output aliases an input"


def _opcheck(op, args) -> None:
    torch.library.opcheck(op, args, test_utils=_OPCHECK_TESTS)
    _check_schema(op, args)


def opcheck_ops(device: str) -> None:
    rank, ws = world()
    g = dist.group.WORLD.group_name
    a = fp8_ints((4, 16), rank, E4M3, device)
    b = weight_t(16, 16, 7, E4M3, device)
    s = torch.ones((), device=device)
    s_row = pow2((4, 1), rank, (1.0, 2.0), device)
    s_col = pow2((1, 16), 3, (0.5, 1.0), device)
    bias = ints((16,), 5, torch.bfloat16, device)
    ag = torch.ops.asynctp.all_gather_scaled_matmul.default
    rs = torch.ops.asynctp.scaled_matmul_reduce_scatter.default
    _opcheck(ag, (a, [b], s_row, [s_col], 0, g, torch.bfloat16, [bias], False, True, "pipeline"))
    b_k = weight_t(16, 16 * ws, 8, E4M3, device)  # gather along K
    _opcheck(ag, (a, [b_k], s_row, [s], 1, g, torch.float32, [None], False, True, "pipeline"))
    a3 = fp8_ints((2 * ws, 3, 16), rank, E4M3, device)
    s3 = pow2((2 * ws, 3, 1), rank, (1.0, 2.0), device)
    b_n = weight_t(16 * ws, 16, 9, E4M3, device)  # scatter along N: N = R * 16
    _opcheck(rs, (a3, b, s3, s_col, 0, g, torch.bfloat16, bias, "avg", False, "pipeline"))
    _opcheck(rs, (a3, b_n, s3, s, 2, g, torch.float32, None, "sum", False, "pipeline"))


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


def recipes(device: str, m: int = 64, k: int = 128, n: int = 96) -> dict[str, float]:
    """Both recipes on random normal bf16 data through both ops: SQNR against the bf16-input matmul
    (computed in fp32) >= 25 dB; the pipeline equals the serial strategy; tensorwise scales agree
    over the group although each rank's shard differs. Returns the SQNRs (dB) by case.
    (The ring's partial sums travel in bf16, rounded at each hop: close to serial, not equal.)"""
    rank, ws = world()
    g = dist.group.WORLD
    result = {}
    for name in ("tensorwise", "rowwise"):
        recipe = Float8Recipe.from_name(name)
        torch.manual_seed(10 + rank)
        x_shard = (torch.randn(2, m // 2, k, device=device) * (1 + rank)).bfloat16()  # different amax per rank
        torch.manual_seed(99)
        w = (torch.randn(n, k, device=device) / k**0.5).bfloat16()
        x_fp8, x_scale = quantize_activation(x_shard, recipe, g)
        w_fp8, w_scale = quantize_weight(w, recipe)
        scales = [torch.empty_like(x_scale) for _ in range(ws)]
        dist.all_gather(scales, x_scale.contiguous(), group=g)
        if name == "tensorwise":
            assert all(torch.equal(sc, scales[0]) for sc in scales), "tensorwise scales differ across ranks"
        xs = [torch.empty_like(x_shard) for _ in range(ws)]
        dist.all_gather(xs, x_shard, group=g)
        for gather_dim in (0, 1):
            kw = dict(use_fast_accum=recipe.use_fast_accum)
            args = (x_fp8, [w_fp8.t()], x_scale, [w_scale.t()], gather_dim, g)
            _, (o_s,) = all_gather_scaled_matmul(*args, strategy="serial", **kw)
            for strategy in ("ring", "pipeline", "auto"):
                _, (o_p,) = all_gather_scaled_matmul(*args, strategy=strategy, **kw)
                torch.testing.assert_close(o_p, o_s, rtol=1e-2, atol=1e-2)
            ref = torch.cat(xs, dim=gather_dim).float() @ w.float().t()
            result[f"ag-{name}-dim{gather_dim}"] = sqnr(ref, o_p)
        # row-parallel: x and w sharded over K; x is not gathered, so no agreement is needed
        torch.manual_seed(1234)
        x_full = torch.randn(2 * ws, 16 * ws, k * ws, device=device).bfloat16()
        w_full = (torch.randn(n, k * ws, device=device) / (k * ws) ** 0.5).bfloat16()
        x_r, w_r = x_full[..., rank * k : (rank + 1) * k], w_full[:, rank * k : (rank + 1) * k]
        x_fp8, x_scale = quantize_activation(x_r, recipe, None)
        w_fp8, w_scale = quantize_weight(w_r, recipe)
        full_ref = x_full.float() @ w_full.float().t()
        for scatter_dim in (0, 1):
            args = (x_fp8, w_fp8.t(), x_scale, w_scale.t(), scatter_dim, g)
            o_s = scaled_matmul_reduce_scatter(*args, strategy="serial")
            for strategy in ("ring", "pipeline", "auto"):
                o_p = scaled_matmul_reduce_scatter(*args, strategy=strategy)
                torch.testing.assert_close(o_p, o_s, rtol=1e-2, atol=2e-2)
            result[f"rs-{name}-dim{scatter_dim}"] = sqnr(full_ref.chunk(ws, dim=scatter_dim)[rank], o_p)
    low = {key: v for key, v in result.items() if v < 25}
    assert not low, f"SQNR below 25 dB: {low}"
    return result



def large_pipeline_matches_serial(device: str = "cuda") -> dict[str, float]:
    """Random bf16 data quantized by both recipes, at sizes where a chunk is many GEMM tiles:
    pipeline == serial up to GEMM rounding (other M per call may pick other kernels), with and
    without fast accumulation, gather along rows, a middle dim and K, scatter along rows and N;
    SQNR >= 25 dB against the high-precision matmul. Returns the SQNRs (dB) by case."""
    rank, ws = world()
    g = dist.group.WORLD
    result = {}
    for name in ("tensorwise", "rowwise"):
        recipe = Float8Recipe.from_name(name)
        for gather_dim, shape in ((0, (1024, 1024)), (1, (2, 512, 1024)), (-1, (1024, 512))):
            torch.manual_seed(1234 + rank)
            x = torch.randn(shape, device=device).bfloat16()
            k = shape[-1] * ws if gather_dim == -1 else shape[-1]
            torch.manual_seed(99)
            w = (torch.randn(768, k, device=device) / k**0.5).bfloat16()
            x_fp8, x_scale = quantize_activation(x, recipe, g)
            w_fp8, w_scale = quantize_weight(w, recipe)
            args = (x_fp8, [w_fp8.t()], x_scale, [w_scale.t()], gather_dim, g)
            for fast in (False, True):
                _, (o_p,) = all_gather_scaled_matmul(*args, use_fast_accum=fast, strategy="pipeline")
                _, (o_s,) = all_gather_scaled_matmul(*args, use_fast_accum=fast, strategy="serial")
                torch.testing.assert_close(o_p, o_s, rtol=2e-2, atol=2e-2)
            xs = [torch.empty_like(x) for _ in range(ws)]
            dist.all_gather(xs, x, group=g)
            result[f"ag-{name}-dim{gather_dim}"] = sqnr(torch.cat(xs, dim=gather_dim).float() @ w.float().t(), o_p)
        for scatter_dim, shape in ((0, (1024, 1024)), (1, (2, 512, 1024)), (-1, (1024, 1024))):
            torch.manual_seed(4321 + rank)
            x = torch.randn(shape, device=device).bfloat16()
            w = (torch.randn(512 * ws, shape[-1], device=device) / shape[-1] ** 0.5).bfloat16()
            x_fp8, x_scale = quantize_activation(x, recipe, None)
            w_fp8, w_scale = quantize_weight(w, recipe)
            args = (x_fp8, w_fp8.t(), x_scale, w_scale.t(), scatter_dim, g)
            o_p = scaled_matmul_reduce_scatter(*args, use_fast_accum=recipe.use_fast_accum, strategy="pipeline")
            o_s = scaled_matmul_reduce_scatter(*args, use_fast_accum=recipe.use_fast_accum, strategy="serial")
            torch.testing.assert_close(o_p, o_s, rtol=2e-2, atol=5e-2)
            full = x.float() @ w.float().t()
            dist.all_reduce(full, group=g)
            result[f"rs-{name}-dim{scatter_dim}"] = sqnr(full.chunk(ws, dim=scatter_dim)[rank], o_p)
    low = {key: v for key, v in result.items() if v < 25}
    assert not low, f"SQNR below 25 dB: {low}"
    return result


def mismatched_tensorwise_scale_is_caught(device: str) -> str:
    """A tensorwise a_scale that differs across ranks (a gathered tensor with two scales) raises
    on every rank before any data moves; agreeing scales pass, after asynctp.reset. CPU only: the
    value is part of the call's signature there; on CUDA it is not read (a host sync per call),
    docs/reliability.md."""
    import pytest

    rank, ws = world()
    g = dist.group.WORLD
    a = fp8_ints((4, 16), rank, E4M3, device)
    b = weight_t(16, 16, 7, E4M3, device)
    one = torch.ones((), device=device)
    with pytest.raises(ValueError, match="a_scale") as info:
        all_gather_scaled_matmul(a, [b], one * (1 + rank), [one], 0, g, strategy="pipeline")
    asynctp.reset(g)
    _, (o,) = all_gather_scaled_matmul(a, [b], one, [one], 0, g, strategy="pipeline")
    full = cat8([fp8_ints((4, 16), r, E4M3, device) for r in range(ws)])
    assert torch.equal(o, (full.double() @ b.double()).to(torch.bfloat16))
    return str(info.value)


def cuda_graph_capture() -> None:
    """Both fp8 ops (rowwise scales, pipeline) captured in one CUDA graph after reserve();
    replays with new inputs equal the eager serial results."""
    rank, ws = world()
    g = dist.group.WORLD
    asynctp.reserve(g, 16 << 20, "cuda")
    a_static = fp8_ints((64, 128), rank, E4M3, "cuda")
    s_static = pow2((64, 1), rank, (1.0, 2.0), "cuda")
    b = weight_t(96, 128, 5, E4M3, "cuda")
    b_scale = pow2((1, 96), 6, (0.5, 1.0), "cuda")
    b2 = weight_t(64, 96 * ws, 7, E4M3, "cuda")  # [K = 96 R, 64]: reduce-scatter over K shards
    b2_shard = b2[rank * 96 : (rank + 1) * 96]

    def step():
        _, (o,) = all_gather_scaled_matmul(a_static, [b], s_static, [b_scale], 0, g, return_a=False,
                                           strategy="pipeline")
        o_fp8 = o.to(E4M3)  # re-quantized in the graph; the check below uses the same o_fp8
        one = torch.ones((), device="cuda")
        r = scaled_matmul_reduce_scatter(o_fp8, b2_shard, one, one, 0, g, strategy="pipeline")
        return o, o_fp8, r

    from asynctp.bench.timing import capture_graph

    replay, (o, o_fp8, r) = capture_graph(step, torch.device("cuda"))  # warm-up on a side stream, then capture
    one = torch.ones((), device="cuda")
    for trial in range(3):
        a_static.copy_(fp8_ints((64, 128), 100 * trial + rank, E4M3, "cuda"))
        s_static.copy_(pow2((64, 1), 100 * trial + rank, (1.0, 2.0), "cuda"))
        replay()
        torch.cuda.synchronize()
        _, (o_ref,) = all_gather_scaled_matmul(a_static, [b], s_static, [b_scale], 0, g, strategy="serial")
        assert torch.equal(o, o_ref)
        r_ref = scaled_matmul_reduce_scatter(o_fp8, b2_shard, one, one, 0, g, strategy="serial")
        if ws == 2:  # one bf16 addition of two partials: the same in either order
            torch.testing.assert_close(r, r_ref, rtol=1e-2, atol=0)
        else:  # more partials are summed in another order than the serial reduce-scatter's
            assert sqnr(r_ref, r) > 40, f"replayed reduce-scatter SQNR {sqnr(r_ref, r):.1f} dB"


def quantize_kernels_exact(device: str = "cuda") -> int:
    """asynctp.float8's Triton quantization kernels against the torch formulas they replace
    (amax_to_scale / to_float8 on each tensor), bit for bit: fp8 bytes and float32 scales, for
    every quantizer, both fp8 dtypes, power-of-two scales on and off, 2-D / 3-D / strided inputs,
    rows longer than one block, all-zero rows, saturation (an amax below the true one), and the
    dequantization. Returns the number of comparisons."""
    from asynctp.float8 import quantize as q
    from asynctp.float8.quantize import amax_to_scale, to_float8

    assert q._fast(torch.empty(1, device=device)) is not None, "the Triton kernels are not in use"
    gen = torch.Generator().manual_seed(7)
    count = 0

    def check(got: tuple, want: tuple, what: str) -> None:
        nonlocal count
        for g_t, w_t, part in zip(got, want, ("values", "scale")):
            assert same_bytes(g_t, w_t), f"{what}: {part} differ from the torch formulas"
            count += 1

    def data(shape, dtype, scale=3.0):
        x = torch.randn(shape, generator=gen) * scale
        x.view(-1)[:: max(1, x.numel() // 7)] *= 40  # outliers: small values lose precision next to them
        return x.to(dtype).to(device)

    shapes = [(1, 1), (7, 13), (64, 4096), (5, 14336), (3, 5, 96)]
    for scaling, pow2_scales in (("rowwise", True), ("rowwise", False), ("tensorwise", False), ("tensorwise", True)):
        for f8 in (E4M3, E5M2):
            recipe = Float8Recipe(scaling=scaling, power_of_2_scales=pow2_scales, activation_dtype=f8,
                                  weight_dtype=E4M3, grad_dtype=E4M3 if f8 == E5M2 else E5M2)
            for hp in (torch.bfloat16, torch.float16, torch.float32):
                for shape in shapes:
                    x = data(shape, hp)
                    x[..., 0, :] = 0  # an all-zero row: the eps floor
                    what = f"{scaling} pow2={pow2_scales} {f8} {hp} {shape}"
                    rows_scale = amax_to_scale(x.abs().amax(-1, keepdim=True), f8, recipe)
                    check(q.quantize_rows(x, f8, recipe), (to_float8(x, rows_scale, f8), rows_scale), f"rows {what}")
                    amax = x.abs().amax().float()
                    t_scale = amax_to_scale(amax, f8, recipe)
                    check(q.quantize_tensor(x, amax, f8, recipe), (to_float8(x, t_scale, f8), t_scale), f"tensor {what}")
                    low = amax / 4  # saturates the largest values
                    low_scale = amax_to_scale(low, f8, recipe)
                    check(q.quantize_tensor(x, low, f8, recipe), (to_float8(x, low_scale, f8), low_scale), f"saturated {what}")
                    strided = x.transpose(-1, -2)  # not contiguous: the kernels take strides
                    s_scale = amax_to_scale(strided.abs().amax(-1, keepdim=True), f8, recipe)
                    check(q.quantize_rows(strided, f8, recipe), (to_float8(strided, s_scale, f8), s_scale), f"strided {what}")
                    if len(shape) == 2:
                        w_dtype = recipe.weight_dtype
                        w_amax = x.abs().amax(0, keepdim=True) if scaling == "rowwise" else x.abs().amax()
                        w_scale = amax_to_scale(w_amax, w_dtype, recipe)
                        w_ref = to_float8(x, w_scale, w_dtype).t().contiguous().t()
                        got = q.quantize_weight_for_dgrad(x, recipe)
                        assert got[0].stride() == w_ref.stride(), what
                        check(got, (w_ref, w_scale), f"dgrad weight {what}")
                    y, y_scale = to_float8(x, rows_scale, f8), rows_scale
                    for out_dtype in (torch.bfloat16, torch.float32):
                        for s in (y_scale, t_scale, y_scale.expand(x.shape).contiguous()):
                            want = (y.float() * s).to(out_dtype)
                            check((q.dequantize(y, s, out_dtype),), (want,), f"dequantize {what}")
    # into caller-kept buffers: the same bytes, written in place
    recipe = Float8Recipe.from_name("rowwise")
    x = data((32, 256), torch.bfloat16)
    out = torch.empty((32, 256), dtype=E4M3, device=device)
    scale_out = torch.empty((32, 1), device=device)
    got = q.quantize_rows(x, E4M3, recipe, out=out, scale_out=scale_out)
    assert got[0] is out and got[1] is scale_out
    check(got, q.quantize_rows(x, E4M3, recipe), "into kept buffers")
    return count
