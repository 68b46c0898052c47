export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
W=/tmp/p; mkdir -p $W
export PROBE_CASES="all_gather_scaled_matmul_rowwise:4096,matmul_reduce_scatter:4096,all_gather_matmul:4096" PROBE_STRATEGIES=pipeline PROBE_NO_PRIMS=1 PROBE_TRACE_DIR=$W
for cfg in "streamops d" "streamops 32" "torch d"; do set -- $cfg
  echo "== $cfg"
  if [ $2 = d ]; then ASYNCTP_SIGNALS=$1 timeout 120 python3 benchmarks/probe_host.py $W 2>&1 | grep -v -i warn | tail -4
  else CUDA_DEVICE_MAX_CONNECTIONS=$2 ASYNCTP_SIGNALS=$1 timeout 120 python3 benchmarks/probe_host.py $W 2>&1 | grep -v -i warn | tail -4; fi
done
tar czf $OUT/p.tgz -C $W .
