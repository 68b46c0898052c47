#!/usr/bin/env bash
# Native stack samples of rank 0 during a demo run: where the host's time goes, below Python too
# (C++ dispatch, CUDA driver calls, the GIL). py-spy comes as a wheel in .whl/ (carry it).
#   bash benchmarks/native_profile.sh OUTDIR --model 8b-block --compile --steps 300 --float8 rowwise
# Every EVERY seconds, py-spy records rank 0 for WINDOW seconds (--native --idle, folded stacks):
# OUTDIR/window_<i>.txt, its start time in OUTDIR/windows.log; the demo's output in OUTDIR/demo.log.
# benchmarks/fold_stacks.py summarizes the windows.
set -u
out=$1; shift
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/asynctp-pyspy .whl/py_spy-*.whl || exit 1
spy=/tmp/asynctp-pyspy/bin/py-spy
python3 -m asynctp.cli demo "$@" --out "$out" > "$out/demo.log" 2>&1 &
demo=$!
i=0
while kill -0 $demo 2>/dev/null; do
  sleep "${EVERY:-6}"
  rank0=$(pgrep -P $demo -f spawn_main | sort -n | head -1)
  [ -n "$rank0" ] || continue
  echo "$i $(date +%s.%N) pid $rank0" >> "$out/windows.log"
  timeout $(( ${WINDOW:-8} + 20 )) "$spy" record --pid "$rank0" --native --idle --rate "${RATE:-100}" \
    --duration "${WINDOW:-8}" --format raw --output "$out/window_$i.txt" > "$out/spy_$i.log" 2>&1
  i=$((i + 1))
done
wait $demo; echo "demo rc=$?" >> "$out/windows.log"
