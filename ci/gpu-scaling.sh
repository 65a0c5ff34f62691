#!/usr/bin/env bash
# Scaling across the GPUs of one node, against NVIDIA's multi-GPU Cholesky (cuSOLVERMg) in the
# same call. Run from the project root on the GPU machine with .device carried and the release
# binaries cholesky, stencil, transfer and potrf-anchor in .device/bin:
#
#   ci/gpu-scaling.sh two     # 2 GPUs: IPC 1M/4M/256M x 8 against the bare peer copy, Cholesky
#                             # N = 65536 on one GPU / one rank with both / two ranks, peer copies
#                             # on and off, the 4096² and 20480² stencils, cuSOLVERMg on both
#   ci/gpu-scaling.sh many    # 1, 2, 4, 8 GPUs (as many as there are): Cholesky strong scaling at
#                             # N = 65536 and weak scaling towards N = 180,000 (a rank per GPU, and
#                             # one rank driving all), cuSOLVERMg at each size, the transfer matrix
#                             # between every pair at 4 MiB, the stencil at 20480² and 40960², and
#                             # the GeoNames covariance of all places in core against one GPU
#   ci/gpu-scaling.sh all     # both
#
# SMOKE=1 shrinks every size so that the whole script runs in a few minutes on ONE GPU, with the
# ranks of the multi-rank runs sharing GPU 0 under MPS: the check that a later multi-GPU call
# spends its minutes measuring. Each run prints a line `RESULT <name> <figure> <unit>`; the
# drivers' JSON records go to $OUT (or /tmp/ferry-scaling).
set -u
source .device/env.sh
out=${OUT:-/tmp/ferry-scaling}
mkdir -p "$out"
export FERRY_LOG=${FERRY_LOG:-warn}
B=.device/bin
ngpu=$(nvidia-smi -L | wc -l)
smoke=${SMOKE:-}
if [ -n "$smoke" ]; then
  N=8192 NW=12288 NB=1024 S1=2048 S2=4096 S3=4096 IPC="1M,4M,64M" VOL=1G NMAX=16384
else
  N=65536 NW=65536 NB=2048 S1=4096 S2=20480 S3=40960 IPC="1M,4M,256M" VOL=16G NMAX=180224
fi
# A run with <g> GPUs: the first g ordinals, or GPU 0 for every rank under MPS where the machine
# has fewer (smoke runs).
mps=""
mps_on() {
  [ -n "$mps" ] && return
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p /tmp/mps-pipe /tmp/mps-log
  CUDA_VISIBLE_DEVICES=0 nvidia-cuda-mps-control -d && sleep 1 && mps=1
}
mps_off() {
  [ -z "$mps" ] && return
  echo quit | nvidia-cuda-mps-control; sleep 1; mps=""
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
pick() { # pick G: sets VIS, the CUDA_VISIBLE_DEVICES for G GPUs (starting MPS where short)
  if [ "$1" -le "$ngpu" ]; then VIS=$(seq -s, 0 $(($1 - 1))); else mps_on; VIS=0; fi
}
# result NAME UNIT AWK-PROGRAM -- CMD...: runs CMD, keeps its log, prints RESULT from the awk.
result() {
  local name=$1 unit=$2 prog=$3; shift 4
  local log="$out/$name.log"
  "$@" > "$log" 2>&1; local rc=$?
  local fig; fig=$(awk "$prog" "$log" | tail -1)
  if [ $rc -ne 0 ] || [ -z "$fig" ]; then
    echo "RESULT $name FAILED (rc $rc): $(grep -m2 -iE 'error|panick' "$log" | tr '\n' ' ')"
  else
    echo "RESULT $name $fig $unit"
  fi
}
GF='/^GFLOP/{print $2}'
SECS='/^seconds/{print $2}'
LOGDET='/^log det/{print $3}'

chol() { # chol NAME G NP N [VAR=VALUE...]: Cholesky on G GPUs with NP ranks
  local name=$1 g=$2 np=$3 n=$4; shift 4
  pick "$g"
  result "$name" GFLOP/s "$GF" -- env CUDA_VISIBLE_DEVICES="$VIS" FERRY_DEVICES=cuda "$@" \
    bash -c "source .device/env.sh; gpurun -np $np $B/cholesky --devices cuda --n $n --nb $NB --check none --json $out/$name.json"
}
anchor() { # anchor NAME G N: cuSOLVERMg on G GPUs
  local name=$1 g=$2 n=$3 devs
  if [ "$g" -le "$ngpu" ]; then devs=$(seq -s, 0 $(($g - 1))); else devs=0; fi
  mps_off
  result "$name" GFLOP/s '/^cuSOLVERMg/{print $6}' -- $B/potrf-anchor --n "$n" --nb $NB --devices "$devs" --json "$out/$name.json"
}
stencil() { # stencil NAME G NP N
  local name=$1 g=$2 np=$3 n=$4
  pick "$g"
  result "$name" s "$SECS" -- env CUDA_VISIBLE_DEVICES="$VIS" \
    bash -c "source .device/env.sh; gpurun -np $np $B/stencil --devices cuda --n $n --nb 2048 --iters 1000 --warmup 5 --json $out/$name.json"
}

two() {
  echo "== two GPUs ($ngpu present${smoke:+, smoke sizes})"
  pick 2
  result ipc-x8 GB/s '/^ipc +[0-9]+[KM]/{s=s $2 ":" $5 " "} /^peer/{s=s "peer-copy:" $0 " "} END{print s}' -- env CUDA_VISIBLE_DEVICES="$VIS" FERRY_GPU_DIRECT=force \
    bash -c "source .device/env.sh; gpurun -np 2 $B/transfer --devices cuda --paths ipc --sizes $IPC --inflight 8 --volume $VOL --json $out/ipc.json"
  mps_off
  chol chol-1gpu 1 1 $N
  chol chol-1rank-2gpu 2 1 $N
  chol chol-1rank-2gpu-nopeer 2 1 $N FERRY_PEER_COPY=off
  chol chol-2rank 2 2 $N
  mps_off
  anchor potrf-mg-2gpu 2 $N
  for n in $S1 $S2; do
    stencil "stencil-$n-1gpu" 1 1 $n
    stencil "stencil-$n-2rank" 2 2 $n
    mps_off
  done
}

many() {
  echo "== 1 to $ngpu GPUs${smoke:+ (smoke sizes)}"
  local top=$ngpu; [ -n "$smoke" ] && top=4
  for g in 1 2 4 8; do
    [ "$g" -gt "$top" ] && break
    chol "strong-$N-${g}rank" $g $g $N
    chol "strong-$N-1rank-${g}gpu" $g 1 $N
    mps_off
    anchor "strong-$N-mg-${g}gpu" $g $N
    # Weak scaling: the work (n³) grows with the GPUs; n rounded to the block size.
    local nw; nw=$(awk -v n=$NW -v g=$g -v b=$NB -v m=$NMAX 'BEGIN{x=int(n*exp(log(g)/3)/b)*b; if (x>m) x=m; print x}')
    chol "weak-$nw-${g}rank" $g $g $nw
    mps_off
    anchor "weak-$nw-mg-${g}gpu" $g $nw
    stencil "stencil-$S2-${g}rank" $g $g $S2
    stencil "stencil-$S3-${g}rank" $g $g $S3
    mps_off
  done
  # The transfer matrix: every ordered pair of GPUs at 4 MiB x 8 (route and GB/s).
  if [ "$ngpu" -ge 2 ]; then
    for i in $(seq 0 $(($ngpu - 1))); do for j in $(seq 0 $(($ngpu - 1))); do
      [ "$i" = "$j" ] && continue
      result "pair-$i-$j-4M" GB/s '/^[a-z-]+ +4M +8 /{s=s $1 ":" $5 " "} END{print s}' -- env CUDA_VISIBLE_DEVICES=$i,$j \
        bash -c "source .device/env.sh; gpurun -np 2 $B/transfer --devices cuda --paths ipc,gpu-direct,staged --sizes 4M --inflight 8 --volume 2G"
    done; done
  fi
  # GeoNames: every place in core across the GPUs, against one GPU out of core.
  if [ -f "$B/cities1000.csv" ]; then
    local pts=(--points $B/cities1000.csv --nb $NB --kernel matern32 --order morton --check none)
    [ -n "$smoke" ] && pts+=(--count 20000)
    result geo-1gpu-ooc loglik '/^log-lik/{print $2}' -- env CUDA_VISIBLE_DEVICES=0 FERRY_DEVICE_MEM=${GEO_MEM:-48G} \
      bash -c "source .device/env.sh; gpurun -np 1 $B/cholesky --devices cuda ${pts[*]} --json $out/geo-1gpu.json"
    pick "$top"
    result "geo-${top}rank" loglik '/^log-lik/{print $2}' -- env CUDA_VISIBLE_DEVICES="$VIS" \
      bash -c "source .device/env.sh; gpurun -np $top $B/cholesky --devices cuda ${pts[*]} --json $out/geo-${top}rank.json"
    mps_off
  else
    echo "RESULT geo SKIPPED (no $B/cities1000.csv)"
  fi
}

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
case "${1:-all}" in
  two) two ;;
  many) many ;;
  all) two; many ;;
  *) echo "usage: ci/gpu-scaling.sh two|many|all" >&2; exit 2 ;;
esac
mps_off
