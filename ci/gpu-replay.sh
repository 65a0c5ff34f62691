#!/usr/bin/env bash
# Traces (`Runtime::trace`) on the GPU machine, in one call. Three modes, interleaved, REPS times:
#   plain  — no traces;
#   tasks  — replayed insertion, task by task (FERRY_TRACE_GRAPHS=off);
#   graph  — replayed insertion with the GPU tasks of each replay fused into one CUDA graph
#            (the default on a rank with one device).
# - the stencil on one GPU in small tiles (4096² in 512² tiles, 64 tasks a step), with its
#   no-runtime anchor in the same process: seconds, anchor, checksum;
# - the Cholesky's repeated factorizations (--reps 3, the later two replayed): the median
#   seconds, log det and residual;
# - Task Bench's empty GPU tasks (`taskbench -gpu`, stencil_1d and trivial, 2000 × 128; and
#   `-gpu-kernel`, an empty kernel launched per task, stencil_1d): tasks/s;
# then 2 ranks (two GPUs where there are two, else both on GPU 0 under MPS): the stencil's
# checksum with replay against without (nothing fuses there: the traces send and receive).
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
S="$B/stencil --devices cuda --n 4096 --nb 512 --iters 510 --warmup 10 --anchor"
C="$B/cholesky --devices cuda --n 16384 --nb 1024 --reps 3"
for rep in $(seq "$reps"); do
  for mode in plain tasks graph; do
    flag=""; tflag=""; graphs=on
    if [ "$mode" != plain ]; then flag="--replay"; tflag="-replay"; fi
    if [ "$mode" = tasks ]; then graphs=off; fi
    export FERRY_TRACE_GRAPHS=$graphs
    printf 'rep %s %-5s stencil 1 GPU:  ' "$rep" "$mode"
    lim 120 -np 1 $S $flag 2>&1 | grep -E '^(seconds|anchor|checksum)|^fused|rror|panick' | awk '{printf "%s  ", $0}'
    echo
    printf 'rep %s %-5s cholesky:  ' "$rep" "$mode"
    lim 240 -np 1 $C -q $flag 2>&1 | grep -E '^(seconds|reps|residual |log det)|rror|panick' \
      | awk '/^log det/ {printf "log det %s  ", $3; next} /^reps/ {printf "reps %s %s %s  ", $2, $3, $4; next} {printf "%s %s  ", $1, $2}'
    echo
    for tg in stencil_1d:-gpu trivial:-gpu stencil_1d:-gpu-kernel; do
      type=${tg%%:*}; g=${tg#*:}
      printf 'rep %s %-5s taskbench %s %s:  ' "$rep" "$mode" "$g" "$type"
      lim 120 -np 1 $B/taskbench -steps 2000 -width 128 -type $type -kernel empty $g $tflag 2>&1 \
        | grep -E '^(GPU tasks/s|Elapsed)|rror|panick' | tr '\n' ' '
      echo
    done
  done
done
unset FERRY_TRACE_GRAPHS
printf 'stencil 1 GPU, statistics of a fused run:\n'
lim 120 -np 1 $B/stencil --devices cuda --n 4096 --nb 512 --iters 110 --warmup 10 --replay 2>&1 \
  | grep -E '^(checksum|traces|fused)|rror|panick'
mps_if_one_gpu
for mode in plain replay; do
  flag=""
  if [ "$mode" = replay ]; then flag="--replay"; fi
  printf '2 ranks %-6s stencil:  ' "$mode"
  lim 120 -np 2 $B/stencil --devices cuda --n 4096 --nb 512 --iters 300 --warmup 10 -q $flag 2>&1 \
    | grep -E '^(seconds|checksum)|^traces|rror|panick' | tr '\n' ' '
  echo
done
mps_stop
