#!/usr/bin/env bash
# The transfer layer's host-route tiles through the control ring, and fused replays, on CUDA
# ranks of the GPU machine (two ranks share GPU 0 under MPS), in one call:
# - the stencil in 6 × 6 tiles (48-byte halo edges) with FERRY_TRANSFER_PATH=host on 2 CUDA
#   ranks: the edges on `host-ring`, and with FERRY_CONTROL_RING=off on `host-eager`; the
#   checksum the one-CPU-rank run's (6e016a57348a95ee) every way;
# - the stencil 4096² in 512² tiles on 1 CUDA rank with and without --replay (fused CUDA graph
#   replays) and on 2 CUDA ranks with --replay: one checksum;
# - Task Bench stencil_1d with -gpu -replay on 2 CUDA ranks: transfers as the graph implies.
#
# Needs .device/bin/{stencil,taskbench}; run as
#   source .device/env.sh && bash ci/gpu-ring-tiles.sh
set -u
source .device/env.sh
B=.device/bin
limited() { local t=$1; shift; timeout "$t" bash -c 'source .device/env.sh && gpurun "$@"' gpurun "$@"; }
keep() { grep -E "^checksum|^host-eager |^host-ring |^control-ring |^seconds|rror|panick"; }
nvidia-smi -L
export CUDA_VISIBLE_DEVICES=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe2 CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log2
mkdir -p /tmp/mps-pipe2 /tmp/mps-log2
nvidia-cuda-mps-control -d && sleep 1
S="--n 48 --nb 6 --iters 10"
echo "== stencil $S, 1 CPU rank (the reference checksum)"
limited 60 -np 1 "$B/stencil" $S --devices none 2>&1 | keep
for ring in on off; do
  echo "== stencil $S, 2 CUDA ranks, host route, control ring $ring"
  FERRY_TRANSFER_PATH=host FERRY_CONTROL_RING=$ring limited 90 -np 2 "$B/stencil" $S --devices cuda 2>&1 | keep
done
L="--n 4096 --nb 512 --iters 60 --warmup 10"
for r in "" "--replay"; do
  echo "== stencil $L ${r:-plain}, 1 CUDA rank"
  limited 120 -np 1 "$B/stencil" $L --devices cuda $r 2>&1 | keep
done
echo "== stencil $L --replay, 2 CUDA ranks"
limited 120 -np 2 "$B/stencil" $L --devices cuda --replay 2>&1 | keep
echo "== taskbench stencil_1d -gpu -replay, 2 CUDA ranks"
limited 120 -np 2 "$B/taskbench" -steps 200 -width 4 -type stencil_1d -gpu -replay 2>&1 | grep -E "^Elapsed|^Transfers|^Replay|^GPU|rror|panick"
echo quit | nvidia-cuda-mps-control; sleep 1
echo "== done"
