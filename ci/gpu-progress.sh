#!/usr/bin/env bash
# Shared MPI progress (FERRY_MPI_PROGRESS) on the GPU machine, in one call: the progress thread
# against shared progress, interleaved, on 2 ranks (two GPUs where there are two, else both on
# GPU 0 under MPS): the stencil's checksum and time, the Cholesky's log det and residual, IPC
# transfer rates; then a real rank per core (auto: yielding and shared progress), and the
# engine's CUDA checks.
#
# Needs .device/bin/{stencil,cholesky,transfer,ferry-info,engine_check}; run as
#   source .device/env.sh && bash ci/gpu-progress.sh [REPS]
set -u
source .device/env.sh
source ci/gpu-lib.sh
B=.device/bin
reps=${1:-2}
export FERRY_LOG=${FERRY_LOG:-warn}
nvidia-smi -L
mps_if_one_gpu
S="$B/stencil --devices cuda --n 4096 --nb 1024 --iters 300 --warmup 5 -q"
C="$B/cholesky --devices cuda --n 16384 --nb 1024"
for rep in $(seq "$reps"); do
  for m in thread shared; do
    export FERRY_MPI_PROGRESS=$m
    printf 'rep %s %-6s stencil:  ' "$rep" "$m"
    lim 120 -np 2 $S 2>&1 | grep -E '^(seconds|checksum)|rror|panick' | awk '{printf "%s %s  ", $1, $2}'
    echo
    printf 'rep %s %-6s cholesky: ' "$rep" "$m"
    lim 180 -np 2 $C 2>&1 | grep -E '^(GFLOP/s|residual |log det)|rror|panick' | awk '/^log det/ {printf "log det %s  ", $3; next} {printf "%s %s  ", $1, $2}'
    echo
    lim 120 -np 2 $B/transfer --devices cuda --paths ipc --sizes 1M,4M --inflight 8 --volume 1G 2>&1 \
      | grep -E '^ipc +[0-9]+[KM]|panick' | awk -v r="rep $rep $m" '{print r, "ipc", $2, "x", $3, $5, "GB/s"}'
  done
done
unset FERRY_MPI_PROGRESS
echo "== a rank per core (auto: idle threads yield, idle workers drive MPI progress)"
lim 60 -np 2 --cpu-set 0,1 --bind-to core $B/ferry-info 2>&1 | grep -E 'idle threads|MPI progress' | sort | uniq -c
printf 'stencil:  '
lim 120 -np 2 --cpu-set 0,1 --bind-to core $S 2>&1 | grep -E '^(seconds|checksum)|rror|panick' | awk '{printf "%s %s  ", $1, $2}'
echo
printf 'cholesky: '
lim 180 -np 2 --cpu-set 0,1 --bind-to core $C 2>&1 | grep -E '^(GFLOP/s|residual |log det)|rror|panick' | awk '/^log det/ {printf "log det %s  ", $3; next} {printf "%s %s  ", $1, $2}'
echo
echo "== engine_check device and stream, CUDA, IPC"
for mode in "" --driven; do
  for check in device stream; do
    printf '%-7s %-8s ' "$check" "${mode:-thread}"
    lim 60 -np 2 $B/engine_check $check --cuda --ipc --chunk 1048576 --slots 4 $mode 2>&1 \
      | grep -E "engine_check|rror|panick" | sort | uniq -c | tr '\n' ' '
    echo
  done
done
mps_stop
exit 0
