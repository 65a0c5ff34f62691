#!/usr/bin/env bash
# Active messages through the node's byte rings on the GPU machine, and the engine paths that
# changed with them, in one call: am-order on host ranks (2 and 4), pin-fail, threads;
# engine-bench active-message and message round trips against an MPI ping-pong, default against
# --am-ring-max 1080 (slots and MPI), three rounds interleaved (records in $OUT/am-*.json, for
# the results page); then under MPS (two ranks on GPU 0) engine_check device (staged bounce
# buffers, which are pinned before a request goes out), stream, placed, am-order on CUDA ranks,
# engine_c --cuda (the C poller among its checks); and the PTG Cholesky at N 2048 against the
# STF cholesky (log det 15615.686357).
#
# Needs .device/bin/{engine_check,engine-bench,engine_c,libferry.so,cholesky,ptg_cholesky}; run as
#   source .device/env.sh && COMMIT=$(git rev-parse --short HEAD) bash ci/gpu-am-rings.sh
set -u
source .device/env.sh
B=.device/bin
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
limited() { local t=$1; shift; timeout "$t" bash -c 'source .device/env.sh && gpurun "$@"' gpurun "$@"; }
summ() { grep -E "engine_check|engine_c|rror|panick" | sort | uniq -c | tr '\n' ' '; }
nvidia-smi -L; nproc
machine="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/NVIDIA //; s/ .*//') host ($(nproc) cores)"
echo "machine: $machine"
echo "== host ranks: am-order (byte rings; 1080 = slots + MPI), pin-fail, threads, bad-input"
for np in 2 4; do for x in "" "--am-ring-max 1080"; do
  printf 'am-order np %d %-20s ' "$np" "${x:-default}"; limited 60 -np "$np" "$B/engine_check" am-order $x 2>&1 | summ; echo
done; done
for c in "pin-fail" "pin-fail --driven" "threads" "bad-input"; do
  printf '%-20s ' "$c"; limited 60 -np 2 "$B/engine_check" $c 2>&1 | summ; echo
done
echo "== engine-bench active messages: default vs --am-ring-max 1080, 3 rounds interleaved"
for r in 1 2 3; do for v in default 1080; do
  x=""; [ "$v" = 1080 ] && x="--am-ring-max 1080"
  echo "-- $v round $r"
  limited 90 -np 2 "$B/engine-bench" --progress caller --min-size 8 --max-size 65536 --windows 1 --reps 5 --volume-mib 8 $x \
    --machine "$machine" --commit "${COMMIT:-0000000}" --json "$OUT/am-$v-$r.json" 2>&1 | grep -E "round trip|rror|panick"
done; done
echo "== CUDA ranks under MPS"
export CUDA_VISIBLE_DEVICES=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p /tmp/mps-pipe /tmp/mps-log
nvidia-cuda-mps-control -d && sleep 1
for c in "device --cuda --chunk 1048576 --slots 4" "device --cuda --chunk 65536 --slots 1 --driven" \
         "device --cuda --ipc" "device --cuda --gpu-direct force" "stream --cuda --ipc" "stream --cuda" \
         "placed --cuda --budget 256000" "placer --cuda --ipc" "peer-map --cuda --ipc" "am-order --cuda" \
         "am-order --cuda --am-ring-max 1080"; do
  printf '%-52s ' "$c"; limited 60 -np 2 "$B/engine_check" $c 2>&1 | summ; echo
done
for mode in "" --driven; do
  printf 'engine_c --cuda %-8s ' "${mode:-thread}"; limited 60 -np 2 "$B/engine_c" --cuda $mode 2>&1 | summ; echo
done
echo quit | nvidia-cuda-mps-control; sleep 1
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
echo "== PTG Cholesky N 2048 on CUDA (expect log det 15615.686357; STF the same)"
keep() { grep -E "^(ptg_cholesky|residual|log det|time)|rror|panick|cannot"; }
limited 120 -np 1 "$B/cholesky" --devices cuda --n 2048 --nb 256 --check none 2>&1 | keep
limited 120 -np 1 "$B/ptg_cholesky" --devices cuda --n 2048 --nb 256 --reps 2 2>&1 | keep
echo "== done"
