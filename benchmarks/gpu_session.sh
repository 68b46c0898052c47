#!/usr/bin/env bash
# One device call: GPU tests of every tier and the benchmarks, everything under $OUT, packed
# into one archive (the device tool returns at most 8 files). Steps in priority order, each
# with its own time limit.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
W=/tmp/asynctp-session; mkdir -p $W/results  # packed into $OUT/session.tgz at the end: one file back
export ASYNCTP_TUNING_CACHE=$W/tuning.json ASYNCTP_TIMEOUT=120
R=$W/results
step() { local limit=$1 name=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$W/$name.log" 2>&1; echo "   rc=$? ($name)"; grep -v -i "warn\|return func" "$W/$name.log" | tail -${TAILN:-6}; }
for s in ${STEPS:-rs demo tests8 fp8 compile}; do
  case $s in
    ops) step ${OPS_LIMIT:-240} gpu_ops python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ops.py tests/gpu/test_reliability.py ;;
    ag) step 150 bench_ag python3 -m asynctp.cli bench --op all_gather_matmul --shapes ${BF16_SHAPES:-all} --tune --out $R ;;
    rs) step 150 bench_rs python3 -m asynctp.cli bench --op matmul_reduce_scatter --shapes ${BF16_SHAPES:-all} --tune --out $R ;;
    demo) step ${DEMO_LIMIT:-200} demo python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-40} --profile ${DEMO_ARGS:-} --out $R ;;
    demofp8) step ${DEMO_LIMIT:-200} demo_fp8 python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-40} --float8 rowwise --out $R/fp8demo ;;
    stuck) step 120 gpu_stuck python3 -m pytest -q -p no:cacheprovider tests/gpu/test_reliability.py -k stuck ;;
    democompile) for spec in ${COMPILE_SPECS:-1:1:--asynctp-pass,--torch-async-tp,--profile}; do IFS=: read -r bs graphs extra <<< "$spec"; ASYNCTP_GRAPHS=$graphs step ${DEMO_LIMIT:-400} demo_compiled_b${bs}_graphs$graphs python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-40} --batch-size $bs --compile ${extra//,/ } --out $R/compiled_b${bs}_graphs$graphs; done ;;
    contention) step 150 contention python3 -m asynctp.cli bench --contention --out $R ;;
    ringp2p) for op in all_gather_matmul matmul_reduce_scatter; do NCCL_P2P_DISABLE=1 ASYNCTP_DISABLE_SYMM=1 step 120 bench_nop2p_$op python3 -m asynctp.cli bench --op $op --shapes seed --hardware ${HW:-2xH200}-noP2P --out $R; done ;;
    tests8) step ${T8_LIMIT:-200} gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_float8.py tests/gpu/test_training.py ;;
    fp8) for op in ${FP8_OPS:-all_gather_scaled_matmul_rowwise all_gather_scaled_matmul_tensorwise scaled_matmul_reduce_scatter_rowwise scaled_matmul_reduce_scatter_tensorwise}; do step ${FP8_LIMIT:-60} bench_$op python3 -m asynctp.cli bench --op $op --shapes ${FP8_SHAPES:-seed} --tune --out $R; done ;;
    pyt) step ${PYT_LIMIT:-300} pytest_selected python3 -m pytest -q -p no:cacheprovider $PYTEST_ARGS ;;
    demosb) step ${DEMO_LIMIT:-300} demo_sb python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-30} --serial-baseline ${PROFILE---profile} --out $R/demo_sb ;;
    demofp8sb) step ${DEMO_LIMIT:-300} demo_fp8_sb python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-30} --float8 ${FP8_RECIPE:-rowwise} --serial-baseline ${PROFILE---profile} --out $R/fp8demo_sb_${FP8_RECIPE:-rowwise} ;;
    demoil) for spec in ${DEMOIL_SPECS:-bf16:1}; do IFS=: read -r rec bs <<< "$spec"; f8=""; [ "$rec" != bf16 ] && f8="--float8 $rec"; step ${DEMO_LIMIT:-300} demo_il_${rec}_b$bs python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-40} --batch-size $bs --serial-baseline --interleave $f8 ${DEMO_ARGS:-} --out $R/demo_il_${rec}_b$bs; done ;;
    demobm) ASYNCTP_BATCH_MAJOR=1 step ${DEMO_LIMIT:-300} demo_il_batch_major python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-30} --batch-size 2 --serial-baseline --interleave ${DEMO_ARGS:-} --out $R/demo_il_bf16_b2_batch_major ;;
    sdpa) TAILN=10 step 60 probe_sdpa python3 benchmarks/probe_sdpa_strides.py $R/sdpa ;;
    graphmem) for spec in ${GRAPHMEM_SPECS:-2:auto 2:1 2:0}; do IFS=: read -r bs pol <<< "$spec"; ASYNCTP_GRAPHS=$pol step ${DEMO_LIMIT:-200} demo_graphs_${pol}_b$bs python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-30} --batch-size $bs ${DEMO_ARGS:-} --out $R/graphs_${pol}_b$bs; done ;;
    demo200) step ${DEMO_LIMIT:-300} demo_200_control python3 -m asynctp.cli demo --model 8b-block --steps 200 --control --no-comm-baseline ${DEMO_ARGS:-} --out $R/demo200 ;;
    democmp) for bs in ${CMP_BATCHES:-2}; do  # eager asynctp vs compiled vanilla + torch's async TP, one machine
               step ${DEMO_LIMIT:-120} demo_eager_b$bs python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-30} --batch-size $bs --no-comm-baseline --out $R/eager_b$bs
               step ${COMPILE_LIMIT:-440} demo_compiled_b$bs python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-30} --batch-size $bs --compile --torch-async-tp --no-comm-baseline --out $R/compiled_b$bs; done ;;
    demotorch) for bs in ${CMP_BATCHES:-1 2}; do  # in one run: eager vanilla, eager asynctp, no-comm, compiled torch async TP
                 step ${DEMO_LIMIT:-260} demo_torch_b$bs python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-30} --batch-size $bs --torch-async-tp --no-comm-baseline ${DEMO_ARGS:-} --out $R/demo_torch_b$bs; done ;;
    demosync) for spec in ${SYNC_SPECS:-1:10 1:1}; do  # demotorch with the host waiting every N steps (bs:N)
                IFS=: read -r bs n <<< "$spec"
                step ${DEMO_LIMIT:-270} demo_torch_b${bs}_sync$n python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-43} --batch-size $bs --torch-async-tp --no-comm-baseline --sync-every $n ${DEMO_ARGS:-} --out $R/demo_torch_b${bs}_sync$n; done ;;
    demofp8sync) for rec in ${FP8_RECIPES:-rowwise tensorwise}; do  # fp8 asynctp vs vanilla TP (bf16), the host waiting every SYNC_N steps
                   step ${DEMO_LIMIT:-150} demo_fp8_${rec}_sync${SYNC_N:-10} python3 -m asynctp.cli demo --model 8b-block --steps ${DEMO_STEPS:-43} --batch-size ${FP8_BATCH:-1} --float8 $rec --sync-every ${SYNC_N:-10} --out $R/demo_fp8_${rec}_sync${SYNC_N:-10}; done ;;
    tpnum) TAILN=${TAILN:-30} step ${TPNUM_LIMIT:-300} probe_torch_async_tp_numerics python3 benchmarks/probe_torch_async_tp_numerics.py $R/tpnum ;;
    compile) step 200 gpu_compile python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_compile.py ;;
  esac
done
tar czf $OUT/session.tgz -C $W . ; ls -la $OUT
