/* ferry's C ABI under misuse: every call with an invalid handle or argument returns the
 * documented status and a message, and nothing crashes. Prints "api_errors ok: N checks" on
 * success; exits non-zero naming the first failed check. Run as one rank: mpirun -np 1. */
#include <ferry.h>
#include <mpi.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int checks = 0;

#define EXPECT(call, want)                                                                   \
    do {                                                                                     \
        ferry_status got_ = (call);                                                          \
        checks++;                                                                            \
        if (got_ != (want)) {                                                                \
            fprintf(stderr, "api_errors: %s returned %s, expected %s (%s)\n", #call,         \
                    ferry_status_name(got_), ferry_status_name(want), ferry_last_error());   \
            return 1;                                                                        \
        }                                                                                    \
        if ((want) != FERRY_OK && ferry_last_error()[0] == '\0') {                           \
            fprintf(stderr, "api_errors: %s gave no message\n", #call);                      \
            return 1;                                                                        \
        }                                                                                    \
    } while (0)

static int ok_body(const ferry_task_ctx *ctx, void *user) {
    (void)ctx;
    (void)user;
    return 0;
}

static ferry_kernel launch_me;

static int failing_body(const ferry_task_ctx *ctx, void *user) {
    (void)user;
    /* A CUDA launch from a CPU body is refused. */
    uint32_t dims[3] = {1, 1, 1};
    if (ferry_task_launch(ctx, launch_me, dims, dims, 0, NULL) != FERRY_ERR_INVALID_ARGUMENT) return 1;
    /* Accessors on a bad index fail cleanly inside a body too. */
    void *p;
    size_t r, c;
    if (ferry_task_tile(ctx, 99, &p, &r, &c) != FERRY_ERR_INVALID_ARGUMENT) return 1;
    return 7;
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    ferry_runtime bogus_rt = {12345};
    ferry_collection bogus_c = {54321};
    ferry_class bogus_k = {777};
    ferry_distribution d = {FERRY_DIST_ON_RANK, 1, 1, 0};
    int32_t rank, size;

    /* Before any runtime exists. */
    EXPECT(ferry_wait(bogus_rt), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_finalize(bogus_rt), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_rank(bogus_rt, &rank, &size), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_init(NULL), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_grid_squarest(0, NULL, NULL), FERRY_ERR_INVALID_ARGUMENT);

    ferry_runtime rt;
    EXPECT(ferry_init(&rt), FERRY_OK);
    EXPECT(ferry_rank(rt, NULL, &size), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_rank(rt, &rank, &size), FERRY_OK);

    ferry_collection a;
    EXPECT(ferry_collection_new(rt, NULL, FERRY_F64, 8, 8, 4, 4, d, &a), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_collection_new(rt, "a", 99, 8, 8, 4, 4, d, &a), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_collection_new(rt, "a", FERRY_F64, 8, 8, 0, 4, d, &a), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_collection_new(rt, "a", FERRY_F64, 8, 8, 16, 4, d, &a), FERRY_ERR_INVALID_ARGUMENT);
    ferry_distribution bad_grid = {FERRY_DIST_BLOCK_2D, 3, 5, 0};
    EXPECT(ferry_collection_new(rt, "a", FERRY_F64, 8, 8, 4, 4, bad_grid, &a), FERRY_ERR_INVALID_ARGUMENT);
    ferry_distribution bad_kind = {42, 1, 1, 0};
    EXPECT(ferry_collection_new(rt, "a", FERRY_F64, 8, 8, 4, 4, bad_kind, &a), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_collection_new(bogus_rt, "a", FERRY_F64, 8, 8, 4, 4, d, &a), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_collection_new(rt, "a", FERRY_F64, 8, 8, 4, 4, d, &a), FERRY_OK);

    size_t mt, nt;
    EXPECT(ferry_collection_tiles(bogus_c, &mt, &nt), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_collection_tiles(a, &mt, &nt), FERRY_OK);
    int32_t owner;
    size_t rows, cols;
    EXPECT(ferry_collection_tile(a, 5, 0, &owner, &rows, &cols), FERRY_ERR_INVALID_ARGUMENT);

    ferry_class k, bad;
    EXPECT(ferry_class_new(rt, "k", NULL, NULL, NULL, &k), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_class_new(rt, "", ok_body, NULL, NULL, &k), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_class_new(bogus_rt, "k", ok_body, NULL, NULL, &k), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_class_new(rt, "k", ok_body, NULL, NULL, &k), FERRY_OK);
    EXPECT(ferry_class_new(rt, "bad", failing_body, NULL, NULL, &bad), FERRY_OK);

    ferry_access acc = {a, 0, 0, FERRY_RW};
    ferry_access bad_mode = {a, 0, 0, 9};
    ferry_access bad_tile = {a, 7, 0, FERRY_RW};
    ferry_access bad_coll = {bogus_c, 0, 0, FERRY_RW};
    EXPECT(ferry_insert(rt, bogus_k, &acc, 1, NULL, 0, 0, -1), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_insert(rt, k, &bad_coll, 1, NULL, 0, 0, -1), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_insert(rt, k, &bad_mode, 1, NULL, 0, 0, -1), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_insert(rt, k, &bad_tile, 1, NULL, 0, 0, -1), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_insert(rt, k, NULL, 1, NULL, 0, 0, -1), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_insert(rt, k, &acc, 1, NULL, 0, 0, 5), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_insert(rt, k, &acc, 1, NULL, 0, 0, -3), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_insert(rt, k, &acc, 1, NULL, 0, 0, -1), FERRY_OK);
    /* Part writes: two in a row form a group; the modes just outside the range are refused. */
    ferry_access part = {a, 0, 0, FERRY_RW_PART};
    ferry_access past_part = {a, 0, 0, FERRY_RW_PART + 1};
    ferry_access zero_mode = {a, 0, 0, 0};
    EXPECT(ferry_insert(rt, k, &past_part, 1, NULL, 0, 0, -1), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_insert(rt, k, &zero_mode, 1, NULL, 0, 0, -1), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_insert(rt, k, &part, 1, NULL, 0, 0, -1), FERRY_OK);
    EXPECT(ferry_insert(rt, k, &part, 1, NULL, 0, 0, -1), FERRY_OK);
    EXPECT(ferry_wait(rt), FERRY_OK);

    double tile[16];
    EXPECT(ferry_tile_read(rt, a, 0, 0, tile, 8), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_tile_read(rt, a, 0, 0, NULL, sizeof tile), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_tile_read(rt, a, 0, 0, tile, sizeof tile), FERRY_OK);

    size_t needed = 0;
    char small[4];
    EXPECT(ferry_stats_json(rt, small, sizeof small, &needed), FERRY_ERR_BUFFER_TOO_SMALL);
    if (needed < 10) {
        fprintf(stderr, "api_errors: stats need %zu bytes?\n", needed);
        return 1;
    }
    char big[65536];
    EXPECT(ferry_stats_json(rt, big, sizeof big, &needed), FERRY_OK);
    if (strstr(big, "\"paths\"") == NULL) {
        fprintf(stderr, "api_errors: statistics JSON without paths: %s\n", big);
        return 1;
    }

    /* Traces: recorded, then replayed; misuse refused; a bad handle. */
    int32_t replaying = -1;
    size_t traced = 0;
    EXPECT(ferry_trace_end(rt, &traced), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_trace_begin(bogus_rt, 1, &replaying), FERRY_ERR_INVALID_HANDLE);
    for (int rep = 0; rep < 3; rep++) {
        EXPECT(ferry_trace_begin(rt, 1, &replaying), FERRY_OK);
        checks++;
        if (replaying != (rep > 0)) {
            fprintf(stderr, "api_errors: trace use %d: replaying = %d\n", rep, replaying);
            return 1;
        }
        EXPECT(ferry_trace_begin(rt, 2, NULL), FERRY_ERR_INVALID_ARGUMENT);
        EXPECT(ferry_wait(rt), FERRY_ERR_INVALID_ARGUMENT);
        EXPECT(ferry_insert(rt, k, &acc, 1, NULL, 0, 0, -1), FERRY_OK);
        EXPECT(ferry_insert(rt, k, &acc, 1, NULL, 0, 0, -1), FERRY_OK);
        EXPECT(ferry_trace_end(rt, &traced), FERRY_OK);
        checks++;
        if (traced != 2) {
            fprintf(stderr, "api_errors: the trace inserted %zu tasks, not 2\n", traced);
            return 1;
        }
    }
    EXPECT(ferry_wait(rt), FERRY_OK);

    /* CUDA kernels: bad arguments, and a launch from a CPU body. */
    ferry_kernel kern;
    EXPECT(ferry_cuda_kernel_new(rt, NULL, "f", &kern), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_cuda_kernel_new(rt, "", "f", &kern), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_cuda_kernel_new(bogus_rt, "x", "f", &kern), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_cuda_kernel_new(rt, "extern \"C\" __global__ void f() {}", "f", &kern), FERRY_OK);
    uint32_t dims[3] = {1, 1, 1};
    EXPECT(ferry_task_launch(NULL, kern, dims, dims, 0, NULL), FERRY_ERR_INVALID_ARGUMENT);
    launch_me = kern;

    /* Accessors outside a body. */
    checks++;
    if (ferry_task_stream(NULL) != NULL || ferry_task_device(NULL) != -1) {
        fprintf(stderr, "api_errors: accessors on a null context\n");
        return 1;
    }
    EXPECT(ferry_task_tile(NULL, 0, NULL, NULL, NULL), FERRY_ERR_INVALID_ARGUMENT);
    checks++;
    if (strcmp(ferry_status_name(1234), "unknown ferry_status") != 0) return 1;

    /* Checkpoint and restore: misuse, a missing checkpoint, and a round trip. */
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/ferry-capi-ckpt-%d", (int)getpid());
    EXPECT(ferry_checkpoint(rt, NULL, 1, &a, 1), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_checkpoint(rt, dir, 1, &bogus_c, 1), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_checkpoint(rt, dir, 1, NULL, 1), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_checkpoint(rt, dir, 3, &a, 1), FERRY_OK);
    uint64_t step = 0;
    EXPECT(ferry_restore(rt, "/nonexistent/ferry-ckpt", &a, 1, &step), FERRY_ERR_CHECKPOINT);
    if (strstr(ferry_last_error(), "manifest") == NULL) {
        fprintf(stderr, "api_errors: restore error without the file: %s\n", ferry_last_error());
        return 1;
    }
    EXPECT(ferry_restore(rt, dir, &a, 1, NULL), FERRY_ERR_INVALID_ARGUMENT);
    EXPECT(ferry_restore(rt, dir, &a, 1, &step), FERRY_OK);
    double back[16];
    EXPECT(ferry_tile_read(rt, a, 0, 0, back, sizeof back), FERRY_OK);
    if (step != 3 || memcmp(back, tile, sizeof tile) != 0) {
        fprintf(stderr, "api_errors: restore gave step %llu or other data\n", (unsigned long long)step);
        return 1;
    }
    if (strcmp(ferry_status_name(FERRY_ERR_CHECKPOINT), "FERRY_ERR_CHECKPOINT") != 0) return 1;

    /* A failing body fails the run with a task error that names the class. */
    EXPECT(ferry_insert(rt, bad, &acc, 1, NULL, 0, 0, -1), FERRY_OK);
    EXPECT(ferry_wait(rt), FERRY_ERR_TASK_FAILED);
    checks++;
    if (strstr(ferry_last_error(), "bad") == NULL || strstr(ferry_last_error(), "returned 7") == NULL) {
        fprintf(stderr, "api_errors: task error without class or code: %s\n", ferry_last_error());
        return 1;
    }
    EXPECT(ferry_insert(rt, k, &acc, 1, NULL, 0, 0, -1), FERRY_ERR_POISONED);

    /* After finalize every handle is dead. */
    ferry_finalize(rt);
    EXPECT(ferry_wait(rt), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_insert(rt, k, &acc, 1, NULL, 0, 0, -1), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_collection_tiles(a, &mt, &nt), FERRY_ERR_INVALID_HANDLE);
    EXPECT(ferry_finalize(rt), FERRY_ERR_INVALID_HANDLE);

    int initialised, finalized;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalized);
    if (!initialised || finalized) {
        fprintf(stderr, "api_errors: ferry finalized the caller's MPI\n");
        return 1;
    }
    printf("api_errors ok: %d checks\n", checks);
    MPI_Finalize();
    return 0;
}
