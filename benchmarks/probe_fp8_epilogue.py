"""Developer probe (one GPU): can an fp8 GEMM that adds the peer's partial in its epilogue
(asynctp/ops/triton_scaled_mm.py, Triton) beat what the 2-rank fp8 reduce-scatter does for each
own block today, torch._scaled_mm then a separate addition? The reduce-scatter's own blocks at
the seed shapes: a [rows, 3584] float8 @ b [3584, 8192] (column-major), rows 1024 / 2048 / 4096
(M 4096 in 2 blocks, M 4096 in 1, M 8192 in 2), rowwise and tensorwise scales.

Columns (median us over 50 calls, CUDA events): "scaled_mm" the GEMM alone, "scaled_mm + add"
the GEMM into a partial then torch.add(received, partial) (today's own block), the same with
use_fast_accum, and the Triton kernel with each tile config (pointer loads, and TMA: tensor
descriptors) and accumulation (PROMOTE_K: "k<BLOCK_K>" promotes to fp32 once per loop step, "k0"
after every MMA, "fast" never, Triton's sm_90 default). Each also gets its error against fp32
math on the same fp8 values (a.float() @ b.float() * scales + received): "err ..." is the pair
(worst element in units of 2^-8 x (|result| + |product|) + 1e-3, about one bf16 rounding each;
||got - ref|| / ||ref||). A Triton variant passes when its err is at most 2x cuBLAS's (non-fast)
one; a failed variant is timed anyway and marked. With PROBE_LT=1 (default) also cuBLASLt called
directly (asynctp/ops/cublaslt.py, ctypes): "cublasLt" the GEMM alone, "cublasLt + c" with
the received partial added in its epilogue (beta = 1, c apart from the output), and its fast
variant: the accumulate epilogue torch._scaled_mm lacks. Writes OUT_DIR/fp8_epilogue.json.

    PROBE_ROWS=1024,2048,4096 PROBE_KINDS=rowwise,tensorwise PROBE_PROMOTE=block,fast,0 \
        PROBE_CONFIGS="256,128,128,8,3,0;256,128,128,8,4,1,16" python benchmarks/probe_fp8_epilogue.py OUT_DIR
"""

import json
import os
import sys

import torch

from asynctp.bench.timing import median_us
from asynctp.ops.cublaslt import scaled_mm_lt
from asynctp.ops.triton_scaled_mm import scaled_mm_add

ROWS = [int(r) for r in os.environ.get("PROBE_ROWS", "1024,2048,4096").split(",")]
KINDS = os.environ.get("PROBE_KINDS", "rowwise,tensorwise").split(",")
K_IN, N_OUT = 3584, 8192
CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, TMA)
    (128, 256, 128, 8, 3, 0), (128, 256, 64, 8, 4, 0), (128, 128, 128, 8, 4, 0), (256, 128, 128, 8, 3, 0),
    (128, 256, 128, 8, 4, 0), (128, 128, 128, 4, 4, 0), (64, 256, 128, 4, 4, 0),
    (128, 256, 128, 8, 3, 1), (128, 256, 128, 8, 4, 1), (128, 128, 128, 8, 4, 1), (128, 256, 64, 8, 4, 1),
]
if os.environ.get("PROBE_CONFIGS"):  # "bm,bn,bk,warps,stages,tma[,group_m];..."
    CONFIGS = [tuple(int(v) for v in c.split(",")) for c in os.environ["PROBE_CONFIGS"].split(";")]
PROMOTES = os.environ.get("PROBE_PROMOTE", "block,fast,0").split(",")
LT = os.environ.get("PROBE_LT", "1") == "1"  # the cuBLASLt columns (asynctp/ops/cublaslt.py)


def timeit(fn) -> float:
    return round(median_us(fn, 50, 10, torch.device("cuda", torch.cuda.current_device())), 1)


def errors(got: torch.Tensor, ref: torch.Tensor, product: torch.Tensor) -> tuple[float, float]:
    diff = (got.float() - ref).abs()
    worst = (diff / (2**-8 * (ref.abs() + product.abs()) + 1e-3)).max().item()
    return round(worst, 2), float(f"{(diff.norm() / ref.norm()).item():.3g}")


def main(out_dir: str) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    rows_out = []
    for kind in KINDS:
        for m in ROWS:
            a = (torch.randn(m, K_IN, device=dev) / 2).to(torch.float8_e4m3fn)
            b = (torch.randn(N_OUT, K_IN, device=dev) / 2).to(torch.float8_e4m3fn).t()
            if kind == "rowwise":
                sa = torch.rand(m, 1, device=dev) + 0.5
                sb = torch.rand(1, N_OUT, device=dev) + 0.5
            else:
                sa, sb = torch.tensor(0.5, device=dev), torch.tensor(0.25, device=dev)
            received = torch.randn(m, N_OUT, device=dev).bfloat16()
            partial = torch.empty(m, N_OUT, device=dev, dtype=torch.bfloat16)
            out = torch.empty_like(partial)
            product = (a.float() @ b.float()) * sa * sb  # exact products, fp32 sums (TF32 is off)
            ref = product + received.float()

            def mm(fast=False):
                torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, out=partial, use_fast_accum=fast)

            def mm_add(fast=False):
                mm(fast)
                torch.add(received, partial, out=out)

            row = {"kind": kind, "rows": m, "k": K_IN, "n": N_OUT, "scaled_mm": timeit(mm), "scaled_mm + add": timeit(mm_add),
                   "scaled_mm fast + add": timeit(lambda: mm_add(True))}
            mm_add()
            row["err scaled_mm + add"] = errors(out, ref, product)
            mm_add(True)
            row["err scaled_mm fast + add"] = errors(out, ref, product)
            allowed = max(2 * row["err scaled_mm + add"][0], 2.0)
            if LT:  # cuBLASLt called directly: the same GEMM, then with the addition in its epilogue
                for name, c, fast in (("cublasLt", None, False), ("cublasLt + c", received, False),
                                      ("cublasLt fast + c", received, True)):
                    try:
                        got = torch.empty_like(out)
                        scaled_mm_lt(a, b, sa, sb, c, got, fast_accum=fast)
                        row["err " + name] = errors(got, product if c is None else ref, product)
                        row[name] = timeit(lambda c=c, fast=fast, got=got: scaled_mm_lt(a, b, sa, sb, c, got, fast_accum=fast))
                    except Exception as exc:  # noqa: BLE001  (no binding, no algorithm: recorded)
                        row[name] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
                print(f"{kind} rows {m}: " + " | ".join(f"{k} {row.get(k)} err {row.get('err ' + k)}" for k in
                      ("scaled_mm", "scaled_mm + add", "cublasLt", "cublasLt + c", "scaled_mm fast + add", "cublasLt fast + c")),
                      flush=True)
            for bm, bn, bk, warps, stages, tma, *group in CONFIGS:
                gm = group[0] if group else 8
                for promote in PROMOTES:
                    pk = bk if promote == "block" else None if promote == "fast" else int(promote)
                    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": warps, "num_stages": stages,
                           "TMA": tma, "PROMOTE_K": pk}
                    name = (f"triton {bm}x{bn}x{bk} w{warps} s{stages}{' tma' if tma else ''}{f' g{gm}' if gm != 8 else ''}"
                            f" k{'fast' if pk is None else pk}")
                    try:
                        got = torch.empty_like(out)
                        scaled_mm_add(a, b, sa, sb, received, got, config=cfg)
                        err = errors(got, ref, product)
                        t = timeit(lambda cfg=cfg, got=got: scaled_mm_add(a, b, sa, sb, received, got, config=cfg))
                        row[name] = t if err[0] <= allowed else f"inexact {t}"
                        row["err " + name] = err
                    except Exception as exc:  # noqa: BLE001  (a config that does not compile or fit: recorded)
                        row[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            timed = {k: v for k, v in row.items() if k.startswith("triton") and isinstance(v, float)}
            if timed:
                best = min(timed, key=timed.get)
                row["best triton"] = best
                row["best triton vs scaled_mm + add"] = round(timed[best] / row["scaled_mm + add"], 3)
            ranked = sorted((v, k) for k, v in timed.items())[:4]
            print(f"{kind} rows {m}: scaled_mm {row['scaled_mm']} | +add {row['scaled_mm + add']} err {row['err scaled_mm + add']}"
                  f" | fast+add {row['scaled_mm fast + add']} err {row['err scaled_mm fast + add']} | best exact triton: "
                  + "; ".join(f"{k[7:]} {v} err {row['err ' + k]}" for v, k in ranked)
                  + f" | inexact: {sum(isinstance(v, str) and v.startswith('inexact') for v in row.values())}"
                  f" failed: {sum(isinstance(v, str) and v.startswith('failed') for v in row.values())}", flush=True)
            rows_out.append(row)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "fp8_epilogue.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
