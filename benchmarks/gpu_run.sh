#!/usr/bin/env bash
# The GPU run: tests, then benchmarks; logs and result files in $OUT/run.tgz (plus the logs' tails on
# stdout). STEPS picks and orders the steps; each step has its own time limit.
#   STEPS="kernels ops bench" bash benchmarks/gpu_run.sh
# Tests run with a per-test limit (pytest-timeout), so one stuck test cannot hide the others'
# results behind the step's limit.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
W=/tmp/asynctp-run; R=$W/results
# a machine may come with an earlier run's files there: only this run's logs and results go back;
# the tuning cache stays for the calls of one warm machine on the same code (named by its hash)
TUNING=tuning-$(find asynctp -name '*.py' -print0 | sort -z | xargs -0 cat | md5sum | cut -c1-12).json
mkdir -p $W && find $W -mindepth 1 -maxdepth 1 ! -name $TUNING -exec rm -rf {} +; mkdir -p $R
# results are named by the cards that produced them (2xH100, 2xH200, ...) unless HW says otherwise
HW=${HW:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^[A-Z][0-9]+/) {g = $i}} END {print NR "x" g}')}
export ASYNCTP_TUNING_CACHE=$W/$TUNING ASYNCTP_TIMEOUT=${ASYNCTP_TIMEOUT:-120}
PYT="python3 -m pytest -q -rf -p no:cacheprovider --timeout=${TEST_LIMIT:-150}"
# the archive is rewritten as each step ends: a run cut off by its limit still returns what
# finished (one file: the device returns a limited number of files)
# the run's exit status: 1 where any step failed (or ran past its limit), so that a caller sees it
failed=0
step() { local limit=$1 name=$2 rc; shift 2; echo "== $name"; timeout -s ABRT -k 15 "$limit" "$@" > "$W/$name.log" 2>&1; rc=$?; echo "   rc=$rc ($name)"; [ $rc -eq 0 ] || failed=1; grep -v -i "warn\|return func" "$W/$name.log" | tail -${TAILN:-8}; tar czf $OUT/run.tgz --exclude="*trace_*.json.gz" -C $W . ; }
for s in ${STEPS:-kernels ops bench}; do
  case $s in
    kernels) step 260 test_kernels $PYT tests/gpu/test_kernels.py tests/gpu/test_producer.py ;;
    kbench) step 400 kernel_bench python3 benchmarks/kernels.py $R/kernels_${HW:-gpu}.json ${KBENCH_ARGS:-} ;;
    ops) step ${OPS_LIMIT:-300} test_ops $PYT tests/gpu/test_ops.py tests/gpu/test_reliability.py ${OPS_ARGS:-} ;;
    fused) step 200 test_fused $PYT tests/gpu/test_fused.py ;;
    # one pytest per file, each with its own limit: a run cut off loses one file's results, not all (2xH100
    # took over 430 s for the whole of tests/gpu); GPU_FILES picks files to split the suite across calls
    gpu) for f in ${GPU_FILES:-tests/gpu/test_*.py}; do step ${GPU_FILE_LIMIT:-240} gpu_$(basename "$f" .py) $PYT "$f"; done ;;
    checks) step 120 bench_checks python3 -m asynctp.cli bench --checks --out $R ;;
    hostprof) for s2 in ${HOSTPROF:-all_gather_matmul:fused:0 all_gather_matmul:fused:1 matmul_reduce_scatter:fused:0}; do
             IFS=: read -r o st g <<< "$s2"
             step 150 hostprof_${o}_${st}_$g python3 benchmarks/host_profile.py $R --op $o --strategy $st --graphs $g; done ;;
    stages) for s2 in ${STAGES_LIST:-all_gather_matmul:fused:0 all_gather_matmul:fused:auto matmul_reduce_scatter:fused:0 matmul_reduce_scatter:fused:auto}; do
             IFS=: read -r o st g <<< "$s2"
             step 150 stages_${o}_${st}_$g python3 benchmarks/host_profile.py $R --op $o --strategy $st --graphs $g --stages --calls 50; done ;;
    # both ranks' GPU activities per call on one clock (OP:STRATEGY:GRAPHS:M[:caller], caller: the call captured
    # in a graph of the caller's; GPUTRACE_ARGS for every entry, e.g. "--n 28672 --k 8192 --main gemm")
    gputrace) for s2 in ${GPUTRACE:-matmul_reduce_scatter:fused:auto:8192 all_gather_matmul:fused:auto:8192}; do
             IFS=: read -r o st g m c <<< "$s2"
             TAILN=60 step 150 gputrace_${o}_${st}_${g}_$m${c:+_$c} python3 benchmarks/host_profile.py $R --op $o --strategy $st \
               --graphs $g --m $m --calls 20 --gpu-trace ${c:+--caller-graph} ${GPUTRACE_ARGS:-}; done ;;
    # each demo run's kernels split into the wait for the later rank and the rest (after `demo --profile --trace`)
    skew) for t0 in $R/trace_*_rank0.json.gz; do
            TAILN=30 step 120 skew_$(basename "$t0" _rank0.json.gz) python3 benchmarks/trace_kernels.py --skew "$t0" \
              "${t0%_rank0.json.gz}_rank1.json.gz" --steps ${SKEW_STEPS:-5}; done ;;
    # each demo run's GPU idle gaps, by the activity that ended them (after `demo --profile-gpu --trace`: 10 steps)
    gaps) for t0 in $R/trace_*_rank0.json.gz; do
            TAILN=30 step 120 gaps_$(basename "$t0" _rank0.json.gz) python3 benchmarks/trace_kernels.py --gaps "$t0" \
              "${t0%_rank0.json.gz}_rank1.json.gz" --steps ${GAPS_STEPS:-10}; done ;;
    hostdemo) step ${DEMO_LIMIT:-300} hostdemo python3 -m asynctp.cli demo --model 8b-block --host-profile --out $R/hostdemo ${HOSTDEMO_ARGS:-} ;;
    contention) step 150 contention python3 -m asynctp.cli bench --contention --out $R ;;
    demo) step ${DEMO_LIMIT:-300} demo python3 -m asynctp.cli demo --model 8b-block --out $R ${DEMO_ARGS:-} ;;
    train) step ${TRAIN_LIMIT:-540} train_bench python3 benchmarks/train_bench.py --out $R/train_bench ${TRAIN_ARGS:-} ;;
    titan) step ${TITAN_LIMIT:-590} torchtitan env STEPS=${TITAN_STEPS:-20} WARMUP=${TITAN_WARMUP:-8} LIMIT=${TITAN_RUN_LIMIT:-135} \
             bash benchmarks/torchtitan_bench.sh $R/torchtitan ;;  # carry .torchtitan_kit
    # SHAPES may name several sets ("seed llama8b"): one step per op and set, all in one archive
    bench) for set in ${SHAPES:-seed}; do for op in ${OPS:-all_gather_matmul matmul_reduce_scatter}; do
             step ${BENCH_LIMIT:-200} bench_${op}_$set python3 -m asynctp.cli bench --op $op --shapes $set --tune \
               --hardware ${HW:-2xGPU} --out $R; done; done ;;
  esac
done
ls -la $OUT
exit $failed
