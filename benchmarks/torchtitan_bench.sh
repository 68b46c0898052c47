#!/usr/bin/env bash
# Times torchtitan 0.3.0 training on 2 GPUs: Llama-3-8B's shape cut to 4 layers, seq 8192, batch 1,
# TP=2, bf16, synthetic tokens (examples/torchtitan/bench_configs.py), through
# examples/torchtitan/train.py, one torchrun per variant:
#   default     torchtitan's default TP linears
#   dist_gemm   torchtitan's dist_gemm TP linears (torch.ops.symm_mem fused ops)
#   asynctp     the dist_gemm linears on asynctp
#   asynctp_fp8 the same with asynctp's fp8 rowwise matmuls (--asynctp.float8 rowwise)
# Offline: installs .torchtitan_kit/'s wheels (benchmarks/torchtitan_kit.sh) into a folder on
# PYTHONPATH, without dependencies. Writes each run's log, summary.json and summary.md (median step
# time and tokens/s per GPU over the steps after WARMUP, peak reserved GPU memory) into OUT_DIR.
# Run from the repo root, with .torchtitan_kit carried:
#   bash benchmarks/torchtitan_bench.sh OUT_DIR
# Settings (environment): VARIANTS (which, in order), GRAPHS ("0": eager, "1": torchtitan's CUDA
# graphs of forward + backward; default "0 1": both), STEPS (30), WARMUP (10), LIMIT (seconds a run,
# 280; a run takes about 25 s on 2xH200, the first on a machine longer: it compiles flex attention).
# The asynctp runs end with a line of asynctp's call and graph-cache counts and the memory reserved
# by pool at exit (rank 0), kept in the summary.
set -u
OUT_DIR=${1:?usage: bash benchmarks/torchtitan_bench.sh OUT_DIR}
mkdir -p "$OUT_DIR"
SITE=/tmp/torchtitan_kit_site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --upgrade .torchtitan_kit/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-30}
declare -A ARGS=([default]="--config llama3_8b_4layers --asynctp.off"
                 [dist_gemm]="--config llama3_8b_4layers_dist_gemm --asynctp.off"
                 [asynctp]="--config llama3_8b_4layers_dist_gemm"
                 [asynctp_fp8]="--config llama3_8b_4layers_dist_gemm --asynctp.float8 rowwise")
for graphs in ${GRAPHS:-0 1}; do
  for v in ${VARIANTS:-default dist_gemm asynctp asynctp_fp8}; do
    name=${v}_$([ "$graphs" = 1 ] && echo graphs || echo eager)
    echo "== $name"
    timeout -s TERM -k 20 "${LIMIT:-280}" torchrun --nproc-per-node 2 --local-ranks-filter 0 \
      examples/torchtitan/train.py --module bench_configs ${ARGS[$v]} --parallelism.tensor_parallel_degree 2 \
      --training.steps "$STEPS" --metrics.disable_color_printing --dump_folder "/tmp/torchtitan_bench/$name" \
      $([ "$graphs" = 1 ] || echo --training.disable_cuda_graphs) > "$OUT_DIR/$name.log" 2>&1
    echo "   rc=$?"; grep -E "step: *[0-9]+ |Error|error:" "$OUT_DIR/$name.log" | tail -3
  done
done
python3 - "$OUT_DIR" "${WARMUP:-10}" <<'EOF'
import json, pathlib, re, statistics, sys
out, warmup = pathlib.Path(sys.argv[1]), int(sys.argv[2])
tokens_per_step, tp = 8192 * 1, 2  # seq_len x local batch; torchtitan's tps is per GPU: tokens / (time x TP)
line = re.compile(r"step: *(\d+) +loss: *(\S+) .*memory: *(-?[\d.]+)GiB.*tps: *([\d,]+)")
rows = []
for log in sorted(out.glob("*.log")):
    text = log.read_text()
    steps = [(int(s), float(loss), float(mem), float(tps.replace(",", ""))) for s, loss, mem, tps in line.findall(text)]
    timed = [s for s in steps if s[0] > warmup] or steps
    tps = statistics.median(s[3] for s in timed) if timed else None
    report = re.findall(r"^asynctp \(rank 0\): (.*)$", text, re.M)
    rows.append({"run": log.stem, "steps": len(steps), "timed_steps": len(timed), "tps_per_gpu": tps,
                 "step_ms": 1000 * tokens_per_step / (tps * tp) if tps else None,
                 "peak_reserved_gib": max((s[2] for s in steps), default=None),
                 "last_loss": steps[-1][1] if steps else None, "asynctp": report[-1] if report else None})
(out / "summary.json").write_text(json.dumps(rows, indent=1))
md = ["| run | steps | ms/step | tokens/s per GPU | peak reserved GiB | last loss |", "|---|---|---|---|---|---|"]
fmt = lambda x, f: "-" if x is None else format(x, f)
md += [f"| {r['run']} | {r['steps']} | {fmt(r['step_ms'], '.1f')} | {fmt(r['tps_per_gpu'], ',.0f')} | "
       f"{fmt(r['peak_reserved_gib'], '.2f')} | {fmt(r['last_loss'], '.3f')} |" for r in rows]
(out / "summary.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
EOF
