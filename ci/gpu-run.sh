#!/usr/bin/env bash
# The GPU-machine check of the CUDA paths (issue 3): run from the project root there, after
# `source .device/env.sh`, with the example binaries bundled into .device/bin. Prints each run's
# summary and writes JSON records under $OUT (or /tmp/ferry-gpu).
set -u
# gpurun is a shell function of env.sh: define it in this shell.
source .device/env.sh
out=${OUT:-/tmp/ferry-gpu}
mkdir -p "$out"
export FERRY_LOG=${FERRY_LOG:-warn}
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader
one() { CUDA_VISIBLE_DEVICES=0 gpurun -np 1 "$@"; }
# gpurun is a function, so `env VAR=x gpurun` cannot work: set the variables here.
via() { local p=$1; shift; FERRY_TRANSFER_PATH=$p FERRY_GPU_DIRECT=force gpurun "$@"; }
chol() { grep -E "^(n |nb |grid|seconds|GFLOP|residual|log det|log-lik|backward|checkpoint|restarted|rank  |[0-9] +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]|[0-9]+ +cuda|device|cuSOLVER|max rel|checksum|cell updates|peer |h2d |d2h |host-|staged |gpu-direct |ipc |control |path |[a-z-]+ +[0-9]+[KM] |pinned|bounce)|error|panick" ; }
# A halo-path toggle on/off, interleaved in the same binaries: the 4096² stencil on 1 GPU
# (`--overlap`, the control) and on 2 ranks (`--overlap` and plain), then IPC transfers.
# ab_halo VARIABLE LABEL "REPS"
ab_halo() {
  local var=$1 label=$2 reps=$3 rep v a b c
  local S=".device/bin/stencil --devices cuda --n 4096 --nb 2048 --iters 1000 --warmup 5 -q"
  secs() { awk '/^seconds|^checksum/{printf "%s ", $2}'; }
  for rep in $reps; do
    for v in on off; do
      a=$(export "$var=$v"; CUDA_VISIBLE_DEVICES=0 gpurun -np 1 $S --overlap | secs)
      b=$(export "$var=$v"; gpurun -np 2 $S --overlap | secs)
      c=$(export "$var=$v"; gpurun -np 2 $S | secs)
      echo "rep $rep $label=$v: 1gpu-ov $a| 2rank-ov $b| 2rank-plain $c"
      (export "$var=$v"; FERRY_GPU_DIRECT=force gpurun -np 2 .device/bin/transfer --devices cuda --paths ipc --sizes 64K,1M,4M --inflight 8 --volume 512M 2>&1) | grep -E '^ipc +[0-9]+[KM]' | sed "s/^/rep $rep $label=$v /"
    done
  done
}
# Ranks sharing GPU 0 under MPS. mps_on starts the control daemon (fails when it cannot),
# mps_off stops it.
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  CUDA_VISIBLE_DEVICES=0 nvidia-cuda-mps-control -d && sleep 1
}
mps_off() { echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
# The IPC route between two GPUs when there are two; on a one-GPU machine, two ranks sharing
# GPU 0 under MPS (session 13's proxy: a pull is a copy within the GPU that costs no link, so
# the GPU managers' per-transfer work — the same code as between two GPUs — bounds the rate).
proxied=""
proxy_on() {
  proxied=""
  if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
    export CUDA_VISIBLE_DEVICES=0
    mps_on && proxied=1
  fi
}
proxy_off() { if [ -n "$proxied" ]; then mps_off; fi; unset CUDA_VISIBLE_DEVICES; }
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$(date +%s%N); "$@" 2>&1 | tee "$out/$name.log" | chol; echo "(wall $(( ($(date +%s%N) - t0) / 1000000 )) ms)"; }

case "${1:-all}" in
  cholesky|all)
    run chol-8k-exact one .device/bin/cholesky --devices cuda --n 8192 --nb 1024 --check exact --json "$out/chol-8k.json"
    run chol-32k-1gpu-nb1024 one .device/bin/cholesky --devices cuda --n 32768 --nb 1024 --check exact --compare-dense --json "$out/chol-32k-1gpu-1024.json"
    run chol-32k-1gpu-nb2048 one .device/bin/cholesky --devices cuda --n 32768 --nb 2048 --check none --compare-dense --json "$out/chol-32k-1gpu-2048.json"
    run chol-32k-1rank-2gpu gpurun -np 1 .device/bin/cholesky --devices cuda --n 32768 --nb 2048 --check none --json "$out/chol-32k-2gpu.json"
    run chol-32k-2rank gpurun -np 2 .device/bin/cholesky --devices cuda --n 32768 --nb 2048 --check none --json "$out/chol-32k-2rank.json"
    run chol-64k-1gpu one .device/bin/cholesky --devices cuda --n 65536 --nb 2048 --check none --json "$out/chol-64k-1gpu.json"
    run chol-64k-1rank-2gpu gpurun -np 1 .device/bin/cholesky --devices cuda --n 65536 --nb 2048 --check none --json "$out/chol-64k-2gpu.json"
    ;;&
  stencil|all)
    for n in 8192 20480; do
      run "stencil-$n-1gpu" one .device/bin/stencil --devices cuda --n $n --nb 2048 --iters 1000 --warmup 5 --json "$out/stencil-$n-1gpu.json"
      run "stencil-$n-2gpu" gpurun -np 1 .device/bin/stencil --devices cuda --n $n --nb 2048 --iters 1000 --warmup 5 --json "$out/stencil-$n-2gpu.json"
    done
    ;;
  transfer|all)
    # Issue 4: every payload path between two ranks on one node (GPU-direct forced: this MPI is
    # CUDA-aware only through the bundled UCX, and MPIX_Query_cuda_support says 0).
    # 16 GiB of pinned host memory: 16 tiles of 256 MiB in flight need their host buffers pinned
    # on the host and staged paths (the default 4 GiB would fall back to pageable memory).
    FERRY_HOST_PINNED_BYTES=16G run transfer via auto -np 2 .device/bin/transfer --devices cuda ${TRANSFER_ARGS:-} --json "$out/transfer.json"
    for p in ${CHOL_PATHS:-ipc gpu-direct staged host}; do
      run "chol-2rank-$p" via $p -np 2 .device/bin/cholesky --devices cuda --n ${CHOL_N:-32768} --nb 2048 --check none --json "$out/chol-2rank-$p.json"
    done
    for p in ${STENCIL_PATHS:-ipc staged}; do
      run "stencil-20480-2rank-$p" via $p -np 2 .device/bin/stencil --devices cuda --n 20480 --nb 2048 --iters 1000 --warmup 5 --json "$out/stencil-2rank-$p.json"
    done
    ;;
  tiers|all)
    # Issue 5: out-of-core Cholesky on one GPU (the lower triangle, 12.5 GB at N = 56000, is
    # stored: 8 GiB is the pool for data 1.5x the pool, 16 GiB the issue's example), against the
    # same N in core; then the full GeoNames covariance (lower triangle 83.6 GB) on one GPU with
    # a 48 GiB pool (host memory backs it) and on two GPUs; then the snapshot stencil through
    # device, host and disk against the same run in memory.
    N=${OOC_N:-56000}
    run chol-ooc-incore one .device/bin/cholesky --devices cuda --n $N --nb 2048 --check none --json "$out/chol-ooc-incore.json"
    FERRY_DEVICE_MEM=16G run chol-ooc-16g one .device/bin/cholesky --devices cuda --n $N --nb 2048 --check none --json "$out/chol-ooc-16g.json"
    FERRY_DEVICE_MEM=8G run chol-ooc-8g one .device/bin/cholesky --devices cuda --n $N --nb 2048 --check none --json "$out/chol-ooc-8g.json"
    if [ -z "${SKIP_GEO:-}" ]; then
      FERRY_DEVICE_MEM=48G run geo-1gpu-48g one .device/bin/cholesky --devices cuda --points .device/bin/cities1000.csv --nb 2048 --kernel matern32 --order morton --check none --json "$out/geo-1gpu.json"
      run geo-2gpu gpurun -np 1 .device/bin/cholesky --devices cuda --points .device/bin/cities1000.csv --nb 2048 --kernel matern32 --order morton --check none --json "$out/geo-2gpu.json"
    fi
    SN=${SNAP_N:-8192}; SI=${SNAP_ITERS:-40}
    run snap-inmem one .device/bin/stencil --devices cuda --n $SN --nb 2048 --iters $SI --save-snapshots --json "$out/snap-inmem.json"
    mkdir -p /tmp/ferry-spill
    FERRY_DEVICE_MEM=6G FERRY_HOST_MEM_LIMIT=6G FERRY_SPILL_DIR=/tmp/ferry-spill run snap-tiers one .device/bin/stencil --devices cuda --n $SN --nb 2048 --iters $SI --save-snapshots --json "$out/snap-tiers.json"
    ls -la /tmp/ferry-spill
    ;;&
  latency|all)
    # Issues 4 and 8: small IPC transfers, the 4096² stencil on one and two GPUs with and without
    # --overlap (interior/ring split), Chrome traces with per-stream GPU tracks (merged here with
    # `cargo xtask trace-merge`), and the empty-GPU-task rate.
    FERRY_HOST_PINNED_BYTES=8G run transfer-small via auto -np 2 .device/bin/transfer --devices cuda --paths ipc --sizes 64K,1M,4M,16M --inflight 8,16 --volume 1G --json "$out/transfer-small.json"
    for nb in ${S4K_NB:-2048 1024}; do
      for ov in ${S4K_OV-"" --overlap}; do
        t=${ov:+-ov}
        run "s4k-$nb-1gpu$t" one .device/bin/stencil --devices cuda --n 4096 --nb $nb --iters 1000 --warmup 5 $ov --json "$out/s4k-$nb-1gpu$t.json"
        run "s4k-$nb-2rank$t" gpurun -np 2 .device/bin/stencil --devices cuda --n 4096 --nb $nb --iters 1000 --warmup 5 $ov --json "$out/s4k-$nb-2rank$t.json"
        run "s4k-$nb-1rank2gpu$t" gpurun -np 1 .device/bin/stencil --devices cuda --n 4096 --nb $nb --iters 1000 --warmup 5 $ov --json "$out/s4k-$nb-1rank2gpu$t.json"
      done
    done
    FERRY_TRACE=$out/trace-s4k-ov run s4k-trace-ov gpurun -np 2 .device/bin/stencil --devices cuda --n 4096 --nb 2048 --iters 100 --warmup 5 --overlap -q
    FERRY_TRACE=$out/trace-s4k run s4k-trace gpurun -np 2 .device/bin/stencil --devices cuda --n 4096 --nb 2048 --iters 100 --warmup 5 -q
    FERRY_TRACE=$out/trace-ipc1m run transfer-trace via auto -np 2 .device/bin/transfer --devices cuda --paths ipc --sizes 1M --inflight 8 --volume 128M
    for ty in trivial stencil_1d; do
      CUDA_VISIBLE_DEVICES=0 FERRY_DEVICES=cuda gpurun -np 1 .device/bin/taskbench -steps 500 -width 128 -type $ty -gpu 2>&1 | tee "$out/gpu-rate-$ty.log" | grep -E 'Elapsed|Total Tasks|tasks/s'
    done
    ;;&
  ahead|all)
    # Launch-ahead (FERRY_LAUNCH_AHEAD) against waiting for completion, interleaved: the 4096²
    # stencil (plain and --overlap) on one GPU, two ranks and one rank with two GPUs, the
    # empty-GPU-task rate, Cholesky, and a Cholesky checked against its reference.
    for rep in ${AHEAD_REPS:-1 2}; do
      for la in off on; do
        echo "--- launch-ahead $la, rep $rep"
        S=".device/bin/stencil --devices cuda --n 4096 --nb 2048 --iters 1000 --warmup 5 -q"
        for ov in "" --overlap; do
          a=$(CUDA_VISIBLE_DEVICES=0 FERRY_LAUNCH_AHEAD=$la gpurun -np 1 $S $ov | awk '/^seconds|^checksum/{printf "%s ", $2}')
          b=$(FERRY_LAUNCH_AHEAD=$la gpurun -np 2 $S $ov | awk '/^seconds|^checksum/{printf "%s ", $2}')
          c=$(FERRY_LAUNCH_AHEAD=$la gpurun -np 1 $S $ov | awk '/^seconds|^checksum/{printf "%s ", $2}')
          echo "stencil 4096 ov=${ov:-no}: 1gpu $a| 2rank $b| 1rank2gpu $c"
        done
        for ty in trivial stencil_1d; do
          CUDA_VISIBLE_DEVICES=0 FERRY_DEVICES=cuda FERRY_LAUNCH_AHEAD=$la gpurun -np 1 .device/bin/taskbench -steps 500 -width 128 -type $ty -gpu 2>&1 | awk -v t=$ty '/Elapsed/{printf "gpu tasks/s %s %.0f\n", t, 64000/$3}'
        done
        c1=$(CUDA_VISIBLE_DEVICES=0 FERRY_LAUNCH_AHEAD=$la gpurun -np 1 .device/bin/cholesky --devices cuda --n 32768 --nb 2048 --check none -q | awk '/^GFLOP/{print $2}')
        c2=$(FERRY_LAUNCH_AHEAD=$la gpurun -np 1 .device/bin/cholesky --devices cuda --n 32768 --nb 2048 --check none -q | awk '/^GFLOP/{print $2}')
        echo "cholesky 32768 GFLOP/s: 1gpu $c1 | 1rank2gpu $c2"
        FERRY_GPU_DIRECT=force FERRY_LAUNCH_AHEAD=$la gpurun -np 2 .device/bin/transfer --devices cuda --paths ipc --sizes 1M,4M --inflight 8 --volume 512M 2>&1 | grep -E '^ipc'
      done
    done
    run chol-8k-ahead one .device/bin/cholesky --devices cuda --n 8192 --nb 1024 --check exact
    run chol-8k-1rank2gpu-ahead gpurun -np 1 .device/bin/cholesky --devices cuda --n 8192 --nb 1024 --check exact
    run chol-8k-2rank-ahead gpurun -np 2 .device/bin/cholesky --devices cuda --n 8192 --nb 1024 --check exact
    ;;&
  batch|all)
    # Batched IPC pulls and cheaper insertion, against the binaries of the previous commit
    # bundled as `<name>-base` (skipped when absent), interleaved: IPC transfers, the 4096²
    # stencil (checksums too), the empty-GPU-task rates, Cholesky checked on two ranks over IPC.
    for rep in ${BATCH_REPS:-1 2}; do
      for v in "" -base; do
        [ -x .device/bin/transfer$v ] || continue
        echo "--- binaries ${v:-new}, rep $rep"
        FERRY_GPU_DIRECT=force gpurun -np 2 .device/bin/transfer$v --devices cuda --paths ipc --sizes 64K,1M,4M --inflight 8,16 --volume 512M 2>&1 | grep -E '^ipc|^driver call'
        S="--devices cuda --n 4096 --nb 2048 --iters 1000 --warmup 5 -q"
        for ov in "" --overlap; do
          a=$(CUDA_VISIBLE_DEVICES=0 gpurun -np 1 .device/bin/stencil$v $S $ov | awk '/^seconds|^checksum/{printf "%s ", $2}')
          b=$(gpurun -np 2 .device/bin/stencil$v $S $ov | awk '/^seconds|^checksum/{printf "%s ", $2}')
          c=$(gpurun -np 1 .device/bin/stencil$v $S $ov | awk '/^seconds|^checksum/{printf "%s ", $2}')
          echo "stencil 4096 ov=${ov:-no}: 1gpu $a| 2rank $b| 1rank2gpu $c"
        done
        for ty in trivial stencil_1d; do
          CUDA_VISIBLE_DEVICES=0 FERRY_DEVICES=cuda gpurun -np 1 .device/bin/taskbench$v -steps 2000 -width 128 -type $ty -gpu 2>&1 | awk -v t=$ty '/Total Tasks/{n=$3} /Elapsed/{printf "gpu tasks/s %s %.0f\n", t, n/$3}'
        done
      done
    done 2>&1 | tee "$out/batch-ab.log"
    run chol-8k-2rank-ipc via ipc -np 2 .device/bin/cholesky --devices cuda --n 8192 --nb 1024 --check exact
    run chol-32k-2rank-ipc via ipc -np 2 .device/bin/cholesky --devices cuda --n 32768 --nb 2048 --check none
    ;;&
  comm-in|all)
    # comm-in ahead on/off interleaved (same binaries): the 4096² stencil on 2 ranks, IPC
    # transfers; then the consumer's GPU-manager time by phase, and Cholesky checked over IPC
    # and the staged path (both launch consumers behind their comm-in copy).
    ab_halo FERRY_COMM_IN_AHEAD ahead "${COMM_IN_REPS:-1 2 3}" 2>&1 | tee "$out/comm-in-ab.log"
    FERRY_GPU_PHASES=on FERRY_GPU_DIRECT=force run transfer-phases gpurun -np 2 .device/bin/transfer --devices cuda --paths ipc --sizes 64K,1M,4M --inflight 8,16 --volume 512M
    grep -E '^consumer|^ipc' "$out/transfer-phases.log"
    run chol-8k-2rank-ipc via ipc -np 2 .device/bin/cholesky --devices cuda --n 8192 --nb 1024 --check exact
    run chol-8k-2rank-staged via staged -np 2 .device/bin/cholesky --devices cuda --n 8192 --nb 1024 --check exact
    ;;&
  offers|all)
    # Offers at launch on/off interleaved (same binaries): the 4096² stencil on 2 ranks, IPC
    # transfers, the 20480² stencil and Cholesky 32768 on 2 ranks; then correctness (checksums
    # and how many sends were offered, Cholesky checked over IPC) and a GPU timeline of each.
    ab_halo FERRY_OFFER_AT_LAUNCH offers "${OFFER_REPS:-1 2 3}" 2>&1 | tee "$out/offers-ab.log"
    for of in on off; do
      FERRY_OFFER_AT_LAUNCH=$of run "stencil-20k-2rank-$of" gpurun -np 2 .device/bin/stencil --devices cuda --n 20480 --nb 2048 --iters 1000 --warmup 5
      FERRY_OFFER_AT_LAUNCH=$of run "chol-32k-2rank-ipc-$of" via ipc -np 2 .device/bin/cholesky --devices cuda --n 32768 --nb 2048 --check none
    done
    for ov in "" --overlap; do
      FERRY_OFFER_AT_LAUNCH=on gpurun -np 2 .device/bin/stencil --devices cuda --n 4096 --nb 2048 --iters 1000 --warmup 5 -q $ov --json "$out/offers$ov.json" | grep -E '^seconds|^checksum'
      grep -o '"offered_at_launch": *[0-9]*\|"comm_in_ahead": *[0-9]*\|"renamed": *[0-9]*' "$out/offers$ov.json"
    done
    run chol-8k-2rank-ipc via ipc -np 2 .device/bin/cholesky --devices cuda --n 8192 --nb 1024 --check exact
    for of in on off; do
      FERRY_OFFER_AT_LAUNCH=$of FERRY_TRACE="$out/trace-$of" FERRY_TRACE_FILTER=ferry::gpu=info,ferry::clock=info \
        gpurun -np 2 .device/bin/stencil --devices cuda --n 4096 --nb 2048 --iters 200 --warmup 5 --overlap -q
    done
    ;;&
  copy-kernel|all)
    # Session 8: the copy kernel against the copy engines for IPC pulls (the transfer table, and
    # its anchors: copy-kernel pulls, signal round trips, driver-call costs), then the GPU task
    # rate and the 2-rank stencils — interleaved, same binaries.
    FERRY_GPU_DIRECT=force gpurun -np 2 .device/bin/transfer --devices cuda --paths ipc --sizes 64K,1M,4M --inflight 8 --volume 512M --json "$out/transfer-anchors.json" 2>&1 | grep -E '^ipc +[0-9]+[KM]|copy kernel|signal round|driver call|^peer'
    for rep in 1 2 3; do
      for v in 4M 0; do
        FERRY_SM_COPY_BYTES=$v FERRY_GPU_DIRECT=force gpurun -np 2 .device/bin/transfer --devices cuda --paths ipc --sizes 64K,1M,4M --inflight 8 --volume 512M 2>&1 | grep -E '^ipc +[0-9]+[KM]' | sed "s/^/rep $rep sm-copy=$v /"
        echo "rep $rep sm-copy=$v stencil 2 ranks: $(FERRY_SM_COPY_BYTES=$v gpurun -np 2 .device/bin/stencil --devices cuda --n 4096 --nb 2048 --iters 1000 --warmup 5 -q | awk '/^seconds|^checksum/{printf "%s ", $2}')"
      done
      for ty in trivial stencil_1d; do
        CUDA_VISIBLE_DEVICES=0 FERRY_DEVICES=cuda gpurun -np 1 .device/bin/taskbench -steps 2000 -width 128 -type $ty -gpu 2>&1 | awk -v t="rep $rep $ty" '/Total Tasks/{n=$3} /Elapsed/{printf "%s gpu tasks/s %.0f\n", t, n/$3}'
      done
    done
    FERRY_SM_COPY_BYTES=4M run chol-8k-2rank-ipc-copy-kernel via ipc -np 2 .device/bin/cholesky --devices cuda --n 8192 --nb 512 --check exact
    FERRY_SM_COPY_BYTES=0 run chol-8k-2rank-ipc-copy-engines via ipc -np 2 .device/bin/cholesky --devices cuda --n 8192 --nb 512 --check exact
    ;;&
  anchor|all)
    # Session 9: ferry's 2-rank row-slab stencil against the same kernels on the same two GPUs
    # with no runtime (ferry_kernels::stencil_pair: overlap as ferry, and concurrent interior and
    # ring, which ferry's tile dependencies cannot express yet), and the one-GPU run for the
    # parallel efficiency.
    for rep in 1 2 3; do
      for ov in "" --overlap; do
        FERRY_LAUNCH_AHEAD=on gpurun -np 2 .device/bin/stencil --devices cuda --n 4096 --iters 1000 --warmup 5 --mb 2048 --nb 4096 $ov --anchor -q | grep -E "^seconds|^anchor|^checksum" | sed "s/^/rep $rep ${ov:-plain} /"
      done
      echo "rep $rep 1gpu --overlap LA: $(CUDA_VISIBLE_DEVICES=0 FERRY_LAUNCH_AHEAD=on gpurun -np 1 .device/bin/stencil --devices cuda --n 4096 --iters 1000 --warmup 5 --mb 2048 --nb 4096 --overlap -q | awk '/^seconds/{print $2}')"
    done
    ;;&
  slab-trace)
    # Session 11's plan (no GPU was lent that session): where the 2-rank row-slab stencil loses
    # its last points of parallel efficiency. Traces of 300 steps with offers at launch on and
    # off, and the one-GPU run. Back here: `cargo xtask trace-gaps DIR --op step.interior` (and
    # `--op step.ring`) gives, per step, the gap between consecutive interiors and how late the
    # manager launched the next one; `cargo xtask trace-merge DIR` for the timeline itself.
    T="--devices cuda --n 4096 --iters 300 --warmup 5 --mb 2048 --nb 4096 --overlap -q"
    for offers in on off; do
      FERRY_LAUNCH_AHEAD=on FERRY_OFFER_AT_LAUNCH=$offers FERRY_TRACE="$out/trace-offers-$offers" gpurun -np 2 .device/bin/stencil $T | grep -E "^seconds|^checksum" | sed "s/^/traced offers=$offers /"
    done
    CUDA_VISIBLE_DEVICES=0 FERRY_LAUNCH_AHEAD=on FERRY_TRACE="$out/trace-1gpu" gpurun -np 1 .device/bin/stencil $T | grep -E "^seconds|^checksum" | sed "s/^/traced 1gpu /"
    ;;&
  body-panic)
    # A CUDA body that panics fails its task (TaskFailed naming the panic) instead of ending
    # the GPU manager's thread; the runtime shuts down (needs .device/bin/body_panic, the
    # ferry-tests binary). Not under `timeout`: gpurun is a shell function.
    for np in 1 2; do
      o=$(FERRY_DEVICES=cuda FERRY_ABORT_ON_ERROR=0 RUST_BACKTRACE=0 gpurun -np $np .device/bin/body_panic 2>&1)
      echo "body-panic np=$np rc=$? reported=$(echo "$o" | grep -c 'panicking body reported') of $np"
      echo "$o" | grep -m1 -o 'GPU body failed: .*'
    done
    ;;&
  one-gpu)
    # For a session lent a single GPU: both ranks on it. The staged path's legs (D2H, MPI host
    # to host, H2D) do not need a second GPU, so issue 4's "staged ≥ 80% of its slowest leg"
    # can be measured here against the mpi-host row of the same run; plus the one-GPU stencil
    # and the empty-GPU-task rate.
    # Chunks of 4 MiB (the default) against 16 MiB: the MPI leg moves whole tiles.
    for chunk in 4M 16M; do
      FERRY_BOUNCE_CHUNK=$chunk gpurun -np 2 .device/bin/transfer --devices cuda --paths staged,mpi-host --sizes 1M,4M,16M,64M --inflight 8 --volume 1G 2>&1 | grep -E "^(staged|mpi-host|path) " | sed "s/^/chunk $chunk /"
    done
    run stencil-1gpu one .device/bin/stencil --devices cuda --n 4096 --iters 1000 --warmup 5 --mb 2048 --nb 4096 --overlap -q
    one .device/bin/taskbench -steps 2000 -width 128 -type trivial -gpu 2>&1 | grep -E "GPU tasks"
    ;;&
  ipc-ab)
    # Session 13: IPC pulls by the copy kernel against the copy engines (FERRY_SM_COPY_BYTES),
    # interleaved, then the consumer's phases and the driver-call costs; two GPUs or the proxy.
    proxy_on
    T=".device/bin/transfer --devices cuda --paths ipc --sizes 1M,4M --inflight 8,16 --volume 1G"
    for rep in 1 2 3; do
      for sm in 0 4M; do
        (export FERRY_SM_COPY_BYTES=$sm; via auto -np 2 $T 2>&1) | grep -E '^ipc' | sed "s/^/rep $rep sm=$sm /"
      done
    done
    (export FERRY_GPU_PHASES=on; via auto -np 2 $T 2>&1) | grep -E '^(ipc|producer|consumer|driver call|peer-copy|sm pull)'
    proxy_off
    ;;&
  issue4)
    # Issue 4's open goals, on two GPUs (nvidia-h200-x2): IPC 1 MiB x 8 >= 150 GB/s and
    # 4 MiB x 8 >= 300, 256 MiB >= 0.9 of the peer copy; and two defaults measured on two GPUs:
    # the copy kernel for batches of pulls (FERRY_SM_COPY_BYTES, 4M since session 22) and, for
    # the stencil's halos, the control ring (off with --overlap). Three repetitions of copy engines / copy kernel,
    # a task per tile and per round, the order rotating (a base build bundled as
    # .device/bin/transfer-base is interleaved too); 256 MiB and 16 in flight with the
    # managers' phases; then the stencil 4096^2 on one GPU and on two ranks with the copy
    # kernel and the ring off/on (session 18's .device/s18x.sh; about 6 minutes).
    T="--devices cuda --paths ipc --sizes 1M,4M --inflight 8 --volume 4G --tasks per-tile,per-round"
    bins="transfer"; [ -x .device/bin/transfer-base ] && bins="transfer-base transfer"
    for rep in 1 2 3; do
      [ $rep = 2 ] && bins=$(echo $bins | awk '{for (i = NF; i > 0; i--) printf "%s ", $i}')
      for sm in 4M 0; do
        for b in $bins; do
          (export FERRY_SM_COPY_BYTES=$sm; via auto -np 2 .device/bin/$b $T 2>&1) | grep -E '^(ipc|peer-copy)|rror|panic' | cut -c1-150 | sed "s/^/rep $rep sm=$sm $b /"
        done
      done
    done
    for sm in 4M 0; do
      (export FERRY_SM_COPY_BYTES=$sm FERRY_GPU_PHASES=on; via auto -np 2 .device/bin/transfer --devices cuda --paths ipc --sizes 1M,4M,256M --inflight 8,16 --volume 4G --tasks per-tile,per-round 2>&1) | grep -E '^(ipc|peer-copy|producer|consumer|sm pull)|rror|panic' | cut -c1-150 | sed "s/^/phases sm=$sm /"
    done
    S=".device/bin/stencil --devices cuda --n 4096 --iters 1000 --warmup 5 --mb 2048 --nb 4096 --overlap -q"
    secs() { awk '/^seconds|^checksum/{printf "%s ", $2}'; }
    for rep in 1 2 3 4; do
      echo "stencil rep $rep 1gpu: $(one $S 2>&1 | secs)"
      for v in "0 off" "4M off" "0 on" "4M on"; do
        set -- $v
        echo "stencil rep $rep 2rank sm=$1 ring=$2: $(FERRY_SM_COPY_BYTES=$1 FERRY_CONTROL_RING=$2 gpurun -np 2 $S 2>&1 | secs)"
      done
    done
    ;;&
  settings)
    # Session 20: which runtime settings move IPC 1M/4M x 8 (defaults, launch-ahead, offers at
    # launch off, comm-in ahead off, two exec streams, launch-ahead with offers or comm-in ahead
    # off), a task per tile and per round, three repetitions with the order rotating; then the
    # 20480^2 stencil on one GPU and two ranks. Two GPUs (nvidia-h200-x2); about 5 minutes.
    T=".device/bin/transfer --devices cuda --paths ipc --sizes 1M,4M --inflight 8 --volume 4G --tasks per-tile,per-round"
    cfgs=("default::" "ahead:FERRY_LAUNCH_AHEAD=on:" "no-offers:FERRY_OFFER_AT_LAUNCH=off:" "no-comm-in-ahead:FERRY_COMM_IN_AHEAD=off:"
      "exec2:FERRY_EXEC_STREAMS=2:" "ahead+no-offers:FERRY_LAUNCH_AHEAD=on:FERRY_OFFER_AT_LAUNCH=off" "ahead+no-cia:FERRY_LAUNCH_AHEAD=on:FERRY_COMM_IN_AHEAD=off")
    for rep in 1 2 3; do
      n=${#cfgs[@]}
      for i in $(seq 0 $((n - 1))); do
        IFS=: read -r name v1 v2 <<< "${cfgs[$(( (i + rep - 1) % n ))]}"
        ( [ -n "$v1" ] && export "$v1"; [ -n "$v2" ] && export "$v2"; FERRY_GPU_DIRECT=force gpurun -np 2 $T 2>&1 ) \
          | grep -E '^ipc|rror|panic' | cut -c1-100 | sed "s/^/rep $rep $name /"
      done
    done 2>&1 | tee "$out/settings.log"
    secs() { awk '/^seconds|^checksum/{printf "%s ", $2}'; }
    S=".device/bin/stencil --devices cuda --n 20480 --nb 2048 --iters 1000 --warmup 5 -q"
    for rep in 1 2; do
      echo "stencil 20480 rep $rep: 1gpu $(one $S 2>&1 | secs)| 2rank $(gpurun -np 2 $S 2>&1 | secs)"
    done
    ;;&
  proxy-ab)
    # Session 14: a change against a base build, interleaved (bundle the base's `transfer` and
    # `taskbench` as transfer-base and taskbench-base): the IPC route (two GPUs or the proxy)
    # with copy engines and the copy kernel, then empty GPU tasks per second on one GPU. Pairs
    # alternate their order.
    for b in transfer-base taskbench-base; do
      [ -x ".device/bin/$b" ] || { echo "proxy-ab: .device/bin/$b missing (bundle the base build)"; exit 2; }
    done
    proxy_on
    T="--devices cuda --paths ipc --sizes 1M,4M --inflight 8,16 --volume 1G"
    for rep in 1 2 3; do
      order="base new"; [ $((rep % 2)) = 0 ] && order="new base"
      for v in $order; do
        suffix=""; [ "$v" = base ] && suffix=-base
        for sm in 0 4M; do
          (export FERRY_SM_COPY_BYTES=$sm; via auto -np 2 ".device/bin/transfer$suffix" $T 2>&1) | grep -E '^ipc' | sed "s/^/rep $rep $v sm=$sm /"
        done
      done
    done
    proxy_off
    for rep in 1 2 3 4 5 6; do
      order="base new"; [ $((rep % 2)) = 0 ] && order="new base"
      for v in $order; do
        suffix=""; [ "$v" = base ] && suffix=-base
        for ty in trivial stencil_1d; do
          (export FERRY_DEVICES=cuda; one ".device/bin/taskbench$suffix" -steps 2000 -width 128 -type $ty -gpu 2>&1) | grep -E "GPU tasks" | sed "s/^/rep $rep $v $ty /"
        done
      done
    done
    ;;&
  shared-gpu)
    # Session 12: ranks sharing one GPU (more ranks than GPUs). Launch-ahead with and without MPS
    # (no offers at launch between such ranks; the start-up warning without MPS), and issue 4's
    # application sizes over the IPC route within the GPU.
    S=".device/bin/stencil --devices cuda --n 4096 --iters 200 --warmup 5 --mb 2048 --nb 4096 -q --overlap"
    shared() {
      local tag=$1 la
      echo "$tag 1 rank: $(one $S 2>&1 | grep -E '^seconds')"
      for la in on off; do
        echo "$tag 2 ranks launch-ahead=$la: $(FERRY_LAUNCH_AHEAD=$la FERRY_LOG=warn gpurun -np 2 $S 2>&1 | grep -E '^seconds|WARN' | tr '\n' ' ')"
      done
      run "chol-32k-shared-$tag" gpurun -np 2 .device/bin/cholesky --devices cuda --n 32768 --nb 2048 --check none
      run "stencil-20480-shared-$tag" gpurun -np 2 .device/bin/stencil --devices cuda --n 20480 --nb 2048 --iters 1000 --warmup 5
    }
    CUDA_VISIBLE_DEVICES=0 shared no-mps
    if mps_on; then
      CUDA_VISIBLE_DEVICES=0 shared mps
      mps_off
    fi
    ;;&
  copy-kernel-ab)
    # Session 22 (calls D and E): the copy kernel for batches (FERRY_SM_COPY_BYTES=4M, the
    # default) against the copy engines (0), interleaved, on what it could move: IPC 1M/4M x 8
    # per tile and per round, the slab stencil and the 2x2 stencil on two ranks, Cholesky 8192
    # nb 512 over IPC (about 3 minutes).
    export FERRY_GPU_DIRECT=force
    T="--devices cuda --paths ipc --sizes 1M,4M --inflight 8 --volume 2G --tasks per-tile,per-round"
    S=".device/bin/stencil --devices cuda --n 4096 --iters 1000 --warmup 5"
    secs() { awk '/^seconds|^checksum/{printf "%s ", $2}'; }
    for rep in 1 2; do
      for sm in 0 4M; do
        (export FERRY_SM_COPY_BYTES=$sm; gpurun -np 2 .device/bin/transfer $T 2>&1) | grep -E '^ipc +[0-9]+[KM]' | awk -v p="rep $rep sm=$sm" '{print p, $2, $3, $(NF-1), $5, $6}'
      done
    done
    echo "1gpu slabs: $(CUDA_VISIBLE_DEVICES=0 gpurun -np 1 $S --mb 2048 --nb 4096 --overlap -q | secs)"
    for rep in 1 2 3; do
      for sm in 0 4M; do
        echo "rep $rep sm=$sm slabs-overlap 2rank: $(export FERRY_SM_COPY_BYTES=$sm; gpurun -np 2 $S --mb 2048 --nb 4096 --overlap -q | secs)"
        echo "rep $rep sm=$sm 2x2-tiles 2rank: $(export FERRY_SM_COPY_BYTES=$sm; gpurun -np 2 $S --nb 2048 -q | secs)"
      done
    done
    for sm in 0 4M; do
      (export FERRY_SM_COPY_BYTES=$sm FERRY_TRANSFER_PATH=ipc; gpurun -np 2 .device/bin/cholesky --devices cuda --n 8192 --nb 512 --check exact 2>&1) | grep -E '^(seconds|residual )|error|panick' | sed "s/^/sm=$sm chol8k-nb512 /"
    done
    ;;
  device-ack-ab)
    # Session 23: device acknowledgements of IPC sends (FERRY_DEVICE_ACK, off by default)
    # against host acknowledgements, interleaved: IPC 1M/4M x 8 per round and per tile (the
    # last column: stamps that waited on the device / acknowledgements written behind and after
    # pulls); the slab stencil on two ranks, and the 2x2-tile stencil with renaming off (whose
    # edges are sent and then overwritten: acknowledged on the device); Cholesky 8192 exact over
    # IPC. Then a traced per-round run for ci/trace-cycle.py (the clock anchors too).
    # Offers at launch off on both sides: a send offered at launch never asks for a device
    # acknowledgement (architecture.md, "Device acknowledgements").
    export FERRY_GPU_DIRECT=force FERRY_OFFER_AT_LAUNCH=off
    T="--devices cuda --paths ipc --sizes 1M,4M --inflight 8 --volume 2G --tasks per-tile,per-round --check-sinks"
    S=".device/bin/stencil --devices cuda --n 4096 --iters 1000 --warmup 5"
    secs() { awk '/^seconds|^checksum/{printf "%s ", $2}'; }
    acked() { grep -o '"acked_on_device": *[0-9]*' "$1" | head -1; }
    # The check has teeth: stamps that skip their wait race the pulls (the sinks count it).
    (export FERRY_FAULTS=skip-ack-wait:1 FERRY_DEVICE_ACK=on; gpurun -np 2 .device/bin/transfer --devices cuda --paths ipc --sizes 1M --inflight 8 --volume 1G --tasks per-round --check-sinks 2>&1) | grep -E '^ipc +[0-9]+[KM]|another stamp' | head -2 | sed 's/^/skip-ack-wait: /'
    for rep in 1 2 3; do
      for a in on off; do
        (export FERRY_DEVICE_ACK=$a; gpurun -np 2 .device/bin/transfer $T 2>&1) | grep -E '^ipc +[0-9]+[KM]' | awk -v p="rep $rep ack=$a" '{print p, $2, $3, $(NF-2), $5, $(NF-1)}'
      done
    done
    for rep in 1 2; do
      for a in on off; do
        echo "rep $rep ack=$a slabs-overlap 2rank: $(export FERRY_DEVICE_ACK=$a; gpurun -np 2 $S --mb 2048 --nb 4096 --overlap -q --json $out/s.json | secs) $(acked $out/s.json)"
        echo "rep $rep ack=$a 2x2 norename 2rank: $(export FERRY_DEVICE_ACK=$a FERRY_RENAME_SENT=off; gpurun -np 2 $S --nb 2048 -q --json $out/s.json | secs) $(acked $out/s.json)"
      done
    done
    echo "1gpu 2x2: $(CUDA_VISIBLE_DEVICES=0 gpurun -np 1 $S --nb 2048 -q | secs)"
    for a in on off; do
      (export FERRY_DEVICE_ACK=$a FERRY_TRANSFER_PATH=ipc; gpurun -np 2 .device/bin/cholesky --devices cuda --n 8192 --nb 512 --check exact 2>&1) | grep -E '^(seconds|residual )|error|panick' | sed "s/^/ack=$a chol8k-nb512 /"
    done
    mkdir -p "$out/tr"
    (export FERRY_TRACE=$out/tr; gpurun -np 2 .device/bin/transfer --devices cuda --paths ipc --sizes 1M --inflight 8 --volume 256M --max-rounds 100 --tasks per-round 2>&1) | grep -E '^ipc +[0-9]+[KM]'
    ;;
  cycle-trace)
    # Session 22 (calls H-J): a traced IPC 1 MiB x 8 run with one task per round, for
    # ci/trace-cycle.py after `cargo xtask trace-merge $OUT/tr` (every span; add
    # FERRY_TRACE_FILTER='ferry::gpu=info,ferry::clock=info' for device spans only).
    mkdir -p "$out/tr"
    (export FERRY_TRACE=$out/tr FERRY_GPU_DIRECT=force; gpurun -np 2 .device/bin/transfer --devices cuda --paths ipc --sizes 1M --inflight 8 --volume 256M --max-rounds 100 --tasks per-round 2>&1) | grep -E '^ipc +[0-9]+[KM]'
    ;;
  checkpoint|all)
    # Issue 7: an 8 GiB device-resident field (32768², tiles of 4096²) with Philox states,
    # checkpointed through the 64 MiB bounce pool, against the disk's write rate measured here;
    # then the restart from that checkpoint must end bit-identical to the uninterrupted run.
    dd if=/dev/zero of=/tmp/ddtest bs=64M count=128 conv=fdatasync 2>&1 | tail -1; rm -f /tmp/ddtest
    A="--devices cuda --n 32768 --nb 4096 --iters 20 --noise 0.01"
    run ckpt-plain one .device/bin/stencil $A --json "$out/ckpt-plain.json"
    run ckpt-write one .device/bin/stencil $A --checkpoint-every 10 --checkpoint-dir /tmp/ferry-ck --json "$out/ckpt-write.json"
    run ckpt-restart one .device/bin/stencil $A --restart /tmp/ferry-ck/step-10 --json "$out/ckpt-restart.json"
    ;;
esac
# The device tool returns a limited number of files: one archive of everything.
if [ -n "${OUT:-}" ]; then tar czf "$OUT/../ferry-gpu-$$.tgz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "$OUT/../ferry-gpu-$$.tgz" "$OUT/all.tgz"; fi
