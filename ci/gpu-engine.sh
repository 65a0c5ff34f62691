#!/usr/bin/env bash
# The communication engine on the GPU machine, in one call: device memory moved by real CUDA
# copies (staged through the bounce buffers, and GPU-direct through the CUDA-aware UCX), checked
# byte for byte by engine_check; then engine-bench on device memory, both routes, against raw MPI
# on device pointers in the same run, and the STF runtime's own transfer figures on the same
# machine. Two ranks: on two GPUs where there are two, else both on GPU 0 under MPS (the proxy).
#
# Needs .device/bin/{engine_check,engine-bench,transfer}, and runs .device/bin/engine_c where it is
# there (tests/c/engine.c built with -Wl,-rpath,'$ORIGIN' beside libferry.so); run as
#   source .device/env.sh && bash ci/gpu-engine.sh [OUT]
# Records (engine-bench --json) are written to OUT (default $OUT, else /tmp). Settings: RUNS
# (route:progress pairs of engine-bench), BENCH (another engine-bench binary in .device/bin, for an
# A/B in the same call), CHECKS=0 and STF=0 skip the correctness checks and the STF figures.
set -u
# gpurun is a shell function of env.sh: define it here.
source .device/env.sh
B=.device/bin
# gpurun with a time limit (a shell function cannot run under `timeout` itself): a hung check
# is reported and the call goes on.
limited() {
  local t=$1
  shift
  timeout "$t" bash -c 'source .device/env.sh && gpurun "$@"' gpurun "$@"
}
out=${1:-${OUT:-/tmp}}
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi -L
if [ "$ngpu" -lt 2 ]; then
  export CUDA_VISIBLE_DEVICES=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p /tmp/mps-pipe /tmp/mps-log
  nvidia-cuda-mps-control -d && sleep 1
  machine="1× $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), 2 ranks under MPS"
else
  machine="$ngpu× $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
fi
if [ "${CHECKS:-1}" = 1 ]; then
echo "== engine_check device, CUDA (1 MiB chunks, 4 bounce buffers per direction)"
for gd in off force; do
  for ipc in "" --ipc "--ipc --no-leases"; do
    for mode in "" --driven; do
      printf 'gpu-direct %-5s %-16s %-8s ' "$gd" "${ipc:-noipc}" "${mode:-thread}"
      limited 60 -np 2 "$B/engine_check" device --cuda --gpu-direct "$gd" $ipc --chunk 1048576 --slots 4 $mode 2>&1 \
        | grep -E "engine_check|rror|panick" | sort | uniq -c | tr '\n' ' '
      echo
    done
  done
done
echo "== engine_check stream, CUDA (a copy on the caller's stream right after the get reads the landed bytes)"
for route in "--ipc" "--ipc --no-leases" "--gpu-direct force" ""; do
  for mode in "" --driven; do
    printf '%-20s %-8s ' "${route:-staged}" "${mode:-thread}"
    limited 60 -np 2 "$B/engine_check" stream --cuda $route --chunk 1048576 --slots 4 $mode 2>&1 \
      | grep -E "engine_check|rror|panick" | sort | uniq -c | tr '\n' ' '
    [ "${PIPESTATUS[0]}" = 124 ] && printf 'TIMED OUT '
    echo
  done
done
echo "== engine_check placed, CUDA (a budget of 2.5 parts: the third lands in host memory; then none; then no arena)"
for b in "--budget 256000" "" "--arena 0"; do
  printf '%-18s ' "${b:-no budget}"
  gpurun -np 2 "$B/engine_check" placed --cuda $b 2>&1 | grep -E "engine_check|rror|panick" | sort | uniq -c | tr '\n' ' '
  echo
done
echo "== engine_check placer, CUDA (the framework's pool: eviction, groups all or none, releases)"
for ipc in "" --ipc; do
  printf '%-18s ' "${ipc:-noipc}"
  limited 60 -np 2 "$B/engine_check" placer --cuda $ipc 2>&1 | grep -E "engine_check|rror|panick" | sort | uniq -c | tr '\n' ' '
  echo
done
echo "== engine_check peer-map and am-order, CUDA (a peer's device registration mapped here; active messages through the node's rings and over MPI)"
for c in "peer-map --cuda --ipc" "am-order --cuda" "am-order --cuda --no-rings"; do
  printf '%-28s ' "$c"
  limited 60 -np 2 "$B/engine_check" $c 2>&1 | grep -E "engine_check|rror|panick" | sort | uniq -c | tr '
' ' '
  echo
done
if [ -x "$B/engine_c" ]; then
  echo "== the C ABI on a GPU (tests/c/engine.c --cuda: placed gets, a group, a placer over ferry_engine_alloc_device memory)"
  for mode in "" --driven; do
    printf '%-8s ' "${mode:-thread}"
    limited 60 -np 2 "$B/engine_c" --cuda $mode 2>&1 | grep -E "engine_c|rror|panick" | sort | uniq -c | tr '\n' ' '
    echo
  done
fi
fi
echo "== engine-bench ${BENCH:-engine-bench}, device memory (ipc: leases; ipc-grant: a grant per copy)"
for run in ${RUNS:-ipc:thread ipc:caller ipc-grant:thread gpu-direct:thread staged:thread}; do
  route=${run%%:*} progress=${run##*:}
  echo "-- $route, progress $progress"
  gpurun -np 2 "$B/${BENCH:-engine-bench}" --memory device --route "$route" --progress "$progress" --min-size 1048576 \
    --max-size 268435456 --windows 1,8 --reps 3 --volume-mib 2048 --machine "$machine" --commit "${COMMIT:-0000000}" \
    --json "$out/${BENCH:-engine-bench}-device-$route-$progress.json" 2>&1 | grep -E "ranks|bandwidth|latency, 1 MiB|rror|panick"
done
if [ "${STF:-1}" = 1 ]; then
echo "== STF transfer, same machine"
FERRY_GPU_DIRECT=force gpurun -np 2 "$B/transfer" --devices cuda --paths ipc,gpu-direct,staged --sizes 1M,4M,64M \
  --inflight 8 --volume 4G --tasks per-round 2>&1 | grep -E "^(path|ipc|gpu-direct|staged) |rror|panick"
fi
if [ "$ngpu" -lt 2 ]; then echo quit | nvidia-cuda-mps-control; fi
