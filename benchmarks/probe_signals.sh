#!/usr/bin/env bash
# Developer probe: stream-memory-op signals (default) vs torch's signal kernels
# (ASYNCTP_SIGNALS=torch) on one machine, alternating, then the demo both ways. Results packed
# into $OUT/ab.tgz.
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 ASYNCTP_TIMEOUT=120
W=/tmp/ab; mkdir -p $W
export PROBE_CASES=${PROBE_CASES:-"all_gather_matmul:4096,all_gather_matmul:8192,matmul_reduce_scatter:4096,scaled_matmul_reduce_scatter_rowwise:4096,all_gather_scaled_matmul_rowwise:4096"}
export PROBE_STRATEGIES=pipeline PROBE_NO_PRIMS=1
for round in 1 2; do for sig in streamops torch; do
  echo "== probe $sig round $round"
  ASYNCTP_SIGNALS=$sig timeout 150 python3 benchmarks/probe_host.py $W/probe_${sig}_$round 2>&1 | grep '^{'
done; done
for sig in streamops torch; do
  echo "== demo $sig"
  ASYNCTP_SIGNALS=$sig timeout 200 python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-30} --profile --out $W/demo_$sig > $W/demo_$sig.log 2>&1
  grep -A9 "vanilla TP       asynctp" $W/demo_$sig.log
done
echo "== stuck (streamops)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_reliability.py -k "stuck and streamops" > $W/stuck.log 2>&1; tail -3 $W/stuck.log
tar czf $OUT/ab.tgz -C $W .
