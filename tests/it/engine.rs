//! The communication engine (`ferry-engine`) under `mpirun` on 2–4 ranks: gets and puts of 1 B
//! to 4 MiB with one and eight in flight land the right bytes and fire each completion and
//! notification once (a put's notification after its data); tagged sends and receives keep
//! their order; active messages keep their order per (source, tag) and wait for a handler that
//! comes late; four threads per rank start operations concurrently; every bad input is refused
//! with its error and loses nothing; callbacks run only in the caller's `progress` when asked;
//! the engine runs on a communicator the caller split, leaving MPI initialised; and the same
//! scenarios pass with progress driven by the program's calls instead of the engine's thread;
//! device memory (emulated devices) moves between host and device regions staged in chunks
//! through few bounce buffers, GPU-direct, or by peer copies through IPC between device memories
//! of one node, with the bytes counted on the route's path, and
//! device memory declared wrongly is refused; gets placed into new device memory fall back to
//! pinned host memory past the device budget, can be forwarded, and give their memory back;
//! messages of unregistered memory keep their order and lanes, and the collectives agree.
//!
//! The scenarios are in `tests/src/bin/engine_check.rs`; each rank asserts and exits non-zero on
//! the first failure.

mod common;

fn check(scenario: &str, ranks: &[usize]) {
    run(scenario, ranks, false);
}

/// As `check`, with progress driven by a thread of the program (`Progress::Caller`) instead
/// of the engine's own.
fn check_driven(scenario: &str, ranks: &[usize]) {
    run(scenario, ranks, true);
}

fn run(scenario: &str, ranks: &[usize], driven: bool) {
    run_with(scenario, ranks, driven, &[]);
}

fn run_with(scenario: &str, ranks: &[usize], driven: bool, extra: &[&str]) {
    for &np in ranks {
        let mut args = vec![scenario];
        if driven {
            args.push("--driven");
        }
        args.extend_from_slice(extra);
        let r = common::mpirun(np, &common::bin("engine_check"), &args, &[("RUST_BACKTRACE", "0")]);
        assert!(
            r.ok && r.stdout.matches(": ok").count() == np,
            "{scenario} {extra:?} on {np} ranks (driven: {driven}) failed\nstdout:\n{}\nstderr:\n{}",
            r.stdout,
            r.stderr
        );
    }
}

/// Bounce buffers that cannot be pinned refuse the staged operations that need them, on either
/// side, before any peer waits for a payload: none hangs, and host memory still moves.
#[test]
fn staged_operations_whose_bounce_buffers_cannot_be_pinned_are_refused() {
    check("pin-fail", &[2]);
    check_driven("pin-fail", &[2]);
}

/// Host memory between ranks of one node moves by single copies (Cross Memory Attach) where
/// the engine's probe found them allowed, every byte counted on that path on both ends; with
/// the route off, all of it over MPI.
#[test]
fn put_and_get_move_the_right_bytes_and_complete_once() {
    check("put-get", &[2, 3, 4]);
    run_with("put-get", &[2], false, &["--no-cma"]);
}

#[test]
fn two_sided_messages_keep_their_order_and_lengths_are_checked() {
    check("two-sided", &[2, 4]);
}

#[test]
fn active_messages_keep_their_order_and_wait_for_late_handlers() {
    // Through the node's rings (short ones in a slot, the rest through the byte rings, which
    // the long ones fill), and all over MPI: the same order, and the counts per transport.
    check("am-order", &[2, 3]);
    run_with("am-order", &[2], false, &["--no-rings"]);
    // Slots and the byte ring, the 20 and 60 KiB messages over MPI, in order with them.
    run_with("am-order", &[2], false, &["--am-ring-max", "16384"]);
    // No byte rings: the mid-sized messages in several slots, the long ones over MPI.
    run_with("am-order", &[2], false, &["--am-ring-max", "1080"]);
}

/// Messages of unregistered memory (what ferry's task runtime builds its transfers on) keep
/// their order per (peer, lane, tag) and their lanes apart; `agree`, clock synchronisation and
/// pollers work; with active messages off, their operations are refused, under every driver.
#[test]
fn messages_keep_order_and_lanes_and_collectives_agree() {
    check("messages", &[1, 2, 3]);
    run_with("messages", &[2], false, &["--no-am"]);
    run_with("messages", &[2], true, &["--no-am"]);
    run_with("messages", &[2], false, &["--shared"]);
}

/// Ranks that disagree on active messages fail at start, saying why, instead of hanging at the
/// first message. (Every rank refuses, but mpirun may kill the others once the first one exits,
/// before they have printed: one message is what can be relied on.)
#[test]
fn ranks_that_disagree_on_active_messages_refuse_to_start() {
    let r = common::mpirun(
        2,
        &common::bin("engine_check"),
        &["messages", "--no-am-on-rank0"],
        &[("RUST_BACKTRACE", "0")],
    );
    assert!(
        !r.ok && r.stderr.contains("active_messages differs between ranks"),
        "{}\n{}",
        r.stdout,
        r.stderr
    );
}

#[test]
fn concurrent_threads_start_operations() {
    check("threads", &[2, 4]);
}

#[test]
fn bad_input_is_refused_and_loses_nothing() {
    check("bad-input", &[2, 3]);
}

#[test]
fn callbacks_run_in_the_callers_progress_when_asked() {
    check("caller-progress", &[2]);
}

#[test]
fn the_engine_runs_on_a_callers_communicator() {
    check("caller-comm", &[2, 4]);
}

#[test]
fn a_stopped_caller_driven_loop_refuses_commands_at_their_post() {
    check("driver-end", &[2]);
}

#[test]
fn caller_driven_progress_moves_the_same_bytes() {
    check_driven("put-get", &[3]);
    check_driven("two-sided", &[2]);
}

#[test]
fn caller_driven_progress_keeps_message_order_and_refuses_bad_input() {
    check_driven("am-order", &[2]);
    check_driven("threads", &[2]);
    check_driven("bad-input", &[2]);
}

/// Shared progress (`Progress::Shared`): the engine's thread a backstop, the program's calls
/// driving the loop. With no thread of the program calling `progress`, the backstop and the
/// blocking collectives carry everything; with one (`--driven`), its passes do; and a thread
/// that posts runs a pass itself. The same bytes, orders and refusals either way.
#[test]
fn shared_progress_moves_the_same_bytes_keeps_order_and_refuses_bad_input() {
    for driven in [false, true] {
        for (scenario, np) in [
            ("put-get", 3),
            ("two-sided", 2),
            ("am-order", 2),
            ("threads", 2),
            ("bad-input", 2),
        ] {
            run_with(scenario, &[np], driven, &["--shared"]);
        }
    }
    run_with("device", &[2], false, &["--shared", "--ipc"]);
    // A backstop of 20 µs instead of 200 µs moves the same bytes.
    run_with("put-get", &[3], false, &["--shared", "--backstop-us", "20"]);
}

/// A backstop period out of range stops the start with an error that says so.
#[test]
fn shared_progress_refuses_a_backstop_out_of_range() {
    for us in ["0", "2000000"] {
        let args = ["put-get", "--shared", "--backstop-us", us];
        let r = common::mpirun(2, &common::bin("engine_check"), &args, &[("RUST_BACKTRACE", "0")]);
        assert!(
            !r.ok && r.stderr.contains(&format!("a backstop tick of {us} µs (1 µs to 1 s)")),
            "--backstop-us {us}\n{}\n{}",
            r.stdout,
            r.stderr
        );
    }
}

#[test]
fn device_memory_moves_staged_in_chunks_with_few_bounce_buffers() {
    // 64 KiB chunks and 2 bounce buffers per direction: a 1 MiB payload waits for buffers.
    run_with("device", &[2, 3], false, &["--gpu-direct", "off"]);
    run_with("device", &[2], true, &["--gpu-direct", "off"]);
}

#[test]
fn device_memory_moves_gpu_direct_when_mpi_takes_it() {
    // Emulated device memory is host memory, which any MPI takes: the GPU-direct protocol
    // (one message, device pointers handed to MPI) runs as on a CUDA-aware MPI.
    run_with("device", &[2, 3], false, &["--gpu-direct", "force"]);
}

#[test]
fn device_memory_of_one_node_moves_by_peer_copies_through_ipc() {
    // Emulated devices map each other's memory through shared memory, as CUDA IPC does.
    // Leases from the target's table (the default), then the grant protocol alone.
    run_with("device", &[2, 3], false, &["--ipc"]);
    run_with("device", &[2], true, &["--ipc", "--gpu-direct", "force"]);
    run_with("device", &[2], false, &["--ipc", "--no-leases"]);
}

/// Peers' allocations mapped for peer copies stay mapped while idle up to the bound, and close
/// past it (each copy then maps its allocation again, and still moves the right bytes): a
/// framework that allocates and frees device memory all along does not pile up mappings.
#[test]
fn idle_ipc_mappings_close_past_the_bound() {
    run_with("device", &[2], false, &["--ipc", "--keep-mappings", "0"]);
    run_with("device", &[3], false, &["--ipc", "--keep-mappings", "2"]);
    run_with("device", &[2], false, &["--ipc", "--no-leases", "--keep-mappings", "0"]);
}

#[test]
fn peers_map_device_registrations_of_their_node() {
    run_with("peer-map", &[2, 3], false, &["--ipc"]);
    run_with("peer-map", &[2], true, &["--ipc"]);
}

#[test]
fn stream_ordered_gets_complete_on_every_route() {
    // Emulated devices run no streams: this checks the calls, the bytes, the single completion
    // and the refusals on each route; ci/gpu-engine.sh checks the ordering itself on CUDA.
    run_with("stream", &[2], false, &["--ipc"]);
    run_with("stream", &[2], true, &["--ipc", "--no-leases"]);
    run_with("stream", &[2], false, &["--gpu-direct", "force"]);
    run_with("stream", &[2, 3], false, &[]);
}

#[test]
fn placed_gets_land_on_the_device_and_fall_back_to_host_memory() {
    // A device budget of 2.5 parts: the arena takes the budget, the third of three placed gets
    // lands in pinned host memory, and a group of all three goes to host memory whole.
    run_with("placed", &[2, 3], false, &["--budget", "256000"]);
    // Room for all: every placement a block of the arena; the group on the device.
    run_with("placed", &[2], true, &[]);
    // No arena: each placed get allocates its own device memory.
    run_with("placed", &[2], false, &["--arena", "0"]);
    // Peers read placed memory by peer copies: an arena block's export is the arena's at its
    // offset.
    run_with("placed", &[2, 3], false, &["--ipc"]);
    run_with("placed", &[2], true, &["--ipc", "--arena", "0"]);
}

#[test]
fn placed_gets_land_in_the_frameworks_pool_through_its_placer() {
    // The framework's placer evicts its cached data for room, places groups all or none, and
    // gets each placement back once; without it the engine places again.
    run_with("placer", &[2, 3], false, &[]);
    run_with("placer", &[2], true, &["--ipc"]);
}
