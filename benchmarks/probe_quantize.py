"""The fp8 quantization of the 8B block's operands, Triton kernels vs the torch formulas (one GPU):
microseconds per call (CUDA events, median of 50 after 5 warm-up calls) and whether the bytes agree.

    python benchmarks/probe_quantize.py [OUT_DIR]
"""

import json
import os
import sys
from unittest import mock

import torch

from asynctp.float8 import Float8Recipe
from asynctp.float8 import quantize as q

E4M3 = torch.float8_e4m3fn
# the same calls with the kernels off: the torch formulas they replace
torch_formulas = mock.patch.dict(os.environ, {"ASYNCTP_FP8_KERNELS": "0"})


def time_us(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    dev = "cuda"
    # (name, shape): TP=2 shards of the 8B block at seq 8192
    shapes = [("x col-parallel shard", (4096, 4096)), ("x row-parallel w2", (8192, 7168)),
              ("grad w13 out", (8192, 14336)), ("w13 weight", (14336, 4096)), ("w2 weight", (4096, 7168))]
    rows = []
    for scaling in ("rowwise", "tensorwise"):
        recipe = Float8Recipe.from_name(scaling)
        for name, shape in shapes:
            x = torch.randn(shape, device=dev, dtype=torch.bfloat16)

            def kernels():
                return q.quantize_rows(x, E4M3, recipe) if scaling == "rowwise" else q.quantize_tensor(x, q.abs_max(x), E4M3, recipe)

            @torch_formulas
            def torch_ops():
                if scaling == "rowwise":
                    return q.quantize_rows(x, E4M3, recipe)
                return q.quantize_tensor(x, x.abs().amax().float(), E4M3, recipe)

            a, b = kernels(), torch_ops()
            same = torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
            row = {"recipe": scaling, "tensor": name, "shape": list(shape), "kernel_us": round(time_us(kernels), 1),
                   "torch_us": round(time_us(torch_ops), 1), "same_bytes": same}
            if "weight" in name:
                w_k = lambda: q.quantize_weight_for_dgrad(x, recipe)  # noqa: E731
                w_t = torch_formulas(w_k)
                row["dgrad_kernel_us"], row["dgrad_torch_us"] = round(time_us(w_k), 1), round(time_us(w_t), 1)
                row["dgrad_same_bytes"] = torch.equal(w_k()[0].view(torch.uint8), w_t()[0].view(torch.uint8))
            rows.append(row)
            print(row, flush=True)
    with open(os.path.join(out_dir, "probe_quantize.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
