#!/usr/bin/env bash
# A/B of a change against the tree, on one machine, in one call: each step runs on the tree (A)
# and then on a copy of it with the change applied (B), so machine drift touches both alike.
# Logs and result files in $OUT/ab.tgz (one file: the device returns a limited number of files),
# the logs' tails on stdout.
#   git diff main my-branch > change.patch
#   PATCH=change.patch STEPS="fp8demo titan" bash benchmarks/ab_run.sh
#   PATCH="one.patch two.patch" ...     # sides A, B (one.patch), C (two.patch), in turn per step
# Steps: test (B's GPU tests matching TESTS, a pytest -k expression), demo / fp8demo (the compiled
# 8B-shaped block, bf16 / fp8 rowwise, at DEMO_ARGS, default batch 1; vanilla TP in the same run),
# titan (torchtitan, VARIANTS default "asynctp asynctp_fp8", eager; TITAN_GRAPHS=1: under torchtitan's
# CUDA graphs; carry .torchtitan_kit), gputrace (both ranks' GPU activities per call of the fused op and
# its local matmul's cuBLAS kernel, benchmarks/host_profile.py --gpu-trace, for each OP:M of GPUTRACE,
# default all_gather_scaled_matmul_rowwise:4096), train
# (train_bench.py at TRAIN_ARGS). Compiles are cached in .inductor_cache across steps and calls of a warm machine: a
# cold compiled demo takes about 225 s on 2xH100, a cached one about 70-140 s.
set -u
PATCH=${PATCH:?usage: PATCH=change.patch STEPS="..." bash benchmarks/ab_run.sh}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor_cache
A=$PWD W=/tmp/asynctp-ab/logs
# a machine may come with an earlier run's logs and trees there: logs start empty, and a side's
# tree is named by the hash of the sources (package, benchmarks, tests) and its patch (reused by
# the calls of one warm machine on the same change, never taken from another change)
rm -rf $W; mkdir -p $W
SRC=$(find asynctp benchmarks tests \( -name '*.py' -o -name '*.sh' \) -print0 | sort -z | xargs -0 cat | md5sum | cut -c1-12)
SIDES=A; side=A
for p in $PATCH; do
  key=$( (echo $SRC; cat "$A/$p") | md5sum | cut -c1-12)
  side=$(echo $side | tr A-Y B-Z); SIDES="$SIDES $side"; printf -v $side %s /tmp/asynctp-ab/tree_${side}_$key
  d=${!side}
  if [ ! -d $d ]; then
    mkdir -p $d && cp -r "$A/." $d && (cd $d && git apply "$A/$p") || { echo "$p does not apply"; rm -rf $d; exit 1; }
  fi
done
# run NAME LIMIT DIR CMD...: CMD in DIR with DIR's package on the path and its own caches of tuned
# strategies and tiles (XDG_CACHE_HOME: a side's code never reads another's picks, which older code
# may not run), named as its tree (A: by the sources' hash), so the calls of one warm machine reuse them
run() { local name=$1 limit=$2 dir=$3; shift 3; echo "== $name"; local t0=$SECONDS
  local cache=/tmp/asynctp-ab/cache_A_$SRC; case $dir in /tmp/asynctp-ab/tree_*) cache=${dir/tree_/cache_} ;; esac
  (cd $dir && PYTHONPATH=$dir XDG_CACHE_HOME=$cache timeout -s ABRT -k 15 $limit "$@") > $W/$name.log 2>&1
  echo "   rc=$? $((SECONDS - t0)) s"; grep -v -i "warn\|return func" $W/$name.log | tail -${TAILN:-10}
  tar czf $OUT/ab.tgz --exclude="*trace_*.json.gz" -C $W . ; }
DEMO="python3 -m asynctp.cli demo --model 8b-block --compile ${DEMO_ARGS:---batch-size 1 --steps 30 --sync-every 10}"
for s in ${STEPS:-fp8demo}; do
  for side in $SIDES; do
    dir=${!side}
    case $s in
      test) [ $side != A ] && run test_$side 300 $dir python3 -m pytest -q -rf -p no:cacheprovider --timeout=150 tests/gpu -k "${TESTS:?TESTS: a pytest -k expression}" ;;
      demo) run demo_$side 330 $dir $DEMO --out $W/demo_$side ;;
      fp8demo) run fp8demo_$side 330 $dir $DEMO --float8 rowwise --out $W/fp8demo_$side ;;
      titan) [ -d $dir/.torchtitan_kit ] || cp -r $A/.torchtitan_kit $dir/
             run titan_$side 300 $dir env VARIANTS="${VARIANTS:-asynctp asynctp_fp8}" GRAPHS=${TITAN_GRAPHS:-0} LIMIT=140 STEPS=20 WARMUP=8 \
               bash benchmarks/torchtitan_bench.sh $W/titan_$side ;;
      gputrace) for e in ${GPUTRACE:-all_gather_scaled_matmul_rowwise:4096}; do
                  IFS=: read -r o m <<< "$e"
                  TAILN=30 run gputrace_${o}_${m}_$side 150 $dir python3 benchmarks/host_profile.py $W/gputrace_$side \
                    --op $o --strategy fused --graphs auto --m $m --calls 20 --gpu-trace; done ;;
      train) run train_$side 540 $dir python3 benchmarks/train_bench.py --out $W/train_$side ${TRAIN_ARGS:---batch-sizes 1 --configs compiled} ;;
    esac
  done
done
