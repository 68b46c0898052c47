"""Developer probe (one GPU): cuBLASLt's fp8 candidates for the 2-rank fp8 reduce-scatter's own
blocks (a [rows, 3584] @ b [3584, 8192], tensorwise scales), each timed with the received
partial added in the epilogue (beta = 1) and without, against what the op does by default
(torch._scaled_mm, then torch.add). Answers: is any candidate's beta = 1 GEMM close to the GEMM
alone, and does asynctp.ops.cublaslt's own tuning (algo=None) find it? Also asks whether
cuBLASLt has rowwise (outer-vector) scales on this GPU. Median us over 50 calls (CUDA events).
Writes OUT_DIR/cublaslt_algos.json.

    PROBE_ROWS=1024,2048,4096 python benchmarks/probe_cublaslt_algos.py OUT_DIR
"""

import json
import os
import sys

import torch

from asynctp.bench.timing import median_us
from asynctp.ops import cublaslt

ROWS = [int(r) for r in os.environ.get("PROBE_ROWS", "1024,2048,4096").split(",")]
K_IN, N_OUT = 3584, 8192


def timeit(fn) -> float:
    return round(median_us(fn, 50, 10, torch.device("cuda", torch.cuda.current_device())), 1)


def main(out_dir: str) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "rowwise supported": cublaslt.supports(True, torch.cuda.current_device()) or "yes", "rows": []}
    print(f"rowwise (outer-vector) scales: {record['rowwise supported']}", flush=True)
    for m in ROWS:
        a = (torch.randn(m, K_IN, device=dev) / 2).to(torch.float8_e4m3fn)
        b = (torch.randn(N_OUT, K_IN, device=dev) / 2).to(torch.float8_e4m3fn).t()
        sa, sb = torch.tensor(0.5, device=dev), torch.tensor(0.25, device=dev)
        received = torch.randn(m, N_OUT, device=dev).bfloat16()
        partial, out = torch.empty_like(received), torch.empty_like(received)
        ref = (a.float() @ b.float()) * sa * sb + received.float()
        row = {"rows": m}
        for fast in (False, True):
            tag = " fast" if fast else ""
            row["scaled_mm" + tag] = timeit(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, out=partial,
                                                                      use_fast_accum=fast))

            def mm_add():
                torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, out=partial, use_fast_accum=fast)
                torch.add(received, partial, out=out)

            row["scaled_mm + add" + tag] = timeit(mm_add)
            configs = cublaslt.candidate_configs(a, b, False, out, fast)
            for with_c in (False, True):
                c = received if with_c else None
                times = [timeit(lambda i=i: cublaslt.scaled_mm_lt(a, b, sa, sb, c, out, fast_accum=fast, algo=i))
                         for i in range(len(configs))]
                cublaslt.scaled_mm_lt(a, b, sa, sb, c, out, fast_accum=fast)  # tunes
                tuned = timeit(lambda: cublaslt.scaled_mm_lt(a, b, sa, sb, c, out, fast_accum=fast))
                if with_c:
                    row["rel err tuned + c" + tag] = float(f"{((out.float() - ref).norm() / ref.norm()).item():.3g}")
                name = f"lt{' + c' if with_c else ''}{tag}"
                row[name + " candidates"] = [{**cfg, "us": t} for cfg, t in zip(configs, times)]
                row[name + " tuned"] = tuned
            print(f"rows {m}{tag}: scaled_mm {row['scaled_mm' + tag]} | +add {row['scaled_mm + add' + tag]} | "
                  f"lt {row['lt' + tag + ' tuned']} | lt + c tuned {row['lt + c' + tag + ' tuned']} "
                  f"(err {row['rel err tuned + c' + tag]}) | candidates + c: "
                  + " ".join(f"[t{c.get('tile')} s{c.get('stages')} k{c.get('splitk')} r{c.get('reduction')}"
                             f" cl{c.get('cluster_shape')}] {c['us']}" for c in row["lt + c" + tag + " candidates"])
                  + " | without c: " + " ".join(str(c["us"]) for c in row["lt" + tag + " candidates"]), flush=True)
        record["rows"].append(row)
    record["tuning"] = cublaslt.tuning()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "cublaslt_algos.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
