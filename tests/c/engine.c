/* The communication engine from C (ferry_engine_*), on 2–4 ranks: gets and puts around the
 * ring with notifications, active messages, tagged send/receive, messages of unregistered memory
 * on both lanes, the outcome agreement, counters, and the documented
 * status codes for bad input, a stale remote handle and calls after finalize; placed gets onto
 * device 0 (an emulated device, or with --cuda a GPU: the placement arena, a group, a placer over
 * the program's own pool from ferry_engine_alloc_device), read back with ferry_engine_device_read.
 * A poller of the program's own runs in the progress loop, starts an active message from a pass
 * and is closed exactly once. Clocks are measured against rank 0's (ferry_engine_sync_clocks), and
 * the loop is shared after start-up (ferry_engine_share_progress). With --driven, progress is
 * driven by this program's ferry_engine_progress calls instead of the engine's thread. Prints
 * "engine_c ok" on success, exits non-zero otherwise. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include <ferry.h>
#include <mpi.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(call)                                                                               \
    do {                                                                                          \
        ferry_status s_ = (call);                                                                 \
        if (s_ != FERRY_OK) {                                                                     \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,                   \
                    ferry_status_name(s_), ferry_last_error());                                   \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

#define EXPECT(call, want)                                                                        \
    do {                                                                                          \
        ferry_status s_ = (call);                                                                 \
        if (s_ != (want)) {                                                                       \
            fprintf(stderr, "%s:%d: %s -> %s, expected %s (%s)\n", __FILE__, __LINE__, #call,     \
                    ferry_status_name(s_), ferry_status_name(want), ferry_last_error());          \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

#define ASSERT(cond, ...)                                                                         \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                                       \
            fprintf(stderr, __VA_ARGS__);                                                         \
            fprintf(stderr, "\n");                                                                \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

enum { LEN = 100000, TAG_AM = 3, TAG_GOT = 4, TAG_PUT = 5, TAG_POLL = 6 };

static atomic_int completions, failures, ams, got_notes, put_notes;
static atomic_int last_status;

static void on_done(ferry_status s, void *user) {
    (void)user;
    if (s != FERRY_OK) {
        atomic_store(&last_status, (int)s);
        atomic_fetch_add(&failures, 1);
    }
    atomic_fetch_add(&completions, 1);
}

static void on_am(uint16_t tag, int32_t source, const void *data, size_t len, void *user) {
    int expect_source = *(int *)user;
    if (tag == TAG_AM && source == expect_source && len == sizeof(int) && *(const int *)data == source * 10)
        atomic_fetch_add(&ams, 1);
}

static void on_note(uint16_t tag, int32_t source, const void *data, size_t len, void *user) {
    (void)source;
    (void)data;
    (void)user;
    if (tag == TAG_GOT && len == 1)
        atomic_fetch_add(&got_notes, 1);
    if (tag == TAG_PUT && len == 2)
        atomic_fetch_add(&put_notes, 1);
}

static atomic_ullong placed_id;
static atomic_int placed_status = -1;

static void on_placed(ferry_status s, ferry_placed p, void *user) {
    (void)user;
    atomic_store(&placed_id, p.id);
    atomic_store(&placed_status, (int)s);
}

/* A group's placements (two), stored for the main thread. */
static atomic_ullong group_ids[2];
static atomic_int group_status = -1;

static void on_group(ferry_status s, const ferry_placed *p, size_t n, void *user) {
    (void)user;
    for (size_t i = 0; i < n && i < 2; i++)
        atomic_store(&group_ids[i], p[i].id);
    atomic_store(&group_status, s == FERRY_OK && n != 2 ? FERRY_ERR_INTERNAL : (int)s);
}

/* A framework's device pool of two slots for the placer: where it places, and what it got back. */
static uint64_t pool_base;
static size_t pool_slot;
static int pool_used[2], pool_placed, pool_released;

static int place_in_pool(uint32_t device, size_t count, const size_t *lens, uint64_t *out, void *user) {
    (void)user;
    size_t free_slots = 0;
    for (int i = 0; i < 2; i++)
        free_slots += !pool_used[i];
    if (device != 0 || count > free_slots)
        return 0;
    for (size_t k = 0, i = 0; k < count; k++) {
        if (lens[k] > pool_slot)
            return 0; /* (a real pool would give back what it took) */
        while (pool_used[i])
            i++;
        pool_used[i] = 1;
        out[k] = pool_base + i * pool_slot;
        pool_placed++;
    }
    return 1;
}

static void release_to_pool(uint32_t device, uint64_t addr, size_t len, void *user) {
    (void)device, (void)len, (void)user;
    pool_used[(addr - pool_base) / pool_slot] = 0;
    pool_released++;
}

/* The program's poller: counts its polls; once armed, sends an active message from inside the
 * pass. Its close counts into the atomic_int its user pointer names. */
static atomic_int polls, poll_armed, poll_sent, poll_tried, poll_ams, poll_closes, refused_closes;
static ferry_engine poll_engine;
static int poll_to;

static uint32_t poller(void *user) {
    (void)user;
    atomic_fetch_add(&polls, 1);
    if (!atomic_exchange(&poll_armed, 0))
        return 0;
    int64_t v = 4242;
    ferry_status st = ferry_engine_send_am(poll_engine, TAG_POLL, poll_to, &v, sizeof v);
    if (st == FERRY_OK)
        atomic_fetch_add(&poll_sent, 1);
    else
        fprintf(stderr, "poller: send_am -> %s: %s\n", ferry_status_name(st), ferry_last_error());
    atomic_fetch_add(&poll_tried, 1);
    return FERRY_POLL_WORKED;
}

static void poller_close(void *user) { atomic_fetch_add((atomic_int *)user, 1); }

static void on_poll_am(uint16_t tag, int32_t source, const void *data, size_t len, void *user) {
    (void)tag;
    (void)source;
    (void)user;
    int64_t v = 0;
    if (len == sizeof v)
        memcpy(&v, data, sizeof v);
    if (v == 4242)
        atomic_fetch_add(&poll_ams, 1);
}

static void wait_for(ferry_engine e, atomic_int *c, int n) {
    while (atomic_load(c) < n)
        CHECK(ferry_engine_progress(e, NULL));
}

/* A clock of this test's own: the monotonic clock, µs, plus a second per rank. */
static int clock_rank;
static double shifted_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3 + clock_rank * 1e6;
}

static double absd(double x) { return x < 0 ? -x : x; }

static unsigned char pattern(int rank, size_t i) { return (unsigned char)(i * 7 + (size_t)rank * 31); }

/* Device memory is read through the engine (a GPU's cannot be dereferenced here): the `len` bytes
 * at `addr` on device 0 must be rank `rank`'s pattern from byte `from` on. */
static void expect_device_bytes(ferry_engine e, uint64_t addr, size_t len, int rank, size_t from, const char *what) {
    unsigned char *back = malloc(len);
    CHECK(ferry_engine_device_read(e, 0, back, (const void *)(uintptr_t)addr, len));
    for (size_t i = 0; i < len; i++)
        ASSERT(back[i] == pattern(rank, from + i), "%s: byte %zu", what, i);
    free(back);
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    int driven = 0, cuda = 0, no_cma = 0;
    for (int a = 1; a < argc; a++) {
        if (strcmp(argv[a], "--driven") == 0)
            driven = 1;
        else if (strcmp(argv[a], "--cuda") == 0)
            cuda = 1;
        else if (strcmp(argv[a], "--no-cma") == 0)
            no_cma = 1;
        else
            ASSERT(0, "unknown argument %s (expected --driven, --cuda, --no-cma)", argv[a]);
    }
    MPI_Comm world = MPI_COMM_WORLD;
    /* Designated: the fields left out (the backstop, the rings, the single-copy threshold) are 0,
     * their defaults. */
    ferry_engine_options opts = {.progress = driven ? FERRY_PROGRESS_CALLER : FERRY_PROGRESS_THREAD,
                                 .completions = FERRY_COMPLETIONS_INLINE,
                                 .progress_sleep_us = -1,
                                 .devices = cuda ? FERRY_ENGINE_DEVICES_CUDA : 2 /* emulated */,
                                 .gpu_direct = FERRY_GPU_DIRECT_AUTO,
                                 .ipc = 1,
                                 .no_cma = no_cma,
                                 .share_later = !driven};
    ferry_engine e;
    CHECK(ferry_engine_init(&world, &opts, &e));
    int rank, size;
    CHECK(ferry_engine_rank(e, &rank, &size));
    int next = (rank + 1) % size, prev = (rank + size - 1) % size;

    ferry_engine_caps caps;
    CHECK(ferry_engine_capabilities(e, &caps));
    ASSERT(caps.am_max_payload >= 1024 && caps.am_user_tags > TAG_PUT, "capabilities");
    ferry_peer_caps pc;
    CHECK(ferry_engine_peer(e, next, &pc));
    ASSERT(pc.same_node == 1 && (pc.routes & 1), "peer %d: same node %d routes %u", next, pc.same_node, pc.routes);

    unsigned char *src = malloc(LEN), *dst = calloc(LEN, 1), *inbox = calloc(LEN, 1), *ring = calloc(LEN, 1);
    for (size_t i = 0; i < LEN; i++)
        src[i] = pattern(rank, i);
    ferry_mem_handle mine[4];
    CHECK(ferry_engine_register(e, src, LEN, &mine[0]));
    CHECK(ferry_engine_register(e, dst, LEN, &mine[1]));
    CHECK(ferry_engine_register(e, inbox, LEN, &mine[2]));
    CHECK(ferry_engine_register(e, ring, LEN, &mine[3]));
    ferry_mem_handle *all = malloc(sizeof(mine) * (size_t)size);
    CHECK(ferry_engine_allgather(e, mine, sizeof(mine), all));

    CHECK(ferry_engine_register_handler(e, TAG_AM, on_am, &prev));
    CHECK(ferry_engine_register_handler(e, TAG_GOT, on_note, NULL));
    CHECK(ferry_engine_register_handler(e, TAG_PUT, on_note, NULL));
    CHECK(ferry_engine_barrier(e));

    /* Active message, get with notification, put with notification, ring send/receive. */
    int payload = rank * 10;
    CHECK(ferry_engine_send_am(e, TAG_AM, next, &payload, sizeof payload));
    unsigned char one = 1, two[2] = {2, 2};
    CHECK(ferry_engine_get(e, &mine[1], 0, &all[next * 4 + 0], 0, LEN, TAG_GOT, &one, 1, on_done, NULL));
    CHECK(ferry_engine_put(e, &mine[0], 0, &all[prev * 4 + 2], 0, LEN, TAG_PUT, two, 2, on_done, NULL));
    CHECK(ferry_engine_recv(e, &mine[3], 0, LEN, prev, 7, on_done, NULL));
    CHECK(ferry_engine_send(e, &mine[0], 0, LEN, next, 7, on_done, NULL));
    wait_for(e, &completions, 4);
    wait_for(e, &ams, 1);
    CHECK(ferry_engine_barrier(e));
    wait_for(e, &got_notes, 1);
    wait_for(e, &put_notes, 1);
    ASSERT(atomic_load(&failures) == 0, "%d operations failed", atomic_load(&failures));
    for (size_t i = 0; i < LEN; i++) {
        ASSERT(dst[i] == pattern(next, i), "get: byte %zu", i);
        ASSERT(inbox[i] == pattern(next, i), "put: byte %zu", i);
        ASSERT(ring[i] == pattern(prev, i), "recv: byte %zu", i);
    }
    ferry_engine_counters st;
    CHECK(ferry_engine_stats(e, &st));
    ASSERT(st.gets == 1 && st.puts == 1 && st.sends == 1 && st.recvs == 1 && st.bytes_got == LEN &&
               st.bytes_put == LEN && st.am_received == 2 && st.notifications == 1 && st.registrations == 4,
           "stats: gets %llu puts %llu am_received %llu", (unsigned long long)st.gets, (unsigned long long)st.puts,
           (unsigned long long)st.am_received);
    /* Host memory of node peers: the get and the put as single copies exactly when the route is
     * offered (bit 4), never with --no-cma. */
    ferry_peer_caps to_prev;
    CHECK(ferry_engine_peer(e, prev, &to_prev));
    unsigned single = (pc.routes >> 4) & 1u;
    ASSERT(!(no_cma && single), "single copies offered with --no-cma (routes %u)", pc.routes);
    ASSERT(single == ((to_prev.routes >> 4) & 1) && st.single_copies == (uint64_t)(2 * single),
           "single copies: %llu (routes %u)", (unsigned long long)st.single_copies, pc.routes);

    /* Bad input: each refused with its status, nothing started. */
    EXPECT(ferry_engine_get(e, &mine[1], 0, &all[next * 4 + 0], 1, LEN, -1, NULL, 0, on_done, NULL),
           FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_engine_get(e, &all[next * 4 + 1], 0, &all[next * 4 + 0], 0, 8, -1, NULL, 0, on_done, NULL),
           size > 1 ? FERRY_ERR_INVALID_HANDLE : FERRY_OK);
    ferry_mem_handle bad = mine[0];
    bad.bytes[0] ^= 0xff;
    EXPECT(ferry_engine_unregister(e, &bad), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_engine_register(e, NULL, 8, &bad), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_engine_register_device(e, src, 8, 0, &bad), FERRY_ERR_INVALID_ARGUMENT); /* host memory */
    EXPECT(ferry_engine_register_device(e, src, 8, 7, &bad), FERRY_ERR_DEVICE);           /* no device 7 */
    /* A stream-ordered get needs a device destination. */
    EXPECT(ferry_engine_get_on_stream(e, &mine[1], 0, &all[next * 4 + 0], 0, 8, -1, NULL, 0, NULL, on_done, NULL),
           FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_engine_register_handler(e, 20000, on_note, NULL), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_engine_register_handler(e, TAG_AM, on_note, NULL), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_engine_register_handler(e, 9, NULL, NULL), FERRY_ERR_INVALID_ARGUMENT);
    char *big = calloc(caps.am_max_payload + 1, 1);
    EXPECT(ferry_engine_send_am(e, TAG_AM, next, big, caps.am_max_payload + 1), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_engine_send_am(e, TAG_AM, size + 5, &payload, sizeof payload), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_engine_send(e, &mine[0], 0, 8, next, 0xffffffffu, on_done, NULL), FERRY_ERR_INVALID_ARGUMENT);
    ferry_engine nobody = {987654};
    EXPECT(ferry_engine_barrier(nobody), FERRY_ERR_INVALID_HANDLE);
    wait_for(e, &completions, size > 1 ? 4 : 5);
    CHECK(ferry_engine_barrier(e));

    /* A placed get: new memory on device 0, registered, freed on release. */
    CHECK(ferry_engine_get_placed(e, 0, &all[next * 4 + 0], 0, LEN, -1, NULL, 0, on_placed, NULL));
    while (atomic_load(&placed_status) < 0)
        CHECK(ferry_engine_progress(e, NULL));
    ASSERT(atomic_load(&placed_status) == FERRY_OK, "placed get: %s", ferry_status_name(atomic_load(&placed_status)));
    ferry_placed placed = {atomic_load(&placed_id)};
    ferry_mem_handle ph;
    uint64_t paddr = 0;
    int32_t pdev = -2;
    CHECK(ferry_engine_placed_info(placed, &ph, &paddr, &pdev));
    ASSERT(pdev == 0 && paddr != 0, "placed on device %d", pdev);
    expect_device_bytes(e, paddr, LEN, next, 0, "placed");
    CHECK(ferry_engine_placed_release(placed));
    EXPECT(ferry_engine_placed_release(placed), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_engine_placed_info(placed, NULL, NULL, NULL), FERRY_ERR_INVALID_HANDLE);
    CHECK(ferry_engine_barrier(e));

    /* A task's two inputs placed together: the two halves of the peer's buffer, both on the
     * device (they fit), each with its bytes. */
    ferry_placed_request reqs[2] = {{all[next * 4 + 0], 0, LEN / 2, -1, NULL, 0},
                                    {all[next * 4 + 0], LEN / 2, LEN - LEN / 2, -1, NULL, 0}};
    CHECK(ferry_engine_get_placed_all(e, 0, reqs, 2, on_group, NULL));
    while (atomic_load(&group_status) < 0)
        CHECK(ferry_engine_progress(e, NULL));
    ASSERT(atomic_load(&group_status) == FERRY_OK, "group: %s", ferry_status_name(atomic_load(&group_status)));
    for (int g = 0; g < 2; g++) {
        ferry_placed gp = {atomic_load(&group_ids[g])};
        uint64_t ga = 0;
        int32_t gd = -2;
        CHECK(ferry_engine_placed_info(gp, NULL, &ga, &gd));
        ASSERT(gd == 0, "group part %d on device %d", g, gd);
        expect_device_bytes(e, ga, g ? LEN - LEN / 2 : LEN / 2, next, g ? LEN / 2 : 0, g ? "group part 1" : "group part 0");
        CHECK(ferry_engine_placed_release(gp));
    }
    EXPECT(ferry_engine_get_placed_all(e, 0, reqs, 0, on_group, NULL), FERRY_ERR_INVALID_ARGUMENT);

    /* The framework's own pool through a placer: the group lands in its two slots, and each
     * placement comes back to it once released. */
    void *pool = NULL;
    pool_slot = LEN;
    CHECK(ferry_engine_alloc_device(e, 0, 2 * pool_slot, &pool));
    pool_base = (uint64_t)(uintptr_t)pool;
    CHECK(ferry_engine_set_placer(e, place_in_pool, release_to_pool, NULL));
    atomic_store(&group_status, -1);
    CHECK(ferry_engine_get_placed_all(e, 0, reqs, 2, on_group, NULL));
    while (atomic_load(&group_status) < 0)
        CHECK(ferry_engine_progress(e, NULL));
    ASSERT(atomic_load(&group_status) == FERRY_OK, "placer group: %s", ferry_status_name(atomic_load(&group_status)));
    for (int g = 0; g < 2; g++) {
        ferry_placed gp = {atomic_load(&group_ids[g])};
        uint64_t ga = 0;
        CHECK(ferry_engine_placed_info(gp, NULL, &ga, NULL));
        ASSERT(ga >= pool_base && ga < pool_base + 2 * pool_slot, "placer group part %d outside the pool", g);
        expect_device_bytes(e, ga, g ? LEN - LEN / 2 : LEN / 2, next, g ? LEN / 2 : 0, g ? "placer part 1" : "placer part 0");
        CHECK(ferry_engine_placed_release(gp));
    }
    ASSERT(pool_placed == 2 && pool_released == 2, "placer: %d placed, %d released", pool_placed, pool_released);
    EXPECT(ferry_engine_set_placer(e, place_in_pool, NULL, NULL), FERRY_ERR_INVALID_ARGUMENT);
    CHECK(ferry_engine_set_placer(e, NULL, NULL, NULL));
    CHECK(ferry_engine_free_device(e, pool));
    reqs[1].offset = LEN; /* past the end of the peer's buffer: nothing starts */
    EXPECT(ferry_engine_get_placed_all(e, 0, reqs, 2, on_group, NULL), FERRY_ERR_INVALID_ARGUMENT);
    CHECK(ferry_engine_barrier(e));

    /* Device memory from the engine: written, read back, registered, freed once. */
    void *dmem = NULL;
    unsigned char *back = malloc(LEN);
    CHECK(ferry_engine_alloc_device(e, 0, LEN, &dmem));
    CHECK(ferry_engine_device_write(e, 0, dmem, src, LEN));
    CHECK(ferry_engine_device_read(e, 0, back, dmem, LEN));
    ASSERT(memcmp(back, src, LEN) == 0, "device memory: the bytes written are not read back");
    free(back);
    ferry_mem_handle dh;
    CHECK(ferry_engine_register_device(e, dmem, LEN, 0, &dh));
    CHECK(ferry_engine_unregister(e, &dh));
    CHECK(ferry_engine_free_device(e, dmem));
    EXPECT(ferry_engine_free_device(e, dmem), FERRY_ERR_INVALID_ARGUMENT); /* freed already */
    EXPECT(ferry_engine_free_device(e, src), FERRY_ERR_INVALID_ARGUMENT);  /* not the engine's */
    EXPECT(ferry_engine_alloc_device(e, 0, 0, &dmem), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_engine_alloc_device(e, 7, LEN, &dmem), FERRY_ERR_DEVICE); /* no device 7 */
    EXPECT(ferry_engine_alloc_device(e, 0, LEN, NULL), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_engine_device_write(e, 0, NULL, src, LEN), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_engine_alloc_device(nobody, 0, LEN, &dmem), FERRY_ERR_INVALID_HANDLE);

    /* A peer's device registration mapped here (its node's peers, ipc on): the next rank's bytes
     * read through the mapping; this rank's own registration held while the previous rank maps
     * it (FERRY_ERR_BUSY), free to end once unmapped. */
    {
        void *pmem = NULL;
        CHECK(ferry_engine_alloc_device(e, 0, LEN, &pmem));
        CHECK(ferry_engine_device_write(e, 0, pmem, src, LEN));
        ferry_mem_handle ph, peers[64];
        ASSERT(size <= 64, "%d ranks", size);
        CHECK(ferry_engine_register_device(e, pmem, LEN, 0, &ph));
        int yes = -1;
        CHECK(ferry_engine_exported(e, &ph, &yes));
        ASSERT(yes == 1, "a device registration with ipc on is not exported (%d)", yes);
        CHECK(ferry_engine_exported(e, &mine[0], &yes));
        ASSERT(yes == 0, "a host registration is exported");
        CHECK(ferry_engine_allgather(e, &ph, sizeof ph, peers));
        ferry_peer_mapping m;
        uint64_t maddr = 0;
        size_t mlen = 0;
        EXPECT(ferry_engine_map_peer(e, &ph, 0, &m, &maddr, &mlen), FERRY_ERR_INVALID_ARGUMENT); /* its own */
        EXPECT(ferry_engine_map_peer(e, &all[next * 4 + 0], 0, &m, &maddr, &mlen), FERRY_ERR_INVALID_ARGUMENT); /* host */
        EXPECT(ferry_engine_map_peer(e, &peers[next], 7, &m, &maddr, &mlen), FERRY_ERR_DEVICE); /* no device 7 */
        EXPECT(ferry_engine_map_peer(e, &peers[next], 0, NULL, &maddr, &mlen), FERRY_ERR_INVALID_ARGUMENT);
        CHECK(ferry_engine_map_peer(e, &peers[next], 0, &m, &maddr, &mlen));
        ASSERT(maddr != 0 && mlen == LEN, "mapping of %zu bytes at %llx", mlen, (unsigned long long)maddr);
        expect_device_bytes(e, maddr, LEN, next, 0, "peer mapping");
        CHECK(ferry_engine_barrier(e));
        EXPECT(ferry_engine_unregister(e, &ph), FERRY_ERR_BUSY);
        CHECK(ferry_engine_barrier(e));
        CHECK(ferry_engine_unmap_peer(m));
        EXPECT(ferry_engine_unmap_peer(m), FERRY_ERR_INVALID_HANDLE); /* unmapped already */
        CHECK(ferry_engine_barrier(e));
        CHECK(ferry_engine_unregister(e, &ph));
        CHECK(ferry_engine_free_device(e, pmem));
        CHECK(ferry_engine_barrier(e));
    }

    /* Messages of unregistered memory on both lanes with one tag: each lane gets its own bytes,
     * in order (the control lane's go first and must not match the data lane's receives, whose
     * length differs). */
    {
        enum { NB = 4, DLEN = 64, CLEN = 24 };
        static unsigned char out_d[NB][DLEN], out_c[NB][CLEN], in_d[NB][DLEN], in_c[NB][CLEN];
        int before = atomic_load(&completions);
        for (int k = 0; k < NB; k++) {
            CHECK(ferry_engine_recv_bytes(e, in_d[k], DLEN, prev, 11, FERRY_LANE_DATA, on_done, NULL));
            CHECK(ferry_engine_recv_bytes(e, in_c[k], CLEN, prev, 11, FERRY_LANE_CONTROL, on_done, NULL));
        }
        CHECK(ferry_engine_barrier(e));
        for (int k = 0; k < NB; k++) {
            memset(out_c[k], 100 + rank * 10 + k, CLEN);
            CHECK(ferry_engine_send_bytes(e, out_c[k], CLEN, next, 11, FERRY_LANE_CONTROL, on_done, NULL));
        }
        for (int k = 0; k < NB; k++) {
            memset(out_d[k], rank * 10 + k, DLEN);
            CHECK(ferry_engine_send_bytes(e, out_d[k], DLEN, next, 11, FERRY_LANE_DATA, on_done, NULL));
        }
        wait_for(e, &completions, before + 4 * NB);
        ASSERT(atomic_load(&failures) == 0, "%d messages failed", atomic_load(&failures));
        for (int k = 0; k < NB; k++) {
            ASSERT(in_d[k][0] == prev * 10 + k && in_d[k][DLEN - 1] == prev * 10 + k, "data message %d", k);
            ASSERT(in_c[k][0] == 100 + prev * 10 + k && in_c[k][CLEN - 1] == 100 + prev * 10 + k,
                   "control message %d", k);
        }
        EXPECT(ferry_engine_send_bytes(e, out_d[0], 8, next, 11, 7, on_done, NULL), FERRY_ERR_INVALID_ARGUMENT);
        EXPECT(ferry_engine_send_bytes(e, NULL, 8, next, 11, FERRY_LANE_DATA, on_done, NULL),
               FERRY_ERR_INVALID_ARGUMENT);
        EXPECT(ferry_engine_send_bytes(e, out_d[0], 8, size + 3, 11, FERRY_LANE_DATA, on_done, NULL),
               FERRY_ERR_INVALID_ARGUMENT);
        EXPECT(ferry_engine_recv_bytes(e, in_d[0], 8, next, -1, FERRY_LANE_DATA, on_done, NULL),
               FERRY_ERR_INVALID_ARGUMENT);
        EXPECT(ferry_engine_send_bytes(nobody, out_d[0], 8, next, 11, FERRY_LANE_DATA, on_done, NULL),
               FERRY_ERR_INVALID_HANDLE);
        ASSERT(atomic_load(&completions) == before + 4 * NB, "a refused message ran its callback");
    }

    /* A poller: it runs in the passes (here, inside ferry_engine_progress when driven), starts an
     * active message from one, and is closed only at finalize; a refused add closes at once. */
    {
        poll_engine = e;
        poll_to = next;
        CHECK(ferry_engine_register_handler(e, TAG_POLL, on_poll_am, NULL));
        CHECK(ferry_engine_add_poller(e, poller, poller_close, &poll_closes));
        EXPECT(ferry_engine_add_poller(e, NULL, poller_close, &refused_closes), FERRY_ERR_INVALID_ARGUMENT);
        EXPECT(ferry_engine_add_poller(nobody, poller, poller_close, &refused_closes), FERRY_ERR_INVALID_HANDLE);
        ASSERT(atomic_load(&refused_closes) == 2, "refused pollers closed %d times", atomic_load(&refused_closes));
        CHECK(ferry_engine_barrier(e));
        atomic_store(&poll_armed, 1);
        CHECK(ferry_engine_wake(e));
        wait_for(e, &poll_ams, 1);
        wait_for(e, &poll_tried, 1);
        ASSERT(atomic_load(&poll_sent) == 1 && atomic_load(&polls) >= 1, "poller: %d sent, %d polls",
               atomic_load(&poll_sent), atomic_load(&polls));
        EXPECT(ferry_engine_wake(nobody), FERRY_ERR_INVALID_HANDLE);
        CHECK(ferry_engine_barrier(e));
        ASSERT(atomic_load(&poll_closes) == 0 && atomic_load(&poll_ams) == 1, "poller closed early (%d), %d messages",
               atomic_load(&poll_closes), atomic_load(&poll_ams));
    }

    /* Agreement: the last rank fails, and every rank learns which and why; then all succeed. */
    {
        int gathered[64] = {0}, failed = -2, mine_v = rank * 3 + 1;
        const char *why = "disk full";
        ferry_status s = rank == size - 1 ? ferry_engine_agree(e, 0, why, strlen(why), gathered, &failed)
                                          : ferry_engine_agree(e, 1, &mine_v, sizeof mine_v, gathered, &failed);
        ASSERT(s == FERRY_ERR_REMOTE && failed == size - 1 && strstr(ferry_last_error(), why) != NULL,
               "agree with rank %d failing: %s, rank %d, \"%s\"", size - 1, ferry_status_name(s), failed,
               ferry_last_error());
        ASSERT(gathered[0] == 0, "a failed agreement wrote the payloads");
        CHECK(ferry_engine_agree(e, 1, &mine_v, sizeof mine_v, gathered, &failed));
        ASSERT(failed == -1, "agree: failed rank %d", failed);
        for (int r = 0; r < size; r++)
            ASSERT(gathered[r] == r * 3 + 1, "agree: rank %d gave %d", r, gathered[r]);
        EXPECT(ferry_engine_agree(e, 2, &mine_v, sizeof mine_v, gathered, &failed), FERRY_ERR_INVALID_ARGUMENT);
    }

    /* A stale remote handle: its owner unregistered it; the peer's get is refused there. */
    CHECK(ferry_engine_unregister(e, &mine[2]));
    EXPECT(ferry_engine_unregister(e, &mine[2]), FERRY_ERR_INVALID_HANDLE);
    CHECK(ferry_engine_barrier(e));
    int before = atomic_load(&completions);
    memset(dst, 0xab, LEN);
    CHECK(ferry_engine_get(e, &mine[1], 0, &all[next * 4 + 2], 0, 64, -1, NULL, 0, on_done, NULL));
    wait_for(e, &completions, before + 1);
    ASSERT(atomic_load(&last_status) == FERRY_ERR_REMOTE, "stale get: %s", ferry_status_name(atomic_load(&last_status)));
    ASSERT(dst[0] == 0xab && dst[63] == 0xab, "a refused get wrote the destination");
    CHECK(ferry_engine_barrier(e));

    /* Clocks: a clock of the test's own (the monotonic clock plus a second per rank) against rank
     * 0's, whose offset comes back within the round trip; the default clock (the monotonic one,
     * which the node's processes share) within it of rank 0's; a null output refused, on every
     * rank before anything is sent. */
    EXPECT(ferry_engine_sync_clocks(e, NULL, NULL), FERRY_ERR_INVALID_ARGUMENT);
    clock_rank = rank;
    ferry_clock_pair cp;
    CHECK(ferry_engine_sync_clocks(e, shifted_clock, &cp));
    if (rank == 0)
        ASSERT(cp.rtt_us == 0 && cp.local_us == cp.rank0_us, "rank 0's own pair: %f %f %f", cp.local_us, cp.rank0_us,
               cp.rtt_us);
    else
        ASSERT(cp.rtt_us > 0 && absd(cp.local_us - cp.rank0_us - rank * 1e6) <= cp.rtt_us + 100,
               "shifted clock: local %f, rank 0 %f, round trip %f", cp.local_us, cp.rank0_us, cp.rtt_us);
    CHECK(ferry_engine_sync_clocks(e, NULL, &cp));
    ASSERT(absd(cp.local_us - cp.rank0_us) <= cp.rtt_us + 100, "monotonic clock: local %f, rank 0 %f, round trip %f",
           cp.local_us, cp.rank0_us, cp.rtt_us);

    /* Sharing the loop after start-up: refused over a second of backstop, and where the caller
     * drives the loop; with the engine's thread (started with share_later), threads inside
     * ferry_engine_progress drive it from then on, active messages still go round, and a second
     * share changes nothing. */
    EXPECT(ferry_engine_share_progress(e, 2000000), FERRY_ERR_INVALID_ARGUMENT);
    if (driven) {
        EXPECT(ferry_engine_share_progress(e, 0), FERRY_ERR_INVALID_ARGUMENT);
    } else {
        CHECK(ferry_engine_share_progress(e, 1000));
        CHECK(ferry_engine_share_progress(e, 0));
        int seen = atomic_load(&ams);
        CHECK(ferry_engine_barrier(e)); /* every rank has read its count before any sends */
        CHECK(ferry_engine_send_am(e, TAG_AM, next, &payload, sizeof payload));
        wait_for(e, &ams, seen + 1);
    }
    CHECK(ferry_engine_barrier(e));

    for (int i = 0; i < 4; i++)
        if (i != 2)
            CHECK(ferry_engine_unregister(e, &mine[i]));
    CHECK(ferry_engine_finalize(e));
    ASSERT(atomic_load(&poll_closes) == 1, "the poller was closed %d times at finalize", atomic_load(&poll_closes));
    /* After finalize: the handle is dead, MPI is still the caller's. */
    EXPECT(ferry_engine_send_am(e, TAG_AM, next, &payload, sizeof payload), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_engine_finalize(e), FERRY_ERR_INVALID_HANDLE);
    int initialised = 0, finalized = 1;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalized);
    ASSERT(initialised && !finalized, "MPI state after finalize");
    MPI_Barrier(MPI_COMM_WORLD);
    free(src);
    free(dst);
    free(inbox);
    free(ring);
    free(all);
    free(big);
    printf("engine_c ok (%d ranks, %s, %s devices)\n", size, driven ? "driven" : "thread", cuda ? "CUDA" : "emulated");
    MPI_Finalize();
    return 0;
}
