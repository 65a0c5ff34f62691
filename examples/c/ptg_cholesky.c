/* A distributed tiled Cholesky in the style of a parameterized task graph (PaRSEC's PTG), written
 * on ferry's communication engine alone (ferry_engine_*): no task runtime, no sequential task
 * flow. Each rank enumerates the tasks whose output tile it owns (2D block-cyclic over a P×Q grid),
 * counts their inputs, and runs the ready ones; a tile a remote task needs is announced to that
 * rank by an active message carrying the tile's memory handle, and the consumer pulls it with a
 * get. Progress is driven by this program (FERRY_PROGRESS_CALLER): handlers and completions run
 * inside ferry_engine_progress on the main thread, so the scheduler needs no locks.
 *
 * Tasks (right-looking, lower triangle; updates of one tile applied in k order):
 *   POTRF(k):      A_kk = chol(A_kk)             after SYRK(k, k-1)
 *   TRSM(i, k):    A_ik = A_ik · L_kk^-T          after L_kk and GEMM(i, k, k-1)
 *   SYRK(i, k):    A_ii -= L_ik · L_ik^T          after L_ik and SYRK(i, k-1)
 *   GEMM(i, j, k): A_ij -= L_ik · L_jk^T          after L_ik, L_jk and GEMM(i, j, k-1)
 *
 * The matrix is the STF example's: its generated SPD matrix (ferry_kernels::spd: SplitMix64 of
 * the seed and the indices), so `cholesky --n N --nb NB --seed S` prints the same log det; or,
 * with --points, the covariance of GeoNames places under a kernel of great-circle distance,
 * built tile by tile by ferry_places_covariance_tile, so `cholesky --points F --count M ...`
 * prints the same log det. Rank 0 also pulls every tile of L and checks
 * ‖A − L·Lᵀ‖_F / (‖A‖_F · n · ε) for n ≤ 2048.
 *
 * Where the tiles live (--devices):
 *   none      host memory, the kernels below (the default);
 *   cuda      device memory this program allocates itself (cudaMalloc, one slab of its tiles and
 *             one of the copies it pulls, each registered once with ferry_engine_register_device),
 *             cuSOLVER/cuBLAS tile kernels on its own streams ordered by events, a framework's
 *             usual set-up. A task is launched once its inputs are launched (local) or their get
 *             is issued (remote: ferry_engine_get_on_stream, so the consumer's stream waits for the
 *             bytes on the device); an announcement leaves once its tile's event has completed.
 *             libcudart, libcublas and libcusolver are loaded at run time, so the program builds
 *             without CUDA;
 *   emulated  the same slabs and protocol on the engine's emulated device (memory from
 *             ferry_engine_alloc_device), the host kernels on it: the device path where there is
 *             no GPU.
 *
 *   mpirun -np 4 ptg_cholesky --n 1024 --nb 128 [--seed 42] [--devices none|cuda|emulated]
 *        [--reps 1] [--streams 8]
 *   mpirun -np 4 ptg_cholesky --points data/cities1000.csv --count 2048 --nb 128
 *        [--order file|morton] [--kernel exponential|matern32|matern52|sqexp]
 *        [--length 500] [--variance 1] [--nugget 0.01]
 */
#include <dlfcn.h>
#include <ferry.h>
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                               \
    do {                                                                                          \
        ferry_status s_ = (call);                                                                 \
        if (s_ != FERRY_OK) {                                                                     \
            fprintf(stderr, "ptg_cholesky: %s -> %s: %s\n", #call, ferry_status_name(s_),         \
                    ferry_last_error());                                                          \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                         \
        }                                                                                         \
    } while (0)

enum { TAG_READY = 1 };

/* ---- the generated SPD matrix (ferry_kernels::spd) ---------------------------------------- */

static uint64_t splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double spd_entry(uint64_t seed, size_t n, size_t i, size_t j) {
    size_t lo = i <= j ? i : j, hi = i <= j ? j : i;
    uint64_t h = splitmix64(splitmix64(splitmix64(seed) ^ (uint64_t)lo) ^ (uint64_t)hi);
    double u = (double)(h >> 11) * (1.0 / (double)(1ull << 53));
    return i == j ? (double)n + u : u - 0.5;
}

/* ---- CUDA, loaded at run time (--devices cuda) ------------------------------------------- */

typedef void *cuda_stream;
typedef void *cuda_event;
enum { CUDA_MEMCPY_DEFAULT = 4, CUDA_EVENT_DISABLE_TIMING = 2, CUDA_STREAM_NON_BLOCKING = 1, CUDA_NOT_READY = 600 };
/* cuBLAS enums (cublas_api.h). */
enum { FILL_LOWER = 0, OP_N = 0, OP_T = 1, SIDE_RIGHT = 1, DIAG_NON_UNIT = 0 };

static struct {
    int (*GetDeviceCount)(int *);
    int (*SetDevice)(int);
    int (*Malloc)(void **, size_t);
    int (*Free)(void *);
    int (*Memcpy)(void *, const void *, size_t, int);
    int (*DeviceSynchronize)(void);
    int (*DeviceGetStreamPriorityRange)(int *, int *);
    int (*StreamCreateWithPriority)(cuda_stream *, unsigned, int);
    int (*StreamDestroy)(cuda_stream);
    int (*EventCreateWithFlags)(cuda_event *, unsigned);
    int (*EventDestroy)(cuda_event);
    int (*EventRecord)(cuda_event, cuda_stream);
    int (*EventQuery)(cuda_event);
    int (*StreamWaitEvent)(cuda_stream, cuda_event, unsigned);
    const char *(*GetErrorString)(int);
    int (*blasCreate)(void **);
    int (*blasDestroy)(void *);
    int (*blasSetStream)(void *, cuda_stream);
    int (*Dtrsm)(void *, int, int, int, int, int, int, const double *, const double *, int, double *, int);
    int (*Dsyrk)(void *, int, int, int, int, const double *, const double *, int, const double *, double *, int);
    int (*Dgemm)(void *, int, int, int, int, int, const double *, const double *, int, const double *, int,
                 const double *, double *, int);
    int (*solverCreate)(void **);
    int (*solverDestroy)(void *);
    int (*solverSetStream)(void *, cuda_stream);
    int (*Dpotrf_bufferSize)(void *, int, int, double *, int, int *);
    int (*Dpotrf)(void *, int, int, double *, int, double *, int, int *);
} cu;

/* dlopen the first of `names` found, as given or under the usual CUDA directories. */
static void *open_lib(const char *const *names) {
    const char *dirs[] = {"", getenv("CUDA_HOME"), "/usr/local/cuda/lib64/", "/usr/local/cuda/targets/x86_64-linux/lib/"};
    char path[512];
    for (const char *const *n = names; *n; n++)
        for (size_t d = 0; d < sizeof dirs / sizeof *dirs; d++) {
            if (!dirs[d])
                continue;
            const char *sep = dirs[d][0] && dirs[d][strlen(dirs[d]) - 1] != '/' ? "/lib64/" : "";
            snprintf(path, sizeof path, "%s%s%s", dirs[d], sep, *n);
            void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
            if (h)
                return h;
        }
    return NULL;
}

/* Loads the CUDA runtime, cuBLAS and cuSOLVER; 0 on success, else a message on stderr. */
static int load_cuda(void) {
    const char *rt[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", NULL};
    const char *blas[] = {"libcublas.so", "libcublas.so.13", "libcublas.so.12", NULL};
    const char *solver[] = {"libcusolver.so", "libcusolver.so.12", "libcusolver.so.11", NULL};
    void *hr = open_lib(rt), *hb = hr ? open_lib(blas) : NULL, *hs = hb ? open_lib(solver) : NULL;
    if (!hs) {
        fprintf(stderr,
                "ptg_cholesky: --devices cuda: cannot load %s (looked in the loader's path, $CUDA_HOME/lib64, "
                "/usr/local/cuda/lib64 and /usr/local/cuda/targets/x86_64-linux/lib)\n",
                !hr ? "libcudart" : !hb ? "libcublas" : "libcusolver");
        return 1;
    }
    struct {
        void *lib;
        const char *name;
        void **slot;
    } syms[] = {
        {hr, "cudaGetDeviceCount", (void **)&cu.GetDeviceCount},
        {hr, "cudaSetDevice", (void **)&cu.SetDevice},
        {hr, "cudaMalloc", (void **)&cu.Malloc},
        {hr, "cudaFree", (void **)&cu.Free},
        {hr, "cudaMemcpy", (void **)&cu.Memcpy},
        {hr, "cudaDeviceSynchronize", (void **)&cu.DeviceSynchronize},
        {hr, "cudaDeviceGetStreamPriorityRange", (void **)&cu.DeviceGetStreamPriorityRange},
        {hr, "cudaStreamCreateWithPriority", (void **)&cu.StreamCreateWithPriority},
        {hr, "cudaStreamDestroy", (void **)&cu.StreamDestroy},
        {hr, "cudaEventCreateWithFlags", (void **)&cu.EventCreateWithFlags},
        {hr, "cudaEventDestroy", (void **)&cu.EventDestroy},
        {hr, "cudaEventRecord", (void **)&cu.EventRecord},
        {hr, "cudaEventQuery", (void **)&cu.EventQuery},
        {hr, "cudaStreamWaitEvent", (void **)&cu.StreamWaitEvent},
        {hr, "cudaGetErrorString", (void **)&cu.GetErrorString},
        {hb, "cublasCreate_v2", (void **)&cu.blasCreate},
        {hb, "cublasDestroy_v2", (void **)&cu.blasDestroy},
        {hb, "cublasSetStream_v2", (void **)&cu.blasSetStream},
        {hb, "cublasDtrsm_v2", (void **)&cu.Dtrsm},
        {hb, "cublasDsyrk_v2", (void **)&cu.Dsyrk},
        {hb, "cublasDgemm_v2", (void **)&cu.Dgemm},
        {hs, "cusolverDnCreate", (void **)&cu.solverCreate},
        {hs, "cusolverDnDestroy", (void **)&cu.solverDestroy},
        {hs, "cusolverDnSetStream", (void **)&cu.solverSetStream},
        {hs, "cusolverDnDpotrf_bufferSize", (void **)&cu.Dpotrf_bufferSize},
        {hs, "cusolverDnDpotrf", (void **)&cu.Dpotrf},
    };
    for (size_t i = 0; i < sizeof syms / sizeof *syms; i++)
        if (!(*syms[i].slot = dlsym(syms[i].lib, syms[i].name))) {
            fprintf(stderr, "ptg_cholesky: --devices cuda: no %s (%s)\n", syms[i].name, dlerror());
            return 1;
        }
    return 0;
}

#define CU(call)                                                                                  \
    do {                                                                                          \
        int e_ = (call);                                                                          \
        if (e_ != 0) {                                                                            \
            fprintf(stderr, "ptg_cholesky: %s -> %d: %s\n", #call, e_,                            \
                    cu.GetErrorString ? cu.GetErrorString(e_) : "");                              \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                         \
        }                                                                                         \
    } while (0)

/* cuBLAS and cuSOLVER report statuses of their own (0: success). */
#define LIB(call)                                                                                 \
    do {                                                                                          \
        int e_ = (call);                                                                          \
        if (e_ != 0) {                                                                            \
            fprintf(stderr, "ptg_cholesky: %s -> status %d\n", #call, e_);                        \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                         \
        }                                                                                         \
    } while (0)

/* ---- the problem and its distribution ----------------------------------------------------- */

enum { DEV_NONE, DEV_EMULATED, DEV_CUDA };
static int N, NB, T, P, Q, rank_, size_, devmode = DEV_NONE, device;
static size_t TB; /* bytes of a tile */
static uint64_t seed = 42;
/* With --points: the places and the covariance function (the STF example's defaults). */
static ferry_places places = {0};
static ferry_cov_params cov = {FERRY_COV_EXPONENTIAL, 500.0, 1.0, 1e-2};

/* Tile (i, j) of A, column-major NB × NB. */
static void gen_tile(int i, int j, double *a) {
    if (places.id) {
        CHECK(ferry_places_covariance_tile(places, &cov, (size_t)i * NB, (size_t)j * NB, (size_t)NB, (size_t)NB, a));
        return;
    }
    for (int c = 0; c < NB; c++)
        for (int r = 0; r < NB; r++)
            a[r + c * NB] = spd_entry(seed, (size_t)N, (size_t)(i * NB + r), (size_t)(j * NB + c));
}
static ferry_engine eng;

static int owner(int i, int j) { return (i % P) * Q + (j % Q); }
static int tri(int i, int j) { return i * (i + 1) / 2 + j; } /* index of tile (i, j), i >= j */

static double **tile;          /* local tiles (NULL when not owned) */
static double **copy;          /* remote L tiles pulled here (NULL until announced) */
static double **pristine;      /* A's local tiles, restored before each repetition */
static ferry_mem_handle *hdl;  /* handles of the local tiles (device slabs: the slab's) */
static ferry_mem_handle *chdl; /* handles of the pulled copies (device slabs: the slab's) */
static size_t *slot;           /* offset of each local tile in its rank's slab (devices) */
static size_t *cslot;          /* offset of each copy in this rank's copy slab (devices) */
static int *pending;           /* inputs missing, per task (see task ids below) */
static int *queue, qhead, qtail, done_tasks, my_tasks;
static int gets_in_flight;     /* pulls issued and not completed */
static int *announcing, n_announcing; /* L tiles to announce once their event completes (CUDA) */

/* Device slabs: this rank's tiles, and the copies it pulls (each registered once). */
static char *slab, *cslab;
static ferry_mem_handle slab_h, cslab_h;

/* CUDA: streams (the first HI at the highest priority, for the critical path; then the rest of
 * the kernel streams; then IN streams that only wait for pulled tiles to land, so that no kernel
 * queues behind a pull), a cuBLAS handle per kernel stream, one cuSOLVER handle on stream 0, an
 * event per tile (its last writer) and per copy (its landing), the POTRF workspace and status
 * words. */
enum { HI = 2, IN = 2 };
static int nstreams = 8, rr_lo, rr_in;
static cuda_stream *streams;
static void **blas;
static void *solver;
static cuda_event *ev, *cev;
static double *work;
static int lwork, *dev_info;

/* Task ids: POTRF(k) = k; TRSM(i,k) = T + tri(i,k) (i > k); SYRK(i,k) = T + T*T + tri(i,k);
 * GEMM(i,j,k) = base + (tri(i,j) * T + k). Generous but simple. */
static int id_potrf(int k) { return k; }
static int id_trsm(int i, int k) { return T + tri(i, k); }
static int id_syrk(int i, int k) { return T + T * T + tri(i, k); }
static int id_gemm(int i, int j, int k) { return T + 2 * T * T + tri(i, j) * T + k; }
static int id_count(void) { return T + 2 * T * T + T * T * T; }

static void push(int id) { queue[qtail++] = id; }

static void satisfy(int id) {
    if (--pending[id] == 0)
        push(id);
}

/* ---- tile kernels (column-major nb × nb) -------------------------------------------------- */

static void potrf(double *a) {
    for (int j = 0; j < NB; j++) {
        double d = a[j + j * NB];
        for (int k = 0; k < j; k++)
            d -= a[j + k * NB] * a[j + k * NB];
        if (!(d > 0)) {
            fprintf(stderr, "ptg_cholesky: not positive definite\n");
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        d = sqrt(d);
        a[j + j * NB] = d;
        for (int i = j + 1; i < NB; i++) {
            double s = a[i + j * NB];
            for (int k = 0; k < j; k++)
                s -= a[i + k * NB] * a[j + k * NB];
            a[i + j * NB] = s / d;
        }
        for (int i = 0; i < j; i++)
            a[i + j * NB] = 0; /* the upper part of L is zero */
    }
}

static void trsm(const double *l, double *a) { /* a = a · l^-T */
    for (int r = 0; r < NB; r++)
        for (int c = 0; c < NB; c++) {
            double s = a[r + c * NB];
            for (int t = 0; t < c; t++)
                s -= a[r + t * NB] * l[c + t * NB];
            a[r + c * NB] = s / l[c + c * NB];
        }
}

static void gemm_nt(const double *x, const double *y, double *c) { /* c -= x · y^T */
    for (int j = 0; j < NB; j++)
        for (int t = 0; t < NB; t++) {
            double yjt = y[j + t * NB];
            for (int i = 0; i < NB; i++)
                c[i + j * NB] -= x[i + t * NB] * yjt;
        }
}

/* ---- device memory ------------------------------------------------------------------------ */

static void *dev_alloc(size_t bytes) {
    void *p = NULL;
    if (devmode == DEV_CUDA)
        CU(cu.Malloc(&p, bytes));
    else
        CHECK(ferry_engine_alloc_device(eng, (uint32_t)device, bytes, &p));
    return p;
}

static void dev_free(void *p) {
    if (devmode == DEV_CUDA)
        CU(cu.Free(p));
    else
        CHECK(ferry_engine_free_device(eng, p));
}

static void dev_write(void *dst, const void *src, size_t bytes) {
    if (devmode == DEV_CUDA)
        CU(cu.Memcpy(dst, src, bytes, CUDA_MEMCPY_DEFAULT));
    else
        CHECK(ferry_engine_device_write(eng, (uint32_t)device, dst, src, bytes));
}

static void dev_read(void *dst, const void *src, size_t bytes) {
    if (devmode == DEV_CUDA)
        CU(cu.Memcpy(dst, src, bytes, CUDA_MEMCPY_DEFAULT));
    else
        CHECK(ferry_engine_device_read(eng, (uint32_t)device, dst, src, bytes));
}

/* Host memory, or a device slab's bytes read back: tile t of this rank into `out`. */
static void read_tile(int t, double *out) {
    if (devmode == DEV_NONE)
        memcpy(out, tile[t], TB);
    else
        dev_read(out, tile[t], TB);
}

/* ---- announcing and pulling tiles --------------------------------------------------------- */

/* L(i, j) as this rank sees it: its own tile or the copy it pulled. */
static double *L(int i, int j) { return owner(i, j) == rank_ ? tile[tri(i, j)] : copy[tri(i, j)]; }

/* The event after which L(i, j) may be read on this rank's streams (CUDA). */
static cuda_event L_event(int i, int j) { return owner(i, j) == rank_ ? ev[tri(i, j)] : cev[tri(i, j)]; }

/* The local tasks that read L(i, j), satisfied once it is here. */
static void l_arrived(int i, int j) {
    if (i == j) { /* L_kk: the TRSMs of column k */
        for (int m = i + 1; m < T; m++)
            if (owner(m, i) == rank_)
                satisfy(id_trsm(m, i));
        return;
    }
    int k = j; /* L_ik */
    if (owner(i, i) == rank_)
        satisfy(id_syrk(i, k));
    for (int jj = k + 1; jj < i; jj++)
        if (owner(i, jj) == rank_)
            satisfy(id_gemm(i, jj, k));
    for (int m = i + 1; m < T; m++)
        if (owner(m, i) == rank_)
            satisfy(id_gemm(m, i, k));
}

/* Whether rank r runs a task that reads L(i, j). */
static int reads(int r, int i, int j) {
    if (i == j) {
        for (int m = i + 1; m < T; m++)
            if (owner(m, i) == r)
                return 1;
        return 0;
    }
    if (owner(i, i) == r)
        return 1;
    for (int jj = j + 1; jj < i; jj++)
        if (owner(i, jj) == r)
            return 1;
    for (int m = i + 1; m < T; m++)
        if (owner(m, i) == r)
            return 1;
    return 0;
}

/* An announcement: where a final tile of L lies (its owner's handle and the offset in it). */
struct ready_msg {
    int32_t i, j;
    uint64_t offset;
    ferry_mem_handle h;
};

/* Ranks other than this one that run a task reading L(i, j). */
static void announce(int i, int j) {
    int t = tri(i, j);
    struct ready_msg msg = {i, j, devmode == DEV_NONE ? 0 : slot[t], hdl[t]};
    for (int r = 0; r < size_; r++)
        if (r != rank_ && reads(r, i, j))
            CHECK(ferry_engine_send_am(eng, TAG_READY, r, &msg, sizeof msg));
}

/* L(i, j) is final on this rank's streams: local readers may be launched now; remote ones hear of
 * it once the data is really there (CUDA: the tile's event has completed). */
static void l_final(int i, int j) {
    l_arrived(i, j);
    int remote = 0;
    for (int r = 0; r < size_ && !remote; r++)
        remote = r != rank_ && reads(r, i, j);
    if (!remote)
        return;
    if (devmode == DEV_CUDA)
        announcing[n_announcing++] = tri(i, j);
    else
        announce(i, j);
}

/* Announcements whose tiles have been written by now. */
static void announce_completed(void) {
    for (int a = 0; a < n_announcing;) {
        int t = announcing[a], e = cu.EventQuery(ev[t]);
        if (e == CUDA_NOT_READY) {
            a++;
            continue;
        }
        CU(e);
        int i = 0;
        while (tri(i + 1, 0) <= t)
            i++;
        announce(i, t - tri(i, 0));
        announcing[a] = announcing[--n_announcing];
    }
}

struct pull {
    int i, j;
};

static void pulled(ferry_status s, void *user) {
    struct pull *p = user;
    if (s != FERRY_OK) {
        fprintf(stderr, "ptg_cholesky: pulling L(%d,%d) failed: %s\n", p->i, p->j, ferry_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    gets_in_flight--;
    /* A stream-ordered pull satisfied its readers when it was issued. */
    if (devmode != DEV_CUDA)
        l_arrived(p->i, p->j);
    free(p);
}

/* An announcement: pull the tile into this rank's copy of it. */
static void on_ready(uint16_t tag, int32_t source, const void *data, size_t len, void *user) {
    (void)tag, (void)source, (void)user;
    struct ready_msg msg;
    if (len != sizeof msg) {
        fprintf(stderr, "ptg_cholesky: an announcement of %zu bytes (expected %zu)\n", len, sizeof msg);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    memcpy(&msg, data, sizeof msg);
    int t = tri(msg.i, msg.j);
    size_t off = 0;
    if (devmode == DEV_NONE) {
        if (!copy[t]) { /* kept for later repetitions */
            copy[t] = malloc(TB);
            CHECK(ferry_engine_register(eng, copy[t], TB, &chdl[t]));
        }
    } else {
        off = cslot[t];
    }
    struct pull *p = malloc(sizeof *p);
    p->i = msg.i, p->j = msg.j;
    gets_in_flight++;
    if (devmode == DEV_CUDA) {
        /* The readers' streams wait for the landing on the device: no host round trip. */
        cuda_stream s = streams[nstreams + rr_in++ % IN];
        CHECK(ferry_engine_get_on_stream(eng, &chdl[t], off, &msg.h, msg.offset, TB, -1, NULL, 0, s, pulled, p));
        CU(cu.EventRecord(cev[t], s));
        l_arrived(msg.i, msg.j);
    } else {
        CHECK(ferry_engine_get(eng, &chdl[t], off, &msg.h, msg.offset, TB, -1, NULL, 0, pulled, p));
    }
}

/* A get for the residual check has landed. */
static void pulled_flag(ferry_status s, void *user) {
    if (s != FERRY_OK) {
        fprintf(stderr, "ptg_cholesky: pulling a tile of L failed: %s\n", ferry_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    *(volatile int *)user = 1;
}

/* ---- running a task ----------------------------------------------------------------------- */

/* The stream of a CUDA task: POTRF on stream 0 (with the cuSOLVER handle), the rest of the
 * critical path (TRSMs, and the updates of the next panel's tiles) on the high-priority
 * streams, the trailing updates round-robin on the others. */
static int stream_of(int kind, int i, int j, int k) {
    if (kind == 0)
        return 0;
    if (kind == 1 || j == k + 1)
        return i % HI;
    return HI + (rr_lo++ % (nstreams - HI));
}

/* CUDA: `s` waits for the tiles the task reads (and the one it updates). */
static void wait_for(int s, cuda_event a, cuda_event b, cuda_event c) {
    cuda_event in[3] = {a, b, c};
    for (int x = 0; x < 3; x++)
        if (in[x])
            CU(cu.StreamWaitEvent(streams[s], in[x], 0));
}

static const double one = 1.0, minus_one = -1.0;

static void run(int id) {
    int cuda = devmode == DEV_CUDA;
    if (id < T) { /* POTRF(k) */
        int k = id, t = tri(k, k);
        if (cuda) {
            wait_for(0, ev[t], NULL, NULL);
            LIB(cu.Dpotrf(solver, FILL_LOWER, NB, tile[t], NB, work, lwork, dev_info + k));
            CU(cu.EventRecord(ev[t], streams[0]));
        } else {
            potrf(tile[t]);
        }
        l_final(k, k);
    } else if (id < T + T * T) { /* TRSM(i, k) */
        int u = id - T, i = 0;
        while (tri(i + 1, 0) <= u)
            i++;
        int k = u - tri(i, 0), t = tri(i, k);
        if (cuda) {
            int s = stream_of(1, i, k, k);
            wait_for(s, L_event(k, k), ev[t], NULL);
            LIB(cu.Dtrsm(blas[s], SIDE_RIGHT, FILL_LOWER, OP_T, DIAG_NON_UNIT, NB, NB, &one, L(k, k), NB, tile[t], NB));
            CU(cu.EventRecord(ev[t], streams[s]));
        } else {
            trsm(L(k, k), tile[t]);
        }
        l_final(i, k);
    } else if (id < T + 2 * T * T) { /* SYRK(i, k) */
        int u = id - T - T * T, i = 0;
        while (tri(i + 1, 0) <= u)
            i++;
        int k = u - tri(i, 0), t = tri(i, i);
        if (cuda) {
            int s = stream_of(2, i, i, k);
            wait_for(s, L_event(i, k), ev[t], NULL);
            LIB(cu.Dsyrk(blas[s], FILL_LOWER, OP_N, NB, NB, &minus_one, L(i, k), NB, &one, tile[t], NB));
            CU(cu.EventRecord(ev[t], streams[s]));
        } else {
            gemm_nt(L(i, k), L(i, k), tile[t]);
        }
        if (k + 1 < i)
            satisfy(id_syrk(i, k + 1));
        else
            satisfy(id_potrf(i));
    } else { /* GEMM(i, j, k) */
        int u = id - T - 2 * T * T, k = u % T, ij = u / T, i = 0;
        while (tri(i + 1, 0) <= ij)
            i++;
        int j = ij - tri(i, 0), t = tri(i, j);
        if (cuda) {
            int s = stream_of(3, i, j, k);
            wait_for(s, L_event(i, k), L_event(j, k), ev[t]);
            LIB(cu.Dgemm(blas[s], OP_N, OP_T, NB, NB, NB, &minus_one, L(i, k), NB, L(j, k), NB, &one, tile[t], NB));
            CU(cu.EventRecord(ev[t], streams[s]));
        } else {
            gemm_nt(L(i, k), L(j, k), tile[t]);
        }
        if (k + 1 < j)
            satisfy(id_gemm(i, j, k + 1));
        else
            satisfy(id_trsm(i, j));
    }
    done_tasks++;
}

/* The local tasks and their inputs, before a factorization. */
static void setup_tasks(void) {
    memset(pending, 0, sizeof(int) * (size_t)id_count());
    qhead = qtail = done_tasks = my_tasks = 0;
    for (int k = 0; k < T; k++) {
        if (owner(k, k) == rank_) {
            my_tasks++;
            if ((pending[id_potrf(k)] = k > 0) == 0)
                push(id_potrf(k));
        }
        for (int i = k + 1; i < T; i++) {
            if (owner(i, k) == rank_) {
                my_tasks++;
                pending[id_trsm(i, k)] = 1 + (k > 0);
            }
            if (owner(i, i) == rank_) {
                my_tasks++;
                pending[id_syrk(i, k)] = 1 + (k > 0);
            }
            for (int j = k + 1; j < i; j++)
                if (owner(i, j) == rank_) {
                    my_tasks++;
                    pending[id_gemm(i, j, k)] = 2 + (k > 0);
                }
        }
    }
}

/* One factorization of A (restored from the pristine tiles first); its seconds, barrier to
 * barrier, with every launched kernel finished. */
static double factorize(void) {
    for (int t = 0; t < T * (T + 1) / 2; t++)
        if (tile[t]) {
            if (devmode == DEV_NONE)
                memcpy(tile[t], pristine[t], TB);
            else
                dev_write(tile[t], pristine[t], TB);
        }
    setup_tasks();
    if (devmode == DEV_CUDA)
        CU(cu.DeviceSynchronize());
    CHECK(ferry_engine_barrier(eng));
    double t0 = MPI_Wtime();
    while (done_tasks < my_tasks || n_announcing > 0 || gets_in_flight > 0) {
        if (qhead < qtail) {
            run(queue[qhead++]);
            continue;
        }
        if (n_announcing > 0)
            announce_completed();
        CHECK(ferry_engine_progress(eng, NULL));
    }
    if (devmode == DEV_CUDA)
        CU(cu.DeviceSynchronize());
    CHECK(ferry_engine_barrier(eng));
    return MPI_Wtime() - t0;
}

/* CUDA: device, streams, handles, events and the POTRF workspace. */
static void cuda_setup(void) {
    int n = 0;
    CU(cu.GetDeviceCount(&n));
    MPI_Comm node;
    int local = 0;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    device = local % n; /* a GPU per rank of the node, round-robin */
    CU(cu.SetDevice(device));
    int least = 0, greatest = 0;
    CU(cu.DeviceGetStreamPriorityRange(&least, &greatest));
    streams = calloc((size_t)(nstreams + IN), sizeof *streams);
    blas = calloc((size_t)nstreams, sizeof *blas);
    for (int s = 0; s < nstreams + IN; s++)
        CU(cu.StreamCreateWithPriority(&streams[s], CUDA_STREAM_NON_BLOCKING, s < HI ? greatest : least));
    for (int s = 0; s < nstreams; s++) {
        LIB(cu.blasCreate(&blas[s]));
        LIB(cu.blasSetStream(blas[s], streams[s]));
    }
    LIB(cu.solverCreate(&solver));
    LIB(cu.solverSetStream(solver, streams[0]));
    int tiles = T * (T + 1) / 2;
    ev = calloc((size_t)tiles, sizeof *ev);
    cev = calloc((size_t)tiles, sizeof *cev);
    for (int t = 0; t < tiles; t++) {
        CU(cu.EventCreateWithFlags(&ev[t], CUDA_EVENT_DISABLE_TIMING));
        CU(cu.EventCreateWithFlags(&cev[t], CUDA_EVENT_DISABLE_TIMING));
    }
    double *probe = dev_alloc(TB);
    LIB(cu.Dpotrf_bufferSize(solver, FILL_LOWER, NB, probe, NB, &lwork));
    dev_free(probe);
    work = dev_alloc(sizeof(double) * (size_t)(lwork > 0 ? lwork : 1));
    dev_info = dev_alloc(sizeof(int) * (size_t)T);
    CU(cu.DeviceSynchronize());
}

/* CUDA: cuSOLVER's status of every local POTRF (the host kernel checks its own). */
static void cuda_check_info(void) {
    int *info = malloc(sizeof(int) * (size_t)T);
    dev_read(info, dev_info, sizeof(int) * (size_t)T);
    for (int k = 0; k < T; k++)
        if (owner(k, k) == rank_ && info[k] != 0) {
            fprintf(stderr, "ptg_cholesky: POTRF(%d): not positive definite (cuSOLVER info %d)\n", k, info[k]);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    free(info);
}

static void cuda_teardown(void) {
    for (int t = 0; t < T * (T + 1) / 2; t++) {
        CU(cu.EventDestroy(ev[t]));
        CU(cu.EventDestroy(cev[t]));
    }
    LIB(cu.solverDestroy(solver));
    for (int s = 0; s < nstreams; s++)
        LIB(cu.blasDestroy(blas[s]));
    for (int s = 0; s < nstreams + IN; s++)
        CU(cu.StreamDestroy(streams[s]));
    dev_free(work);
    dev_free(dev_info);
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    N = 1024, NB = 128;
    const char *points = NULL;
    size_t count = 0;
    int order = FERRY_ORDER_FILE, reps = 1;
    for (int a = 1; a < argc; a += 2) {
        const char *v = a + 1 < argc ? argv[a + 1] : NULL;
        if (!v) {
            fprintf(stderr, "ptg_cholesky: %s needs a value\n", argv[a]);
            return 2;
        } else if (!strcmp(argv[a], "--n"))
            N = atoi(v);
        else if (!strcmp(argv[a], "--nb"))
            NB = atoi(v);
        else if (!strcmp(argv[a], "--seed"))
            seed = strtoull(v, NULL, 10);
        else if (!strcmp(argv[a], "--reps") && atoi(v) > 0)
            reps = atoi(v);
        else if (!strcmp(argv[a], "--streams") && atoi(v) > HI)
            nstreams = atoi(v);
        else if (!strcmp(argv[a], "--devices") && !strcmp(v, "none"))
            devmode = DEV_NONE;
        else if (!strcmp(argv[a], "--devices") && !strcmp(v, "cuda"))
            devmode = DEV_CUDA;
        else if (!strcmp(argv[a], "--devices") && !strcmp(v, "emulated"))
            devmode = DEV_EMULATED;
        else if (!strcmp(argv[a], "--points"))
            points = v;
        else if (!strcmp(argv[a], "--count"))
            count = strtoull(v, NULL, 10);
        else if (!strcmp(argv[a], "--order") && (!strcmp(v, "file") || !strcmp(v, "morton")))
            order = strcmp(v, "file") ? FERRY_ORDER_MORTON : FERRY_ORDER_FILE;
        else if (!strcmp(argv[a], "--kernel") && !strcmp(v, "exponential"))
            cov.kernel = FERRY_COV_EXPONENTIAL;
        else if (!strcmp(argv[a], "--kernel") && !strcmp(v, "matern32"))
            cov.kernel = FERRY_COV_MATERN32;
        else if (!strcmp(argv[a], "--kernel") && !strcmp(v, "matern52"))
            cov.kernel = FERRY_COV_MATERN52;
        else if (!strcmp(argv[a], "--kernel") && !strcmp(v, "sqexp"))
            cov.kernel = FERRY_COV_SQEXP;
        else if (!strcmp(argv[a], "--length"))
            cov.length_km = atof(v);
        else if (!strcmp(argv[a], "--variance"))
            cov.variance = atof(v);
        else if (!strcmp(argv[a], "--nugget"))
            cov.nugget = atof(v);
        else {
            fprintf(stderr,
                    "ptg_cholesky: unknown option or value %s %s (--n, --nb, --seed, --reps N>0, --streams N>%d, "
                    "--devices none|cuda|emulated; --points, --count, --order file|morton, --kernel "
                    "exponential|matern32|matern52|sqexp, --length, --variance, --nugget)\n",
                    argv[a], v, HI);
            return 2;
        }
    }
    if (points) {
        /* Every rank loads the places: its tiles are computed where they live. */
        CHECK(ferry_places_load(points, count, order, &places));
        size_t n = 0;
        CHECK(ferry_places_count(places, &n));
        N = (int)n;
    }
    if (N <= 0 || NB <= 0 || N % NB) {
        fprintf(stderr, "ptg_cholesky: the order (--n, or --count places) must be a positive multiple of --nb (got %d, %d)\n",
                N, NB);
        return 2;
    }
    if (devmode == DEV_CUDA && load_cuda())
        return 2;
    MPI_Comm world = MPI_COMM_WORLD;
    int devices = devmode == DEV_CUDA ? FERRY_ENGINE_DEVICES_CUDA : devmode == DEV_EMULATED ? 1 : FERRY_ENGINE_DEVICES_NONE;
    /* Designated: fields added to the options later start at 0, their defaults. */
    ferry_engine_options opts = {.progress = FERRY_PROGRESS_CALLER,
                                 .completions = FERRY_COMPLETIONS_INLINE,
                                 .progress_sleep_us = -1,
                                 .devices = devices,
                                 .gpu_direct = FERRY_GPU_DIRECT_AUTO,
                                 .ipc = 1};
    CHECK(ferry_engine_init(&world, &opts, &eng));
    CHECK(ferry_engine_rank(eng, &rank_, &size_));
    T = N / NB;
    TB = sizeof(double) * (size_t)NB * (size_t)NB;
    for (P = (int)sqrt((double)size_); size_ % P; P--)
        ;
    Q = size_ / P;
    int tiles = T * (T + 1) / 2;
    tile = calloc((size_t)tiles, sizeof *tile);
    copy = calloc((size_t)tiles, sizeof *copy);
    pristine = calloc((size_t)tiles, sizeof *pristine);
    hdl = calloc((size_t)tiles, sizeof *hdl);
    chdl = calloc((size_t)tiles, sizeof *chdl);
    slot = calloc((size_t)tiles, sizeof *slot);
    cslot = calloc((size_t)tiles, sizeof *cslot);
    announcing = calloc((size_t)tiles, sizeof *announcing);
    pending = calloc((size_t)id_count(), sizeof *pending);
    queue = malloc(sizeof(int) * (size_t)id_count());
    if (devmode == DEV_CUDA)
        cuda_setup();
    /* Where every rank keeps each tile in its slab (each rank can place any owner's tiles), and
     * where this rank keeps the copies it will pull. */
    size_t mine = 0, copies = 0, *used = calloc((size_t)size_, sizeof *used);
    for (int i = 0; i < T; i++)
        for (int j = 0; j <= i; j++) {
            int o = owner(i, j), t = tri(i, j);
            slot[t] = used[o]++ * TB;
            if (o == rank_)
                mine++;
            else if (reads(rank_, i, j))
                cslot[t] = copies++ * TB;
        }
    free(used);
    if (devmode != DEV_NONE) {
        slab = dev_alloc(mine ? mine * TB : TB);
        cslab = dev_alloc(copies ? copies * TB : TB);
        CHECK(ferry_engine_register_device(eng, slab, mine ? mine * TB : TB, (uint32_t)device, &slab_h));
        CHECK(ferry_engine_register_device(eng, cslab, copies ? copies * TB : TB, (uint32_t)device, &cslab_h));
    }
    /* The local tiles, generated (and kept to restore A before each repetition) and registered
     * once; the copies' places. */
    for (int i = 0; i < T; i++)
        for (int j = 0; j <= i; j++) {
            int t = tri(i, j);
            if (owner(i, j) == rank_) {
                pristine[t] = malloc(TB);
                gen_tile(i, j, pristine[t]);
                if (devmode == DEV_NONE) {
                    tile[t] = malloc(TB);
                    CHECK(ferry_engine_register(eng, tile[t], TB, &hdl[t]));
                } else {
                    tile[t] = (double *)(slab + slot[t]);
                    hdl[t] = slab_h;
                }
            } else if (devmode != DEV_NONE && reads(rank_, i, j)) {
                copy[t] = (double *)(cslab + cslot[t]);
                chdl[t] = cslab_h;
            }
        }
    CHECK(ferry_engine_register_handler(eng, TAG_READY, on_ready, NULL));
    double seconds = 0, total = 0;
    for (int r = 0; r < reps; r++) {
        double s = factorize();
        total += s;
        if (r == 0 || s < seconds)
            seconds = s;
    }
    if (devmode == DEV_CUDA)
        cuda_check_info();
    /* log det = 2 Σ log L_kk, summed over the owners of the diagonal. */
    double local = 0, *all = malloc(sizeof(double) * (size_t)size_), *buf = malloc(TB);
    for (int k = 0; k < T; k++)
        if (owner(k, k) == rank_) {
            read_tile(tri(k, k), buf);
            for (int d = 0; d < NB; d++)
                local += 2 * log(buf[d + d * NB]);
        }
    CHECK(ferry_engine_allgather(eng, &local, sizeof local, all));
    double logdet = 0;
    for (int r = 0; r < size_; r++)
        logdet += all[r];
    /* The residual on rank 0, from every tile of L pulled with gets. */
    ferry_mem_handle *every = malloc(sizeof *every * (size_t)tiles * (size_t)size_);
    CHECK(ferry_engine_allgather(eng, hdl, sizeof *hdl * (size_t)tiles, every));
    double residual = -1;
    if (rank_ == 0 && N <= 2048) {
        double *full = calloc((size_t)N * (size_t)N, sizeof(double));
        double *orig = calloc((size_t)N * (size_t)N, sizeof(double));
        ferry_mem_handle bh;
        CHECK(ferry_engine_register(eng, buf, TB, &bh));
        for (int i = 0; i < T; i++)
            for (int j = 0; j <= i; j++) {
                int o = owner(i, j), t = tri(i, j);
                if (o == 0) {
                    read_tile(t, buf);
                } else {
                    volatile int got = 0;
                    CHECK(ferry_engine_get(eng, &bh, 0, &every[(size_t)o * (size_t)tiles + (size_t)t],
                                           devmode == DEV_NONE ? 0 : slot[t], TB, -1, NULL, 0, pulled_flag,
                                           (void *)&got));
                    while (!got)
                        CHECK(ferry_engine_progress(eng, NULL));
                }
                for (int c = 0; c < NB; c++)
                    for (int r = 0; r < NB; r++)
                        full[(size_t)(i * NB + r) + (size_t)(j * NB + c) * (size_t)N] = buf[r + c * NB];
                gen_tile(i, j, buf);
                for (int c = 0; c < NB; c++)
                    for (int r = 0; r < NB; r++)
                        orig[(size_t)(i * NB + r) + (size_t)(j * NB + c) * (size_t)N] = buf[r + c * NB];
            }
        double num = 0, den = 0;
        for (int i = 0; i < N; i++)
            for (int j = 0; j <= i; j++) {
                double s = 0;
                for (int t = 0; t <= j; t++)
                    s += full[i + (size_t)t * N] * full[j + (size_t)t * N];
                double a = orig[i + (size_t)j * N], d = a - s, w = i == j ? 1 : 2;
                num += w * d * d;
                den += w * a * a;
            }
        residual = sqrt(num) / (sqrt(den) * N * 2.220446049250313e-16);
        CHECK(ferry_engine_unregister(eng, &bh));
        free(full);
        free(orig);
    }
    /* What moved between ranks, summed: gets, and how many were peer copies under a lease. */
    ferry_engine_counters st;
    CHECK(ferry_engine_stats(eng, &st));
    uint64_t moved[3] = {st.gets, st.leased_copies, st.bytes_got}, *moved_all = malloc(sizeof moved * (size_t)size_);
    CHECK(ferry_engine_allgather(eng, moved, sizeof moved, moved_all));
    for (int r = 1; r < size_; r++)
        for (int x = 0; x < 3; x++)
            moved[x] += moved_all[r * 3 + x];
    free(moved_all);
    CHECK(ferry_engine_barrier(eng));
    if (rank_ == 0) {
        const char *where = devmode == DEV_CUDA ? "cuda" : devmode == DEV_EMULATED ? "emulated" : "none";
        if (places.id)
            printf("ptg_cholesky   n %d (places of %s) nb %d ranks %d grid %dx%d devices %s\n", N, points, NB, size_,
                   P, Q, where);
        else
            printf("ptg_cholesky   n %d nb %d seed %llu ranks %d grid %dx%d devices %s\n", N, NB,
                   (unsigned long long)seed, size_, P, Q, where);
        printf("time           %.4f s  (best of %d; mean %.4f s)\n", seconds, reps, total / reps);
        printf("GFLOP/s        %.2f\n", (double)N * N * N / 3.0 / seconds / 1e9);
        if (residual >= 0)
            printf("residual       %.3e  (‖A−LLᵀ‖_F / (‖A‖_F·n·ε))\n", residual);
        printf("log det        %.6f\n", logdet);
        printf("gets           %llu (%llu leased IPC copies), %.1f MiB\n", (unsigned long long)moved[0],
               (unsigned long long)moved[1], (double)moved[2] / 1048576.0);
    }
    if (devmode == DEV_CUDA)
        cuda_teardown();
    for (int t = 0; t < tiles; t++) {
        if (devmode == DEV_NONE) {
            if (tile[t])
                CHECK(ferry_engine_unregister(eng, &hdl[t]));
            if (copy[t])
                CHECK(ferry_engine_unregister(eng, &chdl[t]));
            free(tile[t]);
            free(copy[t]);
        }
        free(pristine[t]);
    }
    if (devmode != DEV_NONE) {
        CHECK(ferry_engine_unregister(eng, &slab_h));
        CHECK(ferry_engine_unregister(eng, &cslab_h));
        dev_free(slab);
        dev_free(cslab);
    }
    free(buf);
    free(all);
    free(every);
    if (places.id)
        CHECK(ferry_places_free(places));
    CHECK(ferry_engine_finalize(eng));
    MPI_Finalize();
    return residual >= 0 && !(residual < 1) ? 1 : 0;
}
