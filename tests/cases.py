"""Rank-side test bodies shared by tests/dist (gloo, cpu backend) and tests/gpu (nccl, cuda backend).

Inputs are small integers, so every product and sum is exact in float32 and bfloat16, and
results are compared with the plain-PyTorch reference with atol=0. Every rank builds every
rank's inputs from seeds, so the reference needs no collective at all.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

import asynctp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ints(shape, seed: int, dtype: torch.dtype, device: str, low: int = -2, high: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, tuple(shape), generator=g).to(dtype).to(device)


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def shard_shape(ndim: int, gather_dim: int, world_size: int, k: int) -> list[int]:
    """A shard shape whose sizes differ per dim, so a wrong dim shows up as a shape error."""
    shape = [3, 2, 5][: ndim - 1] + [k]
    if gather_dim % ndim == ndim - 1:
        shape[-1] = k // world_size
    return shape


def ag_reference(shards, bs, biases, gather_dim, return_a):
    a_full = torch.cat(shards, dim=gather_dim)
    outs = [a_full.double() @ b.double() for b in bs]
    outs = [(o + bias.double() if bias is not None else o).to(a_full.dtype) for o, bias in zip(outs, biases)]
    return (a_full if return_a else None), outs


def check_ag_case(device, dtype, ndim, gather_dim, num_bs, with_bias, return_a, strategy, seed):
    rank, ws = world()
    k = 4 * ws
    shape = shard_shape(ndim, gather_dim, ws, k)
    shards = [ints(shape, seed * 100 + r, dtype, device) for r in range(ws)]
    bs = [ints((k, 6 + 2 * i), seed * 100 + 50 + i, dtype, device) for i in range(num_bs)]
    biases = [ints((b.shape[1],), seed * 100 + 80 + i, dtype, device) if with_bias else None for i, b in enumerate(bs)]
    a_g, outs = asynctp.all_gather_matmul(
        shards[rank], bs, gather_dim, dist.group.WORLD, return_a=return_a,
        biases=biases if with_bias else None, strategy=strategy,
    )
    ref_a, ref_outs = ag_reference(shards, bs, biases, gather_dim, return_a)
    label = f"ag ndim={ndim} dim={gather_dim} bs={num_bs} bias={with_bias} return_a={return_a} {strategy} {dtype}"
    if return_a:
        assert a_g is not None and torch.equal(a_g, ref_a), label
        assert a_g.is_contiguous(), f"{label}: gathered a strides {a_g.stride()}"
    else:
        assert a_g is None, label
    assert len(outs) == num_bs, label
    for o, r in zip(outs, ref_outs):
        assert o.shape == r.shape and o.dtype == r.dtype, f"{label}: {o.shape} {o.dtype} vs {r.shape} {r.dtype}"
        assert torch.equal(o, r), f"{label}: max diff {(o.double() - r.double()).abs().max()}"
        # the caller's layout, as torch's ops give it (strided views of the row layout made
        # the bf16 attention backward wrong on H200 at batch 2)
        assert o.is_contiguous(), f"{label}: output strides {o.stride()}"


def rs_reference(parts_a, parts_b, scatter_dim, reduce_op, bias, rank, ws):
    total = sum(a.double() @ b.double() for a, b in zip(parts_a, parts_b))
    if reduce_op == "avg":
        total = total / ws
    chunk = total.chunk(ws, dim=scatter_dim)[rank]
    if bias is not None:
        bias_part = bias.double().chunk(ws)[rank] if scatter_dim % total.ndim == total.ndim - 1 else bias.double()
        chunk = chunk + bias_part
    return chunk.to(parts_a[0].dtype)


def check_rs_case(device, dtype, ndim, scatter_dim, with_bias, reduce_op, strategy, seed, shape=None):
    rank, ws = world()
    k, n = 8, 4 * ws
    if shape is None:
        shape = [2 * ws, 3, 5][: ndim - 1] + [k]
        if scatter_dim % ndim != ndim - 1:
            shape[scatter_dim % ndim] = ws * (scatter_dim % ndim + 1)
    # avg: multiples of R keep the mean an integer, so it is exact
    scale = ws if reduce_op == "avg" else 1
    parts_a = [ints(shape, seed * 100 + r, dtype, device) * scale for r in range(ws)]
    parts_b = [ints((k, n), seed * 100 + 40 + r, dtype, device) for r in range(ws)]
    bias = ints((n,), seed * 100 + 90, dtype, device) if with_bias else None
    out = asynctp.matmul_reduce_scatter(
        parts_a[rank], parts_b[rank], scatter_dim, dist.group.WORLD,
        reduce_op=reduce_op, bias=bias, strategy=strategy,
    )
    ref = rs_reference(parts_a, parts_b, scatter_dim, reduce_op, bias, rank, ws)
    label = f"rs ndim={ndim} dim={scatter_dim} bias={with_bias} {reduce_op} {strategy} {dtype}"
    assert out.shape == ref.shape and out.dtype == ref.dtype, f"{label}: {out.shape} vs {ref.shape}"
    assert torch.equal(out, ref), f"{label}: max diff {(out.double() - ref.double()).abs().max()}"
    assert out.is_contiguous(), f"{label}: output strides {out.stride()}"


def all_gather_matmul_grid(device: str, dtype_name: str, strategy: str) -> int:
    dtype = DTYPES[dtype_name]
    count = 0
    for ndim in (2, 3):
        for gather_dim in list(range(ndim)) + [-1]:
            for num_bs, with_bias, return_a in ((1, False, True), (2, True, True), (2, False, False), (1, True, False)):
                check_ag_case(device, dtype, ndim, gather_dim, num_bs, with_bias, return_a, strategy, seed=count)
                count += 1
    return count


def under_env(env: dict, fn, *args):
    """fn(*args) under the settings in env: "ASYNCTP_GRAPHS" (Config.graphs), "ASYNCTP_BATCH_MAJOR"
    (asynctp.ops.layout.BATCH_MAJOR), "splits" (the pipelines' row blocks per rank chunk,
    asynctp.ops.tuning.forced_splits)."""
    import contextlib
    from unittest import mock

    from asynctp.ops import layout
    from asynctp.ops.tuning import forced_splits

    env = dict(env)
    splits = env.pop("splits", None)
    graphs = {"graphs": env.pop("ASYNCTP_GRAPHS")} if "ASYNCTP_GRAPHS" in env else {}
    order = env.pop("ASYNCTP_BATCH_MAJOR", layout.BATCH_MAJOR)
    assert not env, f"under_env knows no setting {sorted(env)}"
    with asynctp.config.override(**graphs), mock.patch.object(layout, "BATCH_MAJOR", order), \
            (forced_splits(splits) if splits else contextlib.nullcontext()):
        return fn(*args)


def matmul_reduce_scatter_grid(device: str, dtype_name: str, strategy: str) -> int:
    dtype = DTYPES[dtype_name]
    count = 0
    for ndim in (2, 3):
        for scatter_dim in list(range(ndim)) + [-1]:
            for with_bias, reduce_op in ((False, "sum"), (True, "sum"), (False, "avg"), (True, "avg")):
                check_rs_case(device, dtype, ndim, scatter_dim, with_bias, reduce_op, strategy, seed=count)
                count += 1
    return count


def matmul_sum_reduce_scatter_grid(device: str, dtype_name: str, strategy: str) -> int:
    """matmul_sum_reduce_scatter (sum_i a_i @ b_i, reduce-scattered; the column-parallel dgrad of
    weights sharing a gather) against the reference of the concatenated problem, atol=0 (small
    integers: every rounding exact), 1-3 terms of different K, every scatter dim,
    a batch of 2 behind the scatter dim, the last dim (b's columns scattered), bias, avg; then
    its argument errors."""
    from asynctp.ops.matmul_reduce_scatter import matmul_sum_reduce_scatter

    dtype = DTYPES[dtype_name]
    rank, ws = world()
    g = dist.group.WORLD
    n, count = 4 * ws, 0
    for shape, dims in (([2 * ws], (0, -1)), ([2, 3 * ws], (1, -1)), ([ws, 2 * ws], (0, 1))):  # leading dims; K per term
        for scatter_dim in dims:
            for ks, with_bias, reduce_op in (((8,), False, "sum"), ((8, 4), True, "sum"), ((6, 2, 2), False, "avg")):
                scale = ws if reduce_op == "avg" else 1
                parts = [[ints([*shape, k], count * 100 + 7 * r + i, dtype, device) * scale for i, k in enumerate(ks)]
                         for r in range(ws)]
                bs = [[ints((k, n), count * 100 + 50 + 7 * r + i, dtype, device) for i, k in enumerate(ks)] for r in range(ws)]
                bias = ints((n,), count * 100 + 99, dtype, device) if with_bias else None
                out = matmul_sum_reduce_scatter(parts[rank], bs[rank], scatter_dim, g, reduce_op=reduce_op, bias=bias,
                                                strategy=strategy)
                cat_a = [torch.cat(p, dim=-1) for p in parts]
                cat_b = [torch.cat(b, dim=0) for b in bs]
                ref = rs_reference(cat_a, cat_b, scatter_dim, reduce_op, bias, rank, ws)
                label = f"sum-rs shape={shape} dim={scatter_dim} ks={ks} bias={with_bias} {reduce_op} {strategy} {dtype}"
                assert out.shape == ref.shape and out.dtype == ref.dtype, f"{label}: {out.shape} vs {ref.shape}"
                assert torch.equal(out, ref), f"{label}: max diff {(out.double() - ref.double()).abs().max()}"
                assert out.is_contiguous(), f"{label}: output strides {out.stride()}"
                count += 1
    a, b = ints((2 * ws, 8), 1, dtype, device), ints((8, n), 2, dtype, device)
    expect_errors([
        (ValueError, "got 1 and 0 tensors", lambda: matmul_sum_reduce_scatter([a], [], 0, g)),
        (TypeError, "requires lists a_list and b_list, got Tensor", lambda: matmul_sum_reduce_scatter(a, [b], 0, g)),
        (ValueError, "a_list[1] requires shape", lambda: matmul_sum_reduce_scatter([a, a[:ws]], [b, b], 0, g)),
        (ValueError, f"b_list[1] requires {n} columns", lambda: matmul_sum_reduce_scatter([a, a], [b, b[:, :ws]], 0, g)),
        (ValueError, "shape[0] == K = 8", lambda: matmul_sum_reduce_scatter([a, a], [b, b[:4]], 0, g)),
    ])
    return count


def batch_major_by_default(device: str) -> int:
    """With ASYNCTP_BATCH_MAJOR unset, a gather / scatter dim behind a batch takes the batch-major
    order exactly when a rank's run of rows reaches BATCH_MAJOR_MIN_ROWS, and both orders equal
    the reference (atol=0) through the pipelined strategy."""
    from asynctp.ops import layout

    rank, ws = world()
    count = 0
    for rows in (layout.BATCH_MAJOR_MIN_ROWS, 8):  # per rank and batch element
        shard = ints((2, rows, 8), 11 + rank, torch.float32, device)
        lay = layout.gather_layout(shard, 1, ws, batch_major=True)
        assert (lay.segment > 0) == (rows >= layout.BATCH_MAJOR_MIN_ROWS), (rows, lay.segment)
        for strategy in ("pipeline", "ring"):
            check_ag_case_shapes(device, (2, rows, 8), strategy, seed=count)
            check_rs_case(device, torch.float32, 3, 1, True, "sum", strategy, seed=count, shape=(2, rows * ws, 8))
            count += 1
        full = ints((2, rows * ws, 8), 5, torch.float32, device)
        assert (layout.scatter_layout(full, 1, ws, batch_major=True).segment > 0) == (rows >= layout.BATCH_MAJOR_MIN_ROWS)
    return count


def check_ag_case_shapes(device, shape, strategy, seed):
    """check_ag_case's comparison for one given shard shape, gathered along dim 1, two weights."""
    rank, ws = world()
    shards = [ints(shape, seed * 100 + r, torch.float32, device) for r in range(ws)]
    bs = [ints((shape[-1], 6 + 2 * i), seed * 100 + 50 + i, torch.float32, device) for i in range(2)]
    a_g, outs = asynctp.all_gather_matmul(shards[rank], bs, 1, dist.group.WORLD, strategy=strategy)
    ref_a, ref_outs = ag_reference(shards, bs, [None, None], 1, True)
    assert torch.equal(a_g, ref_a) and a_g.is_contiguous(), f"ag {shape} {strategy}: gathered a"
    for o, r in zip(outs, ref_outs):
        assert torch.equal(o, r) and o.is_contiguous(), f"ag {shape} {strategy}: max diff {(o - r).abs().max()}"


def outputs_do_not_alias(device: str) -> None:
    """A second call (same shapes, other values) must leave the first call's results unchanged."""
    rank, ws = world()
    dtype = torch.float32
    results = []
    for seed in (1, 2):
        shard = ints((4, 8), seed * 10 + rank, dtype, device)
        b = ints((8, 6), seed * 10 + 7, dtype, device)
        a_g, (o,) = asynctp.all_gather_matmul(shard, [b], 0, dist.group.WORLD, strategy="pipeline")
        r = asynctp.matmul_reduce_scatter(o, ints((6, 4), seed, dtype, device), 0, dist.group.WORLD, strategy="pipeline")
        results.append((a_g, o, r, a_g.clone(), o.clone(), r.clone()))
    for a_g, o, r, a_c, o_c, r_c in results:
        assert torch.equal(a_g, a_c) and torch.equal(o, o_c) and torch.equal(r, r_c)
    ws_obj = asynctp.get_workspace(dist.group.WORLD, device)
    for t in (x for res in results for x in res[:3]):
        for peer in range(ws):
            raw = ws_obj._raw(peer)
            start, end = raw.data_ptr(), raw.data_ptr() + raw.numel()
            assert not (start <= t.data_ptr() < end), "an output points into the workspace"


def bad_inputs(device: str) -> list[str]:
    """Each bad call raises the documented error on every rank, with no communication; the
    group works afterwards. Returns the messages (the test checks they match across ranks)."""

    rank, ws = world()
    g = dist.group.WORLD
    a = ints((6, 8), rank, torch.float32, device)
    b = ints((8, 6), 7, torch.float32, device)
    a_rs = ints((2 * ws, 8), rank, torch.float32, device)  # rows divisible by R for the scatter checks
    cases = [
        (TypeError, "a_shard requires a torch.Tensor", lambda: asynctp.all_gather_matmul([1.0], [b], 0, g)),
        (TypeError, "dtype torch.float32", lambda: asynctp.all_gather_matmul(a, [b.bfloat16()], 0, g)),
        (ValueError, "shape[0] == K = 8", lambda: asynctp.all_gather_matmul(a, [b[:5]], 0, g)),
        (ValueError, "gather_dim requires a dim in [-2, 1]", lambda: asynctp.all_gather_matmul(a, [b], 2, g)),
        (ValueError, "at least one (K, N) matrix", lambda: asynctp.all_gather_matmul(a, [], 0, g)),
        (TypeError, "list of (K, N) tensors", lambda: asynctp.all_gather_matmul(a, b, 0, g)),
        (TypeError, "ProcessGroup or its name", lambda: asynctp.all_gather_matmul(a, [b], 0, 3)),
        (ValueError, "strategy requires one of", lambda: asynctp.all_gather_matmul(a, [b], 0, g, strategy="fast")),
        (ValueError, "biases[0] requires shape (6,)", lambda: asynctp.all_gather_matmul(a, [b], 0, g, biases=[b[0, :5]])),
        (TypeError, "floating dtype", lambda: asynctp.all_gather_matmul(a.long(), [b.long()], 0, g)),
        (ValueError, "at least 2 dims", lambda: asynctp.all_gather_matmul(a[0], [b], 0, g)),
        (TypeError, "dtype torch.float32", lambda: asynctp.matmul_reduce_scatter(a, b.double(), 0, g)),
        (ValueError, "shape[0] == K = 8", lambda: asynctp.matmul_reduce_scatter(a, b.t(), 0, g)),
        (ValueError, "scatter_dim requires a dim", lambda: asynctp.matmul_reduce_scatter(a, b, -3, g)),
        (ValueError, f"divisible by the world size {ws}", lambda: asynctp.matmul_reduce_scatter(a[: ws + 1], b, 0, g)),
        (ValueError, "reduce_op requires one of", lambda: asynctp.matmul_reduce_scatter(a_rs, b, 0, g, reduce_op="max")),
        (TypeError, "ProcessGroup or its name", lambda: asynctp.matmul_reduce_scatter(a_rs, b, 0, 3)),
        (ValueError, "requires shape (6,)", lambda: asynctp.matmul_reduce_scatter(a_rs, b, 0, g, bias=b[0, :3])),
    ]
    if device == "cuda":
        cases.append((ValueError, "requires device", lambda: asynctp.all_gather_matmul(a, [b.cpu()], 0, g)))
    if ws == 3:  # divisibility along N (scatter on the last dim): N=6 divides by 2 and 3; use 4
        cases.append((ValueError, "divisible by the world size 3", lambda: asynctp.matmul_reduce_scatter(a, b[:, :4], -1, g)))
    messages = expect_errors(cases)
    # the group still works, for both ops
    a_g, (o,) = asynctp.all_gather_matmul(a, [b], 0, g)
    shards = [ints((6, 8), r, torch.float32, device) for r in range(ws)]
    assert torch.equal(a_g, torch.cat(shards))
    r = asynctp.matmul_reduce_scatter(o, ints((6, 4), 0, torch.float32, device), 0, g)
    assert r.shape == (6, 4)
    return messages


def expect_errors(cases: list) -> list[str]:
    """Each (exception type, text, call): the call raises that type with that text in its
    message. Returns the messages (tests compare them across ranks)."""
    import pytest

    messages = []
    for exc_type, text, call in cases:
        with pytest.raises(exc_type) as info:
            call()
        assert text in str(info.value), f"expected {text!r} in {str(info.value)!r}"
        messages.append(str(info.value))
    return messages


def random_calls(device: str, num_calls: int, seed: int) -> int:
    """num_calls calls in a row, random op / shape / dims / dtype (same draws on every rank)."""
    rng = random.Random(seed)
    for i in range(num_calls):
        dtype = rng.choice(list(DTYPES.values()))
        ndim = rng.choice((2, 3))
        strategy = rng.choice(("auto", "pipeline", "serial", "ring"))
        if rng.random() < 0.5:
            dim = rng.randrange(-1, ndim)
            check_ag_case(device, dtype, ndim, dim, rng.choice((1, 2)), rng.random() < 0.5, rng.random() < 0.5, strategy, seed=1000 + i)
        else:
            dim = rng.randrange(-1, ndim)
            check_rs_case(device, dtype, ndim, dim, rng.random() < 0.5, rng.choice(("sum", "avg")), strategy, seed=1000 + i)
    return num_calls


def opcheck_ops(device: str) -> None:
    rank, ws = world()
    g = dist.group.WORLD.group_name
    a = ints((4, 8), rank, torch.float32, device)
    b = ints((8, 6), 7, torch.float32, device)
    torch.library.opcheck(torch.ops.asynctp.all_gather_matmul.default, (a, [b], 0, g, True, [None], "pipeline"))
    b = ints((8, 2 * ws), 7, torch.float32, device)  # N divisible by R for the scatter on the last dim
    b_k = ints((4 * ws, 6), 8, torch.float32, device)  # gather along K: K = R * 4
    torch.library.opcheck(torch.ops.asynctp.all_gather_matmul.default, (a[:, :4], [b_k], 1, g, False, [None], "pipeline"))
    a3 = ints((2 * ws, 3, 8), rank, torch.float32, device)
    for scatter_dim in (0, 2) + ((1,) if ws == 3 else ()):
        torch.library.opcheck(torch.ops.asynctp.matmul_reduce_scatter.default, (a3, b, scatter_dim, g, "sum", None, "pipeline"))
    # the wgrad contraction (asynctp.nn under torch.compile): x [2, 3, 8] gathered along dim 1
    x = ints((2, 3, 8), rank, torch.float32, device)
    gs = [ints((2, 3 * ws, n), 9 + n, torch.float32, device) for n in (5, 2)]
    torch.library.opcheck(torch.ops.asynctp.all_gather_contract.default, (x, gs, 1, g, "pipeline"))


def large_pipeline_matches_serial() -> None:
    """Random bf16 data at a size where chunks are many GEMM tiles: the pipelined strategy equals
    the serial one up to GEMM rounding (different M per call may pick other cuBLAS kernels)."""
    rank, ws = world()
    g = dist.group.WORLD
    torch.manual_seed(1234 + rank)
    for gather_dim, shape in ((0, (1024, 1024)), (1, (2, 512, 1024))):
        a = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        torch.manual_seed(99)
        b = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16) / 32
        a_p, (o_p,) = asynctp.all_gather_matmul(a, [b], gather_dim, g, strategy="pipeline")
        a_s, (o_s,) = asynctp.all_gather_matmul(a, [b], gather_dim, g, strategy="serial")
        assert torch.equal(a_p, a_s)
        torch.testing.assert_close(o_p, o_s, rtol=2e-2, atol=2e-2)
        r_p = asynctp.matmul_reduce_scatter(o_p, b.t().contiguous(), gather_dim, g, strategy="pipeline")
        r_s = asynctp.matmul_reduce_scatter(o_p, b.t().contiguous(), gather_dim, g, strategy="serial")
        torch.testing.assert_close(r_p, r_s, rtol=2e-2, atol=5e-2)


def large_sum_pipeline_matches_cat() -> None:
    """matmul_sum_reduce_scatter on random bf16 data (the dgrad of QKV-like weights, K 1024 + 256
    + 256) against matmul_reduce_scatter of the concatenations, up to the one extra rounding per
    term; repeated calls (captured into a CUDA graph, then replayed) give the same bits."""
    from asynctp.ops.matmul_reduce_scatter import matmul_sum_reduce_scatter

    rank, ws = world()
    g = dist.group.WORLD
    torch.manual_seed(4321 + rank)
    for scatter_dim, lead in ((0, (1024 * ws,)), (1, (2, 512 * ws))):
        a_list = [torch.randn(*lead, k, device="cuda", dtype=torch.bfloat16) for k in (1024, 256, 256)]
        b_list = [torch.randn(k, 768, device="cuda", dtype=torch.bfloat16) / 32 for k in (1024, 256, 256)]
        ref = asynctp.matmul_reduce_scatter(torch.cat(a_list, -1), torch.cat(b_list, 0), scatter_dim, g, strategy="serial")
        for strategy in ("pipeline", "serial", "ring"):
            outs = [matmul_sum_reduce_scatter(a_list, b_list, scatter_dim, g, strategy=strategy) for _ in range(3)]
            torch.testing.assert_close(outs[0], ref, rtol=2e-2, atol=5e-2, msg=lambda m: f"{strategy} dim {scatter_dim}: {m}")
            assert all(torch.equal(o, outs[0]) for o in outs[1:]), f"{strategy} dim {scatter_dim}: repeated calls differ"
            assert len({o.data_ptr() for o in outs}) == 3, f"{strategy}: a replay overwrote an output the caller holds"


def cuda_graph_capture() -> None:
    """Both ops captured in one CUDA graph after reserve(); replays with new inputs are right, and
    a capture that would need a larger workspace fails with a clear error."""
    import pytest

    rank, ws = world()
    g = dist.group.WORLD
    dtype = torch.bfloat16
    asynctp.reserve(g, 16 << 20, "cuda")
    a_static = ints((64, 128), rank, dtype, "cuda", low=-1, high=2)  # |a @ b| <= 256: exact in bf16
    b = ints((128, 96), 5, dtype, "cuda")
    b2 = ints((96, 64), 6, dtype, "cuda")

    def step():
        a_g, (o,) = asynctp.all_gather_matmul(a_static, [b], 0, g, strategy="pipeline")
        return a_g, o, asynctp.matmul_reduce_scatter(o, b2, 0, g, strategy="pipeline")

    from asynctp.bench.timing import capture_graph

    replay, (a_g, o, r) = capture_graph(step, torch.device("cuda"))  # warm-up on a side stream, then capture
    for trial in range(3):
        shards = [ints((64, 128), 100 * trial + p, dtype, "cuda", low=-1, high=2) for p in range(ws)]
        a_static.copy_(shards[rank])
        replay()
        torch.cuda.synchronize()
        full = torch.cat(shards)
        assert torch.equal(a_g, full)
        assert torch.equal(o, (full.double() @ b.double()).to(dtype))
        # every rank holds the same o, so the reduction is R * (o @ b2), rounded per partial
        ref = asynctp.matmul_reduce_scatter(o, b2, 0, g, strategy="serial")
        torch.testing.assert_close(r, ref, rtol=1e-2, atol=0)
    big, b_big = ints((8192, 2048), rank, dtype, "cuda"), ints((2048, 8), 1, dtype, "cuda")
    with pytest.raises(RuntimeError, match="reserve"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            asynctp.all_gather_matmul(big, [b_big], 0, g, strategy="pipeline")
    torch.cuda.synchronize()


def no_workspace_fallback(device: str) -> None:
    """A group that cannot have a workspace (here: ASYNCTP_DISABLE_SYMM=1 when it is created)
    warns once, saying why, and "auto" still overlaps, over the send/recv ring, with exact
    results; strategy="pipeline" runs serially there."""
    import warnings

    rank, ws = world()
    asynctp.config.configure(disable_symm=True)
    try:
        group = dist.new_group(list(range(ws)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert asynctp.get_workspace(group, device) is None
        assert any("ASYNCTP_DISABLE_SYMM is set" in str(w.message) for w in caught), [str(w.message) for w in caught]
        from asynctp.ops.strategy import choose

        key = ("bfloat16", 1 << 16, 1 << 12, 1 << 12)
        assert choose("all_gather_matmul", "auto", group, torch.device(device), key)[0] == "ring"
        shards = [ints((6, 8), r, torch.float32, device) for r in range(ws)]
        b = ints((8, 6), 3, torch.float32, device)
        for strategy in ("auto", "pipeline"):
            a_g, (o,) = asynctp.all_gather_matmul(shards[rank], [b], 0, group, strategy=strategy)
            assert torch.equal(a_g, torch.cat(shards)) and torch.equal(o, torch.cat(shards) @ b)
        dist.destroy_process_group(group)
    finally:
        asynctp.config.configure(disable_symm=False)


def low_contention_collectives(device: str) -> int:
    """asynctp.all_gather / reduce_scatter on every dim against the plain reference."""
    rank, ws = world()
    g = dist.group.WORLD
    count = 0
    for dtype in DTYPES.values():
        for shape in ((3, 4), (2, 3, 4)):
            for dim in range(len(shape)):
                shards = [ints(shape, 10 * count + r, dtype, device) for r in range(ws)]
                got = asynctp.all_gather(shards[rank], dim, g)
                assert torch.equal(got, torch.cat(shards, dim=dim)), (shape, dim, dtype)
                assert got.is_contiguous(), (shape, dim, dtype, got.stride())
                full_shape = list(shape)
                full_shape[dim] *= ws
                parts = [ints(full_shape, 10 * count + 5 + r, dtype, device) for r in range(ws)]
                for reduce_op in ("sum", "avg"):
                    scale = ws if reduce_op == "avg" else 1
                    out = asynctp.reduce_scatter(parts[rank] * scale, dim, g, reduce_op=reduce_op)
                    total = sum(p.double() * scale for p in parts)
                    ref = (total / ws if reduce_op == "avg" else total).chunk(ws, dim=dim)[rank].to(dtype)
                    assert torch.equal(out, ref), (shape, dim, dtype, reduce_op)
                    assert out.is_contiguous(), (shape, dim, dtype, reduce_op, out.stride())
                count += 1
    import pytest

    with pytest.raises(ValueError, match="divisible by the world size"):
        asynctp.reduce_scatter(ints((ws + 1, 2), 0, torch.float32, device), 0, g)
    return count


def _compare_to_serial(name, call, flat, where):
    got, want = flat(call("pipeline")), flat(call("serial"))
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert torch.equal(x, y), (name, where, (x.float() - y.float()).abs().max())
    return got, [y.clone() for y in want]


def graph_replays() -> list[dict]:
    """Pipelined calls replayed from asynctp's own CUDA graphs (asynctp/runtime/graphs.py), for the
    four fused ops: inputs changed in place between calls are read anew, every result equals the
    serial strategy's exactly (small integers), an output the caller holds is never overwritten,
    and a rank that runs eagerly (ASYNCTP_GRAPHS=0 on the last rank, second round) interoperates
    with ranks that replay. Returns each round's graph-cache counts."""
    from asynctp.runtime import graphs

    rank, ws = world()
    g = dist.group.WORLD
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    f8 = torch.float8_e4m3fn
    # inputs at fixed addresses; refresh(i) writes call i's values into them
    a_bf = torch.empty((64, 128), dtype=torch.bfloat16, device="cuda")
    b_bf = ints((128, 96), 5, torch.bfloat16, "cuda")
    a_rs = torch.empty((64, 128), dtype=torch.float32, device="cuda")
    b_rs = ints((128, 96), 6, torch.float32, "cuda")
    a_f8 = torch.empty((64, 128), dtype=f8, device="cuda")
    a_scale = torch.empty((64, 1), device="cuda")
    b_f8 = ints((96, 128), 7, torch.float32, "cuda").to(f8).t()  # column-major, as weight.t()
    b_scale = torch.full((1, 96), 0.5, device="cuda")
    half = torch.full((), 0.5, device="cuda")

    def refresh(i: int) -> None:
        seed = 100 * i + rank
        a_bf.copy_(ints((64, 128), seed, torch.bfloat16, "cuda", low=-1, high=2))  # |a @ b| <= 256
        a_rs.copy_(ints((64, 128), seed + 1, torch.float32, "cuda"))
        a_f8.copy_(ints((64, 128), seed + 2, torch.float32, "cuda", low=-1, high=2).to(f8))
        a_scale.copy_(torch.where(ints((64, 1), seed + 3, torch.float32, "cuda", 0, 2) > 0, 1.0, 0.5))

    calls = {
        "all_gather_matmul": lambda s: asynctp.all_gather_matmul(a_bf, [b_bf], 0, g, strategy=s),
        "matmul_reduce_scatter": lambda s: asynctp.matmul_reduce_scatter(a_rs, b_rs, 0, g, strategy=s),
    }
    if fp8:
        calls["all_gather_scaled_matmul"] = lambda s: asynctp.all_gather_scaled_matmul(
            a_f8, [b_f8], a_scale, [b_scale], 0, g, out_dtype=torch.bfloat16, strategy=s)
        calls["scaled_matmul_reduce_scatter"] = lambda s: asynctp.scaled_matmul_reduce_scatter(
            a_f8, b_f8, half, half, 0, g, out_dtype=torch.float32, strategy=s)

    def flat(result) -> list[torch.Tensor]:
        from asynctp.runtime.keys import flatten

        return flatten(result)[0]

    counts = []
    workspace = asynctp.get_workspace(g, "cuda")
    for round_ in range(2):
        if round_ == 1 and rank == ws - 1:
            asynctp.configure(graphs="0")
        graphs.clear(workspace)
        before = graphs.stats(workspace)
        try:
            held = []
            for i in range(6):
                refresh(i)
                for name, call in calls.items():
                    # (a helper, so that no loop variable keeps an output alive)
                    kept = _compare_to_serial(name, call, flat, f"call {i}, round {round_}")
                    if i == 3:  # held across the later calls, which must not overwrite it
                        held.append((name, *kept))
                    del kept
        finally:
            asynctp.configure(graphs="auto")
        torch.cuda.synchronize()
        for name, got, want in held:
            for x, y in zip(got, want):
                assert torch.equal(x, y), (name, "a held output was overwritten")
        after = graphs.stats(workspace)
        counts.append({k: after[k] - before[k] for k in ("eager", "captured", "replayed", "replayed directly")})
        if round_ == 0 or rank != ws - 1:
            # per op: 1 eager call, 1 capture, then replays, and one more capture while call 3's
            # outputs are held; the replays of calls 2, 3 and 5 skip the op's checks and plan
            assert counts[-1]["replayed"] >= 3 * len(calls), counts[-1]
            assert counts[-1]["captured"] == 2 * len(calls), counts[-1]
            assert counts[-1]["replayed directly"] == 3 * len(calls), counts[-1]
        else:
            assert counts[-1]["replayed"] == counts[-1]["captured"] == 0, counts[-1]
    return counts


def fused_on_cpu_counted_as_decomposed(device: str) -> dict[str, int]:
    """strategy="fused" where the single-launch GEMM cannot serve (the cpu backend): the
    decomposition runs, exact against serial, and ops.dispatch.calls() counts the call under
    both "fused" and "fused: decomposed". Returns the counts' change."""
    from asynctp.ops import dispatch

    rank, ws = world()
    g = dist.group.WORLD
    a = torch.randn(8, 16, device=device, generator=torch.Generator().manual_seed(rank))
    b = torch.randn(16, 12, device=device, generator=torch.Generator().manual_seed(99))
    before = dispatch.calls()
    _, (got,) = asynctp.all_gather_matmul(a, [b], 0, g, strategy="fused")
    after = dispatch.calls()
    _, (want,) = asynctp.all_gather_matmul(a, [b], 0, g, strategy="serial")
    assert torch.equal(got, want)
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
