# Shared by the GPU-machine check scripts (`source ci/gpu-lib.sh` after `source .device/env.sh`).

# gpurun with a time limit in seconds: `lim SECONDS ARGS…` (a shell function cannot run under
# `timeout` itself).
lim() { local t=$1; shift; timeout "$t" bash -c 'source .device/env.sh && gpurun "$@"' gpurun "$@"; }

# On a machine with one GPU, the ranks share GPU 0 under MPS: starts the control daemon.
mps_if_one_gpu() {
  if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
    export CUDA_VISIBLE_DEVICES=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p /tmp/mps-pipe /tmp/mps-log
    nvidia-cuda-mps-control -d && sleep 1
  fi
}

# Stops the MPS daemon that mps_if_one_gpu started, if any.
mps_stop() {
  if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then echo quit | nvidia-cuda-mps-control; fi
}
