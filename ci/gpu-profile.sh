#!/usr/bin/env bash
# Where the GPU managers' time goes, by `perf`, on the GPU machine (which has no perf of its
# own). Two halves:
#
#   here:  ci/gpu-profile.sh pack
#          packs this machine's perf and the libraries it needs (xz, about 7 MB) into
#          .device/perfb.tar.xz, and the release `transfer` with its symbols (debug info
#          stripped) as .device/transfer-sym; run after ../shared/device/bundle.sh.
#   there: ci/gpu-profile.sh run [per-round|per-tile]
#          (from the project root, with .device carried) records each rank of an IPC run
#          (1 MiB x 8, copy kernel, 40 000 rounds; two ranks sharing GPU 0 under MPS when there
#          is one GPU) in turn and prints, per rank, the GPU manager thread's hottest symbols
#          with their callers, and annotations of the two ferry symbols named in session 17's
#          profile (benchmark work log, session 17: git show b47892c:docs/benchmarks.md).
set -u
case "${1:-}" in
  pack)
    set -e
    rm -rf /tmp/perfb && mkdir -p /tmp/perfb/lib
    cp "$(command -v perf)" /tmp/perfb/
    # Everything perf links beyond the C runtime, which the GPU machine has (newer).
    ldd "$(command -v perf)" | awk '/=>/{print $3}' \
      | grep -v -E 'libc\.so|libm\.so|ld-linux|libgcc_s|libstdc|libz\.so|libpthread|libdl' \
      | xargs -I{} cp -L {} /tmp/perfb/lib/
    tar cJf .device/perfb.tar.xz -C /tmp perfb
    cp target/release/transfer .device/transfer-sym && strip --strip-debug .device/transfer-sym
    du -sh .device/perfb.tar.xz .device/transfer-sym
    ;;
  run)
    source .device/env.sh
    export FERRY_LOG=warn FERRY_SM_COPY_BYTES=${FERRY_SM_COPY_BYTES:-4M} FERRY_GPU_DIRECT=force
    tar xJf .device/perfb.tar.xz -C /tmp
    # Set before LD_LIBRARY_PATH changes: the traced ranks keep env.sh's libraries.
    PERF="env LD_LIBRARY_PATH=/tmp/perfb/lib:$LD_LIBRARY_PATH /tmp/perfb/perf"
    if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
      export CUDA_VISIBLE_DEVICES=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
      mkdir -p /tmp/mps-pipe /tmp/mps-log
      nvidia-cuda-mps-control -d && sleep 1
    fi
    A="--devices cuda --paths ipc --sizes 1M --inflight 8 --volume 160G --max-rounds 20000 --tasks ${2:-per-round}"
    for r in 0 1; do
      echo "=== perf on rank $r"
      # gpurun is a shell function: the rank picks perf or not inside.
      gpurun -np 2 bash -c "if [ \$OMPI_COMM_WORLD_RANK = $r ]; then exec $PERF record -q -g -F 5000 -o /tmp/g-$r.data -- .device/transfer-sym $A; else exec .device/transfer-sym $A; fi" 2>&1 | grep -E '^ipc' | cut -c1-150
      $PERF report -i /tmp/g-$r.data --no-children --comm ferry-gpu --percentage relative --stdio \
        -g caller,0.5,callee,function,percent --percent-limit 2.5 2>/dev/null | grep -v '^$' | grep -v '^#' | head -150 | cut -c1-170
      for sym in ferry::transfer::Transport::control 'ferry::device::manager::Manager<B>::handle'; do
        echo "=== annotate $sym (rank $r)"
        $PERF annotate -i /tmp/g-$r.data --stdio -s "$sym" 2>/dev/null | grep -E '^ +[0-9]+\.[0-9]+' | sort -rn | head -20 | cut -c1-150
      done
    done
    if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then echo quit | nvidia-cuda-mps-control; fi
    ;;
  *)
    echo "usage: ci/gpu-profile.sh pack | run [per-round|per-tile]" >&2
    exit 2
    ;;
esac
