#!/usr/bin/env bash
# A/B of two builds on the GPU machine, interleaved in one call: run from the project root there
# with .device carried, each build's release binaries (cholesky, taskbench, transfer) xz-packed
# as .device/<build>.tar.xz by `ci/gpu-ab.sh pack <build> <dir>` here.
#
#   here:  ci/gpu-ab.sh pack base /path/to/old/target/release
#          ci/gpu-ab.sh pack head target/release
#   there: ci/gpu-ab.sh run base head [REPS]
#
# Per build and repetition, alternating the builds:
#   - Cholesky N = 32768, nb 2048, one rank on GPU 0, against cuSOLVER's dpotrf of the same
#     matrix in the same process (`--compare-dense`);
#   - empty GPU tasks per second on GPU 0 (`taskbench -gpu`, trivial and stencil_1d);
#   - IPC transfers of 1 MiB and 4 MiB with 8 in flight between two ranks: on two GPUs where
#     there are two, else both ranks on GPU 0 under MPS (the proxy: the same GPU managers' work,
#     no link).
# Prints one line per measurement, then a table of medians per build.
set -u
case "${1:-}" in
  pack)
    set -e
    name=$2 dir=$3
    tmp=$(mktemp -d)
    mkdir -p "$tmp/$name" .device
    for b in cholesky taskbench transfer; do
      cp "$dir/$b" "$tmp/$name/" && strip "$tmp/$name/$b"
    done
    for b in body_panic start_failure; do
      if [ -x "$dir/$b" ]; then cp "$dir/$b" "$tmp/$name/" && strip "$tmp/$name/$b"; fi
    done
    tar cJf ".device/$name.tar.xz" -C "$tmp" "$name"
    rm -rf "$tmp"
    du -sh ".device/$name.tar.xz"
    ;;
  run)
    a=$2 b=$3 reps=${4:-2}
    source .device/env.sh
    export FERRY_LOG=warn
    for v in "$a" "$b"; do tar xJf ".device/$v.tar.xz" -C /tmp; done
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    ngpu=$(nvidia-smi -L | wc -l)
    out=${OUT:-/tmp}/ab.txt
    : > "$out"
    for rep in $(seq 1 "$reps"); do
      for v in "$a" "$b"; do
        bin=/tmp/$v
        # A pool of 40 GiB leaves cuSOLVER room for its own copy of the matrix (8 GiB) on an
        # 80 GB H100: the default pool takes most of the free memory.
        CUDA_VISIBLE_DEVICES=0 FERRY_DEVICES=cuda FERRY_DEVICE_MEM=40G gpurun -np 1 "$bin/cholesky" --n 32768 --nb 2048 \
          --check none --compare-dense -q 2>&1 \
          | awk -v p="$v $rep" '/^GFLOP/{g=$2} /^cuSOLVER/{print p, "cholesky-32768-gflops", g; print p, "cusolver-gflops", $4; print p, "cholesky/cusolver", $NF} /rror|panick/{print p, "ERROR", $0}' \
          | tee -a "$out"
        for ty in trivial stencil_1d; do
          CUDA_VISIBLE_DEVICES=0 FERRY_DEVICES=cuda gpurun -np 1 "$bin/taskbench" -steps 2000 -width 128 -type $ty -gpu 2>&1 \
            | awk -v p="$v $rep" -v t=$ty '/Total Tasks/{n=$3} /Elapsed/{printf "%s gpu-tasks/s-%s %.0f\n", p, t, n/$3} /rror|panick/{print p, "ERROR", $0}' \
            | tee -a "$out"
        done
      done
    done
    if [ "$ngpu" -lt 2 ]; then
      export CUDA_VISIBLE_DEVICES=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
      mkdir -p /tmp/mps-pipe /tmp/mps-log
      nvidia-cuda-mps-control -d && sleep 1
    fi
    for rep in $(seq 1 "$reps"); do
      for v in "$a" "$b"; do
        FERRY_GPU_DIRECT=force gpurun -np 2 "/tmp/$v/transfer" --devices cuda --paths ipc --sizes 1M,4M \
          --inflight 8 --volume 4G --tasks per-round 2>&1 \
          | awk -v p="$v $rep" '/^ipc +[0-9]+[KM]/{print p, "ipc-" $2 "x" $3 "-GB/s", $5} /^(error|panicked)|rror:.*panick/{print p, "ERROR", $0}' \
          | tee -a "$out"
      done
    done
    if [ "$ngpu" -lt 2 ]; then echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_VISIBLE_DEVICES; fi
    # The CUDA error paths of the kernel launch, on the second build.
    for t in body_panic start_failure; do
      if [ -x "/tmp/$b/$t" ]; then
        (export CUDA_VISIBLE_DEVICES=0 FERRY_DEVICES=cuda FERRY_HOST_MEM_LIMIT=1G; gpurun -np 1 "/tmp/$b/$t" 2>&1 | grep -E "ferry|error|panick|thread" | head -4 | sed "s/^/$b $t: /")
      fi
    done
    echo
    echo "medians per build ($reps repetitions)"
    # Median per (measurement, build): sorted numerically, then the middle (or the mean of the
    # two middle values).
    awk '$3 != "ERROR" {print $3, $1, $4}' "$out" | sort -k1,1 -k2,2 -k3,3g \
      | awk '{k=$1" "$2; v[k]=v[k] " " $3; n[k]++} END {for (k in v) {split(substr(v[k],2), a, " "); c=n[k]; m=(c%2)?a[(c+1)/2]:(a[c/2]+a[c/2+1])/2; print k, m}}' \
      | sort
    ;;
  *)
    echo "usage: ci/gpu-ab.sh pack NAME DIR | run NAME_A NAME_B [REPS]" >&2
    exit 2
    ;;
esac
