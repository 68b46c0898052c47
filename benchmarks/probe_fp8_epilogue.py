"""Developer probe (one GPU): can an fp8 GEMM that adds the peer's partial in its epilogue
(asynctp/ops/triton_scaled_mm.py, Triton) beat what the 2-rank fp8 reduce-scatter does for each
own block today, torch._scaled_mm then a separate addition? The reduce-scatter's own blocks at
the seed shapes: a [rows, 3584] float8 @ b [3584, 8192] (column-major), rows 1024 / 2048 / 4096
(M 4096 in 2 blocks, M 4096 in 1, M 8192 in 2), rowwise and tensorwise scales.

Columns (median us over 50 calls, CUDA events): "scaled_mm" the GEMM alone, "scaled_mm + add"
the GEMM into a partial then torch.add(received, partial) (today's own block), and the Triton
kernel with each tile config tried (pointer loads, and TMA: tensor descriptors). Every Triton result is checked against "scaled_mm + add"
first (one bf16 rounding of the summands apart at most). Writes OUT_DIR/fp8_epilogue.json.

    PROBE_ROWS=1024,2048,4096 PROBE_KINDS=rowwise,tensorwise python benchmarks/probe_fp8_epilogue.py OUT_DIR
"""

import json
import os
import sys

import torch

from asynctp.ops.triton_scaled_mm import scaled_mm_add
from benchmarks.probe_pipeline import median_us

ROWS = [int(r) for r in os.environ.get("PROBE_ROWS", "1024,2048,4096").split(",")]
KINDS = os.environ.get("PROBE_KINDS", "rowwise,tensorwise").split(",")
K_IN, N_OUT = 3584, 8192
CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, TMA)
    (128, 256, 128, 8, 3, 0), (128, 256, 64, 8, 4, 0), (128, 128, 128, 8, 4, 0), (256, 128, 128, 8, 3, 0),
    (128, 256, 128, 8, 4, 0), (128, 128, 128, 4, 4, 0), (64, 256, 128, 4, 4, 0),
    (128, 256, 128, 8, 3, 1), (128, 256, 128, 8, 4, 1), (128, 128, 128, 8, 4, 1), (128, 256, 64, 8, 4, 1),
]


def timeit(fn) -> float:
    return round(median_us(fn, iters=50, warmup=10), 1)


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

            def mm():
                torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, out=partial)

            def mm_add():
                mm()
                torch.add(received, partial, out=out)

            row = {"kind": kind, "rows": m, "k": K_IN, "n": N_OUT, "scaled_mm": timeit(mm), "scaled_mm + add": timeit(mm_add)}
            mm_add()
            want = out.float().clone()
            # one bf16 rounding of the partial apart at most, however far the sum cancels
            bound = 2**-7 * (want.abs() + partial.float().abs() + received.float().abs()) + 1e-3
            for bm, bn, bk, warps, stages, tma in CONFIGS:
                cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": stages,
                       "TMA": tma}
                name = f"triton {bm}x{bn}x{bk} w{warps} s{stages}{' tma' if tma else ''}"
                try:
                    got = torch.empty_like(out)
                    scaled_mm_add(a, b, sa, sb, received, got, config=cfg)
                    worst = ((got.float() - want).abs() / bound).max().item()
                    if worst > 1:
                        raise AssertionError(f"differs from scaled_mm + add by {worst:.2f} x the bound")
                    row[name] = timeit(lambda cfg=cfg, got=got: scaled_mm_add(a, b, sa, sb, received, got, config=cfg))
                except Exception as exc:  # noqa: BLE001  (a config that does not compile or fit: recorded)
                    row[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            timed = {k: v for k, v in row.items() if k.startswith("triton") and isinstance(v, float)}
            if timed:
                best = min(timed, key=timed.get)
                row["best triton"] = best
                row["best triton vs scaled_mm + add"] = round(timed[best] / row["scaled_mm + add"], 3)
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "fp8_epilogue.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
