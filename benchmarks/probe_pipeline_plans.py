"""Developer probe (not the benchmark): the pipelined all-gather and reduce-scatter plans side by
side on one machine, bf16 and fp8 (rowwise, tensorwise), seed shapes (N 3584, K 8192), all local
GPUs: gather mode (push / pull), row blocks, lockstep, the gathered output kept or not, the
reduce-scatter's side-stream reduction on/off, and its GEMMs storing remote partials straight into
the owners' slots (ASYNCTP_RS_DIRECT; PROBE_DIRECT=0 skips them), and, bf16 on 2 ranks, its
reduction without the GEMM epilogue (ASYNCTP_RS_EPILOGUE=0), and with PROBE_LT=1, fp8 on 2 ranks,
the own blocks' addition in cuBLASLt's epilogue (ASYNCTP_FP8_EPILOGUE=cublaslt, 1-4 blocks; its
largest difference from serial is recorded, not asserted: one rounding instead of two). Every variant is checked against serial (exact)
before it is timed. Times: median us over 30 eager calls, slowest rank (eager calls replay from
asynctp's CUDA graphs after their second sighting, as in training).

    PROBE_M=4096,8192 PROBE_KINDS=bf16,rowwise,tensorwise PROBE_OPS=ag,rs PROBE_BATCH=1 python benchmarks/probe_pipeline_plans.py OUT_DIR

PROBE_BATCH=B > 1 adds the batch-major order (`*_batch_major`, ASYNCTP_BATCH_MAJOR=1) beside the
grid (front order, ASYNCTP_BATCH_MAJOR=0); "auto" is the library's default. PROBE_GRID=0 keeps
only push with 1-2 row blocks (and the reduce-scatter's side-stream reduction).
"""

import itertools
import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.probe_pipeline import finish, timeit, with_env  # noqa: E402  (median us, max over ranks)

MS = [int(s) for s in os.environ.get("PROBE_M", "4096,8192").split(",")]
KINDS = os.environ.get("PROBE_KINDS", "bf16,rowwise,tensorwise").split(",")
OPS = os.environ.get("PROBE_OPS", "ag,rs").split(",")
BATCH = int(os.environ.get("PROBE_BATCH", "1"))  # > 1: a batch, [B, rows / B, K], gathered / scattered along dim 1
FULL = os.environ.get("PROBE_GRID", "1") == "1"  # "0": only the default plans' front vs batch-major order
E4M3 = torch.float8_e4m3fn


def envs(**kv):
    """fn -> fn called with the environment variables set (None: unset)."""
    def wrap(fn):
        for name, value in kv.items():
            if value is not None:
                fn = with_env(name, value, fn)
        return fn
    return wrap


def ag_case(kind, M, g, ws):
    import asynctp

    K, N = 8192, 3584
    dev = dict(device="cuda")
    a = torch.randn(M // ws, K, **dev)
    b = torch.randn(N, K, **dev) / 64
    dim = 0
    if BATCH > 1:  # sequence-parallel layout of a batch: shards [B, S / R, K], gathered along S
        a, dim = a.view(BATCH, M // ws // BATCH, K), 1
    if kind == "bf16":
        a, b = a.bfloat16(), b.bfloat16().t()
        full = torch.empty(M, K, **dev, dtype=torch.bfloat16)
        mm = lambda: torch.mm(full, b)  # noqa: E731
        call = lambda s, ra: asynctp.all_gather_matmul(a, [b], dim, g, return_a=ra, strategy=s)  # noqa: E731
        return a, mm, call
    rowwise = kind == "rowwise"
    a8, b8 = a.to(E4M3), b.to(E4M3).t()
    sa = (torch.rand(*a.shape[:-1], 1, **dev) + 0.5) if rowwise else torch.tensor(0.5, **dev)
    sb = (torch.rand(1, N, **dev) + 0.5) if rowwise else torch.tensor(0.25, **dev)
    full, sfull = torch.empty(M, K, **dev, dtype=E4M3), (torch.ones(M, 1, **dev) if rowwise else sa)
    mm = lambda: torch._scaled_mm(full, b8, sfull, sb, out_dtype=torch.bfloat16)  # noqa: E731
    call = lambda s, ra: asynctp.all_gather_scaled_matmul(a8, [b8], sa, [sb], dim, g, return_a=ra, strategy=s)  # noqa: E731
    return a8, mm, call


def rs_case(kind, M, g, ws):
    import asynctp

    K, N = 3584, 8192
    dev = dict(device="cuda")
    a = torch.randn(M, K, **dev)
    b = torch.randn(N, K, **dev) / 64
    dim = 0
    if BATCH > 1:  # sequence-parallel layout of a batch: [B, S, K], scattered along S
        a, dim = a.view(BATCH, M // BATCH, K), 1
    if kind == "bf16":
        a, b = a.bfloat16(), b.bfloat16().t()
        return (lambda: torch.mm(a.view(-1, K), b)), lambda s: asynctp.matmul_reduce_scatter(a, b, dim, g, strategy=s)
    rowwise = kind == "rowwise"
    a8, b8 = a.to(E4M3), b.to(E4M3).t()
    sa = (torch.rand(*a.shape[:-1], 1, **dev) + 0.5) if rowwise else torch.tensor(0.5, **dev)
    sb = (torch.rand(1, N, **dev) + 0.5) if rowwise else torch.tensor(0.25, **dev)
    mm = lambda: torch._scaled_mm(a8.view(-1, K), b8, sa.view(-1, 1) if rowwise else sa, sb, out_dtype=torch.bfloat16)  # noqa: E731
    call = lambda s: asynctp.scaled_matmul_reduce_scatter(a8, b8, sa, sb, dim, g, strategy=s)  # noqa: E731
    return mm, call


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return torch.equal(x, y)
    if x is None or y is None:
        return x is y
    return all(same(p, q) for p, q in zip(x, y))


def main(rank, ws, out):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29535", rank=rank, world_size=ws)
    g = dist.group.WORLD
    rows = []
    for kind, M in itertools.product(KINDS, MS):
        if "ag" in OPS:
            rows.append(probe_ag(kind, M, g, ws, rank))
        if "rs" in OPS:
            rows.append(probe_rs(kind, M, g, ws, rank))
        torch.cuda.empty_cache()
    finish(rank, os.path.join(out, "pipeline_plans.json"), rows)


def probe_ag(kind, M, g, ws, rank) -> dict:
    torch.manual_seed(rank)
    shard, mm, call = ag_case(kind, M, g, ws)
    gathered = torch.empty(ws * shard.numel(), device="cuda", dtype=shard.dtype)
    r = {"op": "ag", "kind": kind, "M": M, "batch": BATCH, "mm": timeit(mm),
         "comm": timeit(lambda: dist.all_gather_into_tensor(gathered.view(torch.uint8), shard.reshape(-1).view(torch.uint8), group=g)),
         "serial": timeit(lambda: call("serial", False))}
    ref = call("serial", True)
    grid = itertools.product(("push", "pull"), (1, 2, 4), (1, 0), (False, True)) if FULL else \
        itertools.product(("push",), (1, 2), (1,), (False, True))
    for mode, sp, ls, ra in grid:  # front order (the batch-major order below)
        fn = envs(ASYNCTP_GATHER=mode, ASYNCTP_SPLITS=sp, ASYNCTP_LOCKSTEP=ls, ASYNCTP_BATCH_MAJOR=0)(
            lambda ra=ra: call("pipeline", ra))
        got = fn()
        ok = same(got[1], ref[1]) and (not ra or same(got[0], ref[0]))
        assert ok, f"ag {kind} M{M} {mode} s{sp} l{ls} ra{ra}: differs from serial"
        r[f"{mode}_s{sp}_l{ls}{'_ra' if ra else ''}"] = timeit(fn)
    if BATCH > 1:  # the caller's row order kept (no copies), one GEMM per batch element
        for sp, ra in itertools.product((1, 2), (False, True)):
            fn = envs(ASYNCTP_SPLITS=sp, ASYNCTP_BATCH_MAJOR=1)(lambda ra=ra: call("pipeline", ra))
            got = fn()
            assert same(got[1], ref[1]) and (not ra or same(got[0], ref[0])), f"ag {kind} M{M} s{sp} batch-major"
            r[f"push_s{sp}_batch_major{'_ra' if ra else ''}"] = timeit(fn)
    r["auto"] = timeit(lambda: call("auto", False))
    if rank == 0:
        print(json.dumps(r), flush=True)
    return r


def probe_rs(kind, M, g, ws, rank) -> dict:
    torch.manual_seed(rank)
    mm, call = rs_case(kind, M, g, ws)
    r = {"op": "rs", "kind": kind, "M": M, "batch": BATCH, "mm": timeit(mm), "serial": timeit(lambda: call("serial"))}
    ref = call("serial")
    for sp, side in itertools.product((1, 2, 4) if FULL else (1, 2), ("1", "0") if FULL else ("1",)):
        if kind == "bf16" and side == "0":
            continue  # bf16 with 2 ranks reduces in the GEMM's epilogue
        fn = envs(ASYNCTP_SPLITS=sp, ASYNCTP_SIDE_REDUCE=side, ASYNCTP_BATCH_MAJOR=0)(lambda: call("pipeline"))
        got = fn()
        if ws == 2:
            assert torch.equal(got, ref), f"rs {kind} M{M} s{sp} side{side}: differs from serial"
        r[f"s{sp}_side{side}"] = timeit(fn)
    for sp in (1, 2, 4) if kind == "bf16" and ws == 2 else ():  # 2 bf16 ranks reduce as fp8 does: no epilogue
        fn = envs(ASYNCTP_SPLITS=sp, ASYNCTP_RS_EPILOGUE=0, ASYNCTP_BATCH_MAJOR=0)(lambda: call("pipeline"))
        r[f"s{sp}_no_epilogue_exact"] = bool(torch.equal(fn(), ref))  # one rounding fewer than the epilogue? recorded
        r[f"s{sp}_no_epilogue"] = timeit(fn)
    for sp in (1, 2, 3, 4) if kind != "bf16" and ws == 2 and os.environ.get("PROBE_LT") == "1" else ():
        # fp8 on 2 ranks: the own blocks add the received partial in cuBLASLt's epilogue (one rounding)
        fn = envs(ASYNCTP_SPLITS=sp, ASYNCTP_FP8_EPILOGUE="cublaslt", ASYNCTP_BATCH_MAJOR=0)(lambda: call("pipeline"))
        got = fn()
        r[f"s{sp}_cublaslt_max_diff"] = float((got.float() - ref.float()).abs().max())  # vs two roundings
        r[f"s{sp}_cublaslt"] = timeit(fn)
        if sp > 1:  # only the last own block in the epilogue: the exposed tail addition gone
            fn = envs(ASYNCTP_SPLITS=sp, ASYNCTP_FP8_EPILOGUE="cublaslt", ASYNCTP_RS_EPILOGUE="last",
                      ASYNCTP_BATCH_MAJOR=0)(lambda: call("pipeline"))
            got = fn()
            r[f"s{sp}_cublaslt_last_max_diff"] = float((got.float() - ref.float()).abs().max())
            r[f"s{sp}_cublaslt_last"] = timeit(fn)
    for sp in (2, 3, 4) if kind == "bf16" and ws == 2 and os.environ.get("PROBE_LT") == "1" else ():
        # bf16: only the last own block in addmm's epilogue, the others by additions (exactness recorded)
        fn = envs(ASYNCTP_SPLITS=sp, ASYNCTP_RS_EPILOGUE="last", ASYNCTP_BATCH_MAJOR=0)(lambda: call("pipeline"))
        r[f"s{sp}_epilogue_last_exact"] = bool(torch.equal(fn(), ref))
        r[f"s{sp}_epilogue_last"] = timeit(fn)
    for sp in (1, 2, 4) if FULL and os.environ.get("PROBE_DIRECT", "1") == "1" else ():  # remote partials stored by their GEMMs into the owners' slots
        fn = envs(ASYNCTP_SPLITS=sp, ASYNCTP_RS_DIRECT=1, ASYNCTP_BATCH_MAJOR=0)(lambda: call("pipeline"))
        got = fn()
        if ws == 2:
            assert torch.equal(got, ref), f"rs {kind} M{M} s{sp} direct: differs from serial"
        r[f"s{sp}_direct"] = timeit(fn)
    if BATCH > 1:  # the caller's row order kept (no copies), one GEMM per batch element
        for sp in (1, 2):
            fn = envs(ASYNCTP_SPLITS=sp, ASYNCTP_BATCH_MAJOR=1)(lambda: call("pipeline"))
            got = fn()
            if ws == 2:
                assert torch.equal(got, ref), f"rs {kind} M{M} s{sp} batch-major: differs from serial"
            r[f"s{sp}_batch_major"] = timeit(fn)
    r["auto"] = timeit(lambda: call("auto"))
    if rank == 0:
        print(json.dumps(r), flush=True)
    return r


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    n = torch.cuda.device_count()
    mp.spawn(main, args=(n, sys.argv[1]), nprocs=n)
