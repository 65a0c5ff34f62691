#!/usr/bin/env bash
# Traces (`Runtime::trace`, replayed insertion) on the GPU machine, in one call: plain against
# replayed insertion, interleaved, REPS times:
# - the stencil on one GPU in small tiles (4096² in 512² tiles, 64 tasks a step): seconds and
#   checksum;
# - the Cholesky's repeated factorizations (--reps 3, the later two replayed): the median
#   seconds, log det and residual;
# - Task Bench's empty GPU tasks (`taskbench -gpu`, stencil_1d and trivial, 2000 × 128): tasks/s;
# then 2 ranks (two GPUs where there are two, else both on GPU 0 under MPS): the stencil's
# checksum with replay against without.
#
# Needs .device/bin/{stencil,cholesky,taskbench}; run as
#   source .device/env.sh && bash ci/gpu-replay.sh [REPS]
set -u
source .device/env.sh
source ci/gpu-lib.sh
B=.device/bin
reps=${1:-3}
export FERRY_LOG=${FERRY_LOG:-warn}
nvidia-smi -L
S="$B/stencil --devices cuda --n 4096 --nb 512 --iters 500 --warmup 10 -q"
C="$B/cholesky --devices cuda --n 16384 --nb 1024 --reps 3 -q"
for rep in $(seq "$reps"); do
  for mode in plain replay; do
    flag=""; tflag=""
    if [ "$mode" = replay ]; then flag="--replay"; tflag="-replay"; fi
    printf 'rep %s %-6s stencil 1 GPU:  ' "$rep" "$mode"
    lim 120 -np 1 $S $flag 2>&1 | grep -E '^(seconds|checksum)|rror|panick' | awk '{printf "%s %s  ", $1, $2}'
    echo
    printf 'rep %s %-6s cholesky:  ' "$rep" "$mode"
    lim 240 -np 1 $C $flag 2>&1 | grep -E '^(seconds|reps|residual |log det)|rror|panick' \
      | awk '/^log det/ {printf "log det %s  ", $3; next} /^reps/ {printf "reps %s %s %s  ", $2, $3, $4; next} {printf "%s %s  ", $1, $2}'
    echo
    for type in stencil_1d trivial; do
      printf 'rep %s %-6s taskbench -gpu %s:  ' "$rep" "$mode" "$type"
      lim 120 -np 1 $B/taskbench -steps 2000 -width 128 -type $type -kernel empty -gpu $tflag 2>&1 \
        | grep -E '^(GPU tasks/s|Elapsed)|rror|panick' | tr '\n' ' '
      echo
    done
  done
done
mps_if_one_gpu
for mode in plain replay; do
  flag=""
  if [ "$mode" = replay ]; then flag="--replay"; fi
  printf '2 ranks %-6s stencil:  ' "$mode"
  lim 120 -np 2 $B/stencil --devices cuda --n 4096 --nb 512 --iters 300 --warmup 10 $flag 2>&1 \
    | grep -E '^(seconds|checksum)|^traces|rror|panick' | tr '\n' ' '
  echo
done
mps_stop
