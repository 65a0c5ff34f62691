#!/usr/bin/env bash
# The engine's shared progress (`Progress::Shared`) on the GPU machine, in one call, 2 ranks (two
# GPUs where there are two, else both on GPU 0 under MPS):
# - engine_check's device and stream scenarios over CUDA IPC with shared progress, with and
#   without a thread of the program calling `progress` all along;
# - engine-bench, device memory over IPC, its own thread against shared progress against the
#   caller's (active-message round trips, put/get latency and bandwidth, 1 and 8 in flight);
# - a real rank per core (`--cpu-set 0,1 --bind-to core`), host memory: active-message round
#   trips with the engine's thread against shared progress.
#
# Needs .device/bin/{engine_check,engine-bench}; run as
#   source .device/env.sh && bash ci/gpu-engine-shared.sh
set -u
source .device/env.sh
source ci/gpu-lib.sh
B=.device/bin
export FERRY_LOG=${FERRY_LOG:-warn}
nvidia-smi -L
mps_if_one_gpu
echo "== engine_check device and stream, CUDA, IPC, shared progress"
for mode in "" --driven; do
  for check in device stream; do
    printf '%-7s shared%-9s ' "$check" "$mode"
    lim 60 -np 2 $B/engine_check $check --cuda --ipc --chunk 1048576 --slots 4 --shared $mode 2>&1 \
      | grep -E "engine_check|rror|panick" | sort | uniq -c | tr '\n' ' '
    echo
  done
done
echo "== engine-bench, device memory over IPC"
for p in thread shared caller; do
  echo "-- progress $p"
  lim 150 -np 2 $B/engine-bench --memory device --route ipc --progress $p --min-size 8 --max-size 4194304 \
    --windows 1,8 --reps 3 --volume-mib 256 2>&1 | grep -E "round trip, (8 B|2 KiB|64 KiB)|latency, (8 B|32 KiB)|bandwidth, (64 KiB|4 MiB)|rror|panick"
done
echo "== a rank per core, host memory"
for p in thread shared; do
  echo "-- progress $p"
  lim 120 -np 2 --cpu-set 0,1 --bind-to core $B/engine-bench --progress $p --min-size 8 --max-size 65536 \
    --windows 1 --reps 5 --volume-mib 16 2>&1 | grep -E "round trip, (8 B|2 KiB|64 KiB)|latency, 8 B|rror|panick"
done
mps_stop
exit 0
