"""Times asynctp's persistent GEMMs alone on one GPU against cuBLAS (torch.mm / torch._scaled_mm, fp8 with and
without fast accumulation)
at the local GEMMs of the benchmark's shape sets: flags set in advance (no wait), the per-chunk
waits live (flags set, the spin runs), the fused all-gather's call (own rows staged; and as the op makes it: own rows in
place, the gathered rows kept, `fused_ag_rows_us`), and the reduce-scatter producer. Every config of the table is
timed, so the tuned choice comes from the same run.

    python benchmarks/kernels.py OUT.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton.testing

from asynctp.kernels.async_input_mm import ChunkMap, launch
from asynctp.kernels.configs import Config, candidates
from asynctp.kernels.producer_mm import launch_producer

FP8 = torch.float8_e4m3fn
# (label, M, N, K): out [M, N] = a [M, K] @ b [K, N], b = weight.t()
SHAPES = [
    ("seed AG 4096", 4096, 3584, 8192),
    ("seed AG 8192", 8192, 3584, 8192),
    ("seed RS 4096", 4096, 8192, 3584),
    ("seed RS 8192", 8192, 8192, 3584),
    ("llama8b w13 8192", 8192, 14336, 4096),
    ("llama8b w2 8192", 8192, 4096, 7168),
]


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3  # us


def _host_us(fn, calls: int = 10, repeats: int = 11) -> float:
    """Host time of one launch: a few calls queued on an idle GPU (few enough that the launch
    queue never fills and blocks the host), the median of `repeats` such batches."""
    per_call = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(per_call)[repeats // 2]


def _operands(m, n, k, fp8):
    if fp8:
        a = (torch.randn(m, k, device="cuda") * 2).to(FP8)
        w = (torch.randn(n, k, device="cuda") * 2).to(FP8)
        return a, w.t(), torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return a, torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t(), None, None


def _cublas(a, b, sa, sb, out) -> dict[str, object]:
    """cuBLAS's GEMM of the operands into out, by the name of its time: fp8 also with fast accumulation
    (the fp8 recipes' setting, asynctp.float8, hence the ops' benchmark bound; the kernels' sm_90 fp8 dot
    accumulates as it does: Triton's default max_num_imprecise_acc there)."""
    if sa is None:
        return {"cublas_us": lambda: torch.mm(a, b, out=out)}
    return {"cublas_us": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16),
            "cublas_fast_accum_us": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16,
                                                             use_fast_accum=True)}


def _rounds(timed: dict, rounds: int) -> dict:
    """Each function's median time (us) over `rounds` interleaved rounds: clocks drift over a run, and
    interleaving keeps that out of the ratios."""
    samples = {key: [] for key in timed}
    for _ in range(rounds):
        for key, fn in timed.items():
            samples[key].append(_time(fn))
    return {key: sorted(v)[len(v) // 2] for key, v in samples.items()}


def bench_shape(label, m, n, k, fp8, world=2, quick=False, configs=None, rounds=3) -> list[dict]:
    """Every config's variants and cuBLAS, timed in `rounds` interleaved rounds (_rounds)."""
    a, b, sa, sb = _operands(m, n, k, fp8)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    refs = _cublas(a, b, sa, sb, out)
    ref = refs["cublas_us"]().clone()
    flags = torch.ones(world * 4, dtype=torch.int32, device="cuda")
    cands = configs or (candidates(a.dtype)[:1] if quick else candidates(a.dtype))
    rows, timed = [], {(name, -1): fn for name, fn in refs.items()}
    for i, cfg in enumerate(cands):
        row = {"shape": label, "m": m, "n": n, "k": k, "dtype": "fp8 rowwise" if fp8 else "bf16",
               "config": cfg.__dict__.copy()}
        rows.append(row)
        try:
            def plain(cfg=cfg):
                launch(a, b, out, None, (1, 1, 0), m, 0, ChunkMap(), a_scale=sa, b_scale=sb, config=cfg)

            def waits(cfg=cfg):
                launch(a, b, out, flags, (world, 1, 0), m // world, 1, ChunkMap(), a_scale=sa, b_scale=sb,
                       config=cfg)

            plain()
            sqnr = 10 * torch.log10(ref.double().pow(2).mean() / (out.double() - ref.double()).pow(2).mean())
            row["sqnr_db"] = float(sqnr)
            row["launch_host_us"] = _host_us(plain)
            timed.update({("no_wait_us", i): plain, ("waits_us", i): waits,
                          ("fused_ag_us", i): _fused_ag(a, b, sa, sb, out, world, cfg)})
            if sa is None:  # in place: the own rows read from their own tensor
                timed[("fused_ag_in_place_us", i)] = _fused_ag(a, b, sa, sb, out, world, cfg, in_place=True)
            # the op's call: the own rows (and scales) read in place, the gathered rows kept (the Gluon GEMM
            # stores them; beside the Triton kernel the op copies them on a copy engine, not timed here)
            timed[("fused_ag_rows_us", i)] = _fused_ag(a, b, sa, sb, out, world, cfg, in_place=True, row=row)
            for name in ("waits_us", "fused_ag_us", "fused_ag_in_place_us", "fused_ag_rows_us"):  # compiled here
                if (name, i) in timed:
                    timed[(name, i)]()
        except Exception as exc:  # a config that does not compile or fit is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            timed = {key: fn for key, fn in timed.items() if key[1] != i}
    med = _rounds(timed, rounds)
    for (name, i), us in med.items():
        for row in (rows if i < 0 else [rows[i]]):  # cuBLAS's (i < 0) in every row
            row[name] = us
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def _fused_ag(a, b, sa, sb, out, world, cfg, in_place=False, row=None):
    """The all-gather's call: rank 0 of `world`, the own rows staged on the same stream (an
    upper bound: the op stages them on a copy engine beside the GEMM), every remote flag set,
    flags reset by the kernel (set again before each run). row (a result row): the gathered rows
    kept, row["stores_rows"] whether the GEMM stored them."""
    m, k = a.shape
    shard = m // world
    mine = a[:shard].clone()
    flags = torch.ones(world, dtype=torch.int32, device="cuda")
    counters = torch.zeros(world, dtype=torch.int32, device="cuda")
    gathered = torch.empty_like(a) if row is not None else None

    def run():
        flags.fill_(1)
        if not in_place:
            a[:shard].copy_(mine)  # the staging copy of the own rows
        stored = launch(a, b, out, flags, (world, 1, 0), shard, 0, ChunkMap(local_src=0), counters=counters,
                        a_scale=sa, b_scale=sb, config=cfg, a_local=mine if in_place else None, gathered=gathered)
        if row is not None:
            row["stores_rows"] = stored

    return run


def bench_producer(label, m, n, k, fp8, world=2, blocks=2, configs=None, rounds=3) -> list[dict]:
    """The reduce-scatter producer, every flag set (own blocks never wait), for each config (None:
    the picked one), against one GEMM; timed in interleaved rounds. Each timed call re-arms the flags
    and zeroes the counters first (two small kernels); `reset_us` is their time alone."""
    a, b, sa, sb = _operands(m, n, k, fp8)
    shard = m // world
    out = torch.empty(shard, n, device="cuda", dtype=torch.bfloat16)
    partials = torch.empty(world - 1, shard, n, device="cuda", dtype=torch.bfloat16)
    received = torch.randn(world, shard, n, device="cuda").to(torch.bfloat16)
    flags = torch.ones(world * blocks, dtype=torch.int32, device="cuda")
    counters = torch.zeros(world * blocks + blocks, dtype=torch.int32, device="cuda")
    full = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def reset():
        flags.fill_(1)
        counters.zero_()

    def run(cfg):
        reset()
        return launch_producer(a, b, partials, received, out, 0, world, blocks, (shard, shard // blocks), flags,
                               (1, world), counters, a_scale=sa, b_scale=sb, config=cfg)[1]

    timed = {**_cublas(a, b, sa, sb, full), "reset_us": reset}
    rows = []
    for i, cfg in enumerate(configs or [None]):
        row = {"shape": label, "m": m, "n": n, "k": k, "dtype": "fp8 rowwise" if fp8 else "bf16", "blocks": blocks}
        try:
            row["config"] = run(cfg).__dict__.copy()
            timed[i] = lambda cfg=cfg: run(cfg)
        except Exception as exc:  # a config that does not compile or fit is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
    med = _rounds(timed, rounds)
    for i, row in enumerate(rows):
        row.update({key: us for key, us in med.items() if isinstance(key, str)})
        if i in med:
            row["producer_us"] = med[i]
        print(json.dumps(row), flush=True)
    return rows


def probe_local_copy(nbytes: int = 64 << 20) -> dict:
    """Whether a same-device copy (torch's copy_, cudaMemcpyAsync) runs while a GEMM holds every
    SM waiting for it: the GEMM spins on a flag that another stream writes after the copy. If
    the copy needed an SM it could not start; after 5 s the host sets the flag itself."""
    from asynctp.symm import streamops

    ops = streamops.load()
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty(8192, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    side, rescue = torch.cuda.Stream(), torch.cuda.Stream()
    launch(a, b, out, flag, (1, 1, 0), 8192, 0, ChunkMap())  # queued: spins until the flag is set
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.005)
    with torch.cuda.stream(side):
        dst.copy_(src)
        ops.write(side.cuda_stream, flag.data_ptr(), 1)
    deadline = time.monotonic() + 5
    while not done.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    finished = done.query()
    if not finished:
        ops.write(rescue.cuda_stream, flag.data_ptr(), 1)
    torch.cuda.synchronize()
    row = {"copy_ran_beside_a_waiting_gemm": finished, "bytes": nbytes, "copy_exact": bool(torch.equal(dst, src))}
    print(json.dumps(row), flush=True)
    return row


def _config(spec: str) -> Config:
    """BMxBNxBK:stages:warps[:nf][:ns][:gN] -> Config (nf: tile loop not flattened; ns: last wave not split;
    gN: N m-tiles per group of the tile order)."""
    parts = spec.split(":")
    bm, bn, bk = map(int, parts[0].split("x"))
    group = [int(p[1:]) for p in parts[3:] if p.startswith("g")]
    return Config(bm, bn, bk, stages=int(parts[1]), warps=int(parts[2]), flatten="nf" not in parts[3:],
                  split="ns" not in parts[3:], **({"group_m": group[0]} if group else {}))


def _tag(c: dict) -> str:
    """A config (Config.__dict__) in --configs' spec format."""
    return (f"{c['block_m']}x{c['block_n']}x{c['block_k']}:{c['stages']}:{c['warps']}{'' if c['flatten'] else ':nf'}"
            f"{'' if c['split'] else ':ns'}:g{c['group_m']}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--quick", action="store_true", help="the default config only")
    parser.add_argument("--shapes", default="", help="only shapes whose label contains this")
    parser.add_argument("--dtypes", default="bf16,fp8", help="bf16, fp8 or both")
    parser.add_argument("--configs", default="", help="comma-separated BMxBNxBK:stages:warps[:nf][:ns][:gN] to time "
                        "instead of the table's (with both dtypes: BK 128 for fp8, the others for bf16)")
    parser.add_argument("--no-producer", action="store_true")
    parser.add_argument("--producer-only", action="store_true", help="only the reduce-scatter producer (--configs: "
                        "each of them)")
    parser.add_argument("--probe-copy", action="store_true", help="also probe_local_copy()")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "command": " ".join(sys.argv), "gemm": [], "producer": []}
    if args.probe_copy:
        result["local_copy"] = probe_local_copy()
    configs = [_config(c) for c in args.configs.split(",") if c] or None
    dtypes = args.dtypes.split(",")
    for fp8 in [d == "fp8" for d in dtypes]:
        # one dtype: every config; both: the table's fp8 tiles have BK 128
        picked = [c for c in configs or [] if len(dtypes) == 1 or (c.block_k == 128) == fp8]
        for label, m, n, k in SHAPES:
            if args.shapes not in label:
                continue
            if not args.producer_only:
                result["gemm"] += bench_shape(label, m, n, k, fp8, quick=args.quick, configs=picked or None)
            if not args.no_producer and ("RS" in label or "w2" in label):
                result["producer"] += bench_producer(label, m, n, k, fp8, configs=picked or None)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'shape':20} {'dtype':12} {'config':24} {'cublas':>7} {'fast':>7} {'nowait':>7} {'waits':>7} "
          f"{'fusedAG':>8} {'inplace':>8} ratio")
    for r in result["gemm"]:
        if "launch_host_us" in r:
            print(f"host us per launch: {r['launch_host_us']:.1f}")
            break
    for r in result["gemm"]:
        tag = _tag(r["config"])
        if "error" in r:
            print(f"{r['shape']:20} {r['dtype']:12} {tag:24} {r['error'][:60]}")
            continue
        fast = r.get("cublas_fast_accum_us", float("nan"))
        print(f"{r['shape']:20} {r['dtype']:12} {tag:24} {r['cublas_us']:7.1f} {fast:7.1f} {r['no_wait_us']:7.1f} "
              f"{r['waits_us']:7.1f} {r['fused_ag_us']:8.1f} {r.get('fused_ag_in_place_us', float('nan')):8.1f} {r['cublas_us'] / r['waits_us']:.3f}")
    for r in result["producer"]:
        tag = _tag(r["config"]) if "config" in r else "-"
        print(f"producer {r['shape']:20} {r['dtype']:12} {tag:24} cublas {r['cublas_us']:.1f} "
              f"(fast accumulation {r.get('cublas_fast_accum_us', float('nan')):.1f}) reset {r['reset_us']:.1f} "
              f"producer {r.get('producer_us', float('nan')):.1f} {r.get('error', '')[:80]}")


if __name__ == "__main__":
    sys.exit(main())
