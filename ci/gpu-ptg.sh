#!/usr/bin/env bash
# The PTG Cholesky in C (examples/c/ptg_cholesky.c, on the engine alone, tiles in device memory
# it allocates itself, cuSOLVER/cuBLAS on its own streams) against the STF `cholesky` on the GPU
# machine, in one call: correctness at N = 2048 on 1 and 2 ranks (log det and residual against
# the STF run of the same matrix), then N = 32768, nb = 2048 on one GPU, PTG and STF interleaved,
# then N = 16384 on 2 ranks (tiles pulled between ranks' device slabs with stream-ordered gets).
# Two ranks share GPU 0 under MPS where there is one GPU (the proxy for two).
#
# Needs .device/bin/{ptg_cholesky,libferry.so,cholesky} (ptg_cholesky built with
# -Wl,-rpath,'$ORIGIN'); run as
#   source .device/env.sh && bash ci/gpu-ptg.sh
# Settings: REPS (STF/PTG pairs at N = 32768, default 2), N (default 32768), NB (default 2048).
set -u
source .device/env.sh
B=.device/bin
export FERRY_LOG=${FERRY_LOG:-warn}
limited() {
  local t=$1
  shift
  timeout "$t" bash -c 'source .device/env.sh && gpurun "$@"' gpurun "$@"
}
keep() { grep -E --line-buffered "^(ptg_cholesky|time|GFLOP/s|residual|log det|gets|seconds|grid)|rror|panick|cannot"; }
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
mps_on() {
  export CUDA_VISIBLE_DEVICES=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p /tmp/mps-pipe /tmp/mps-log
  nvidia-cuda-mps-control -d && sleep 1
}
mps_off() { echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_VISIBLE_DEVICES CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
two_on() { if [ "$ngpu" -lt 2 ]; then mps_on; fi; }
two_off() { if [ "$ngpu" -lt 2 ]; then mps_off; fi; }
n=${N:-32768} nb=${NB:-2048}

echo "== correctness, N 2048, nb 256 (residual and log det; STF the same matrix)"
limited 120 -np 1 "$B/cholesky" --devices cuda --n 2048 --nb 256 --check none | keep
CUDA_VISIBLE_DEVICES=0 limited 120 -np 1 "$B/ptg_cholesky" --devices cuda --n 2048 --nb 256 --reps 2 | keep
two_on
limited 120 -np 2 "$B/ptg_cholesky" --devices cuda --n 2048 --nb 256 --reps 2 | keep
two_off

echo "== N $n, nb $nb, one GPU: STF and PTG interleaved"
for rep in $(seq 1 "${REPS:-2}"); do
  echo "-- STF $rep"
  FERRY_DEVICE_MEM=40G CUDA_VISIBLE_DEVICES=0 limited 180 -np 1 "$B/cholesky" --devices cuda --n "$n" --nb "$nb" --check none | keep
  echo "-- PTG $rep"
  CUDA_VISIBLE_DEVICES=0 limited 180 -np 1 "$B/ptg_cholesky" --devices cuda --n "$n" --nb "$nb" --reps 3 | keep
done

echo "== N 16384, nb 2048, 2 ranks ($([ "$ngpu" -lt 2 ] && echo 'one GPU under MPS' || echo 'two GPUs')): STF and PTG"
two_on
FERRY_DEVICE_MEM=20G limited 180 -np 2 "$B/cholesky" --devices cuda --n 16384 --nb 2048 --check none | keep
limited 180 -np 2 "$B/ptg_cholesky" --devices cuda --n 16384 --nb 2048 --reps 3 | keep
two_off
