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
 *   mpirun -np 4 ptg_cholesky --n 1024 --nb 128 [--seed 42]
 *   mpirun -np 4 ptg_cholesky --points data/cities1000.csv --count 2048 --nb 128
 *        [--order file|morton] [--kernel exponential|matern32|matern52|sqexp]
 *        [--length 500] [--variance 1] [--nugget 0.01]
 */
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

/* ---- the problem and its distribution ----------------------------------------------------- */

static int N, NB, T, P, Q, rank_, size_;
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
static ferry_mem_handle *hdl;  /* handles of the local tiles */
static ferry_mem_handle *chdl; /* handles of the pulled copies */
static int *pending;           /* inputs missing, per task (see task ids below) */
static int *queue, qhead, qtail, done_tasks, my_tasks;

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

/* ---- announcing and pulling tiles --------------------------------------------------------- */

/* L(i, j) as this rank sees it: its own tile or the copy it pulled. */
static double *L(int i, int j) { return owner(i, j) == rank_ ? tile[tri(i, j)] : copy[tri(i, j)]; }

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

/* Ranks other than this one that run a task reading L(i, j). */
static void announce(int i, int j) {
    char *to = calloc((size_t)size_, 1);
    if (i == j) {
        for (int m = i + 1; m < T; m++)
            to[owner(m, i)] = 1;
    } else {
        to[owner(i, i)] = 1;
        for (int jj = j + 1; jj < i; jj++)
            to[owner(i, jj)] = 1;
        for (int m = i + 1; m < T; m++)
            to[owner(m, i)] = 1;
    }
    struct {
        int32_t i, j;
        ferry_mem_handle h;
    } msg = {i, j, hdl[tri(i, j)]};
    for (int r = 0; r < size_; r++)
        if (to[r] && r != rank_)
            CHECK(ferry_engine_send_am(eng, TAG_READY, r, &msg, sizeof msg));
    free(to);
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
    l_arrived(p->i, p->j);
    free(p);
}

/* An announcement: pull the tile into a registered copy. */
static void on_ready(uint16_t tag, int32_t source, const void *data, size_t len, void *user) {
    (void)tag, (void)source, (void)user;
    struct {
        int32_t i, j;
        ferry_mem_handle h;
    } msg;
    if (len != sizeof msg)
        return;
    memcpy(&msg, data, sizeof msg);
    int t = tri(msg.i, msg.j);
    copy[t] = malloc(sizeof(double) * (size_t)NB * (size_t)NB);
    CHECK(ferry_engine_register(eng, copy[t], sizeof(double) * (size_t)NB * (size_t)NB, &chdl[t]));
    struct pull *p = malloc(sizeof *p);
    p->i = msg.i, p->j = msg.j;
    CHECK(ferry_engine_get(eng, &chdl[t], 0, &msg.h, 0, sizeof(double) * (size_t)NB * (size_t)NB, -1, NULL, 0,
                           pulled, p));
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

static void run(int id) {
    if (id < T) { /* POTRF(k) */
        int k = id;
        potrf(tile[tri(k, k)]);
        l_arrived(k, k);
        announce(k, k);
    } else if (id < T + T * T) { /* TRSM(i, k) */
        int t = id - T, i = 0;
        while (tri(i + 1, 0) <= t)
            i++;
        int k = t - tri(i, 0);
        trsm(L(k, k), tile[tri(i, k)]);
        l_arrived(i, k);
        announce(i, k);
    } else if (id < T + 2 * T * T) { /* SYRK(i, k) */
        int t = id - T - T * T, i = 0;
        while (tri(i + 1, 0) <= t)
            i++;
        int k = t - tri(i, 0);
        gemm_nt(L(i, k), L(i, k), tile[tri(i, i)]);
        if (k + 1 < i)
            satisfy(id_syrk(i, k + 1));
        else
            satisfy(id_potrf(i));
    } else { /* GEMM(i, j, k) */
        int t = id - T - 2 * T * T, k = t % T, ij = t / T, i = 0;
        while (tri(i + 1, 0) <= ij)
            i++;
        int j = ij - tri(i, 0);
        gemm_nt(L(i, k), L(j, k), tile[tri(i, j)]);
        if (k + 1 < j)
            satisfy(id_gemm(i, j, k + 1));
        else
            satisfy(id_trsm(i, j));
    }
    done_tasks++;
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    N = 1024, NB = 128;
    const char *points = NULL;
    size_t count = 0;
    int order = FERRY_ORDER_FILE;
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
                    "ptg_cholesky: unknown option or value %s %s (--n, --nb, --seed; --points, --count, --order "
                    "file|morton, --kernel exponential|matern32|matern52|sqexp, --length, --variance, --nugget)\n",
                    argv[a], v);
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
    MPI_Comm world = MPI_COMM_WORLD;
    ferry_engine_options opts = {FERRY_PROGRESS_CALLER, FERRY_COMPLETIONS_INLINE, -1, FERRY_ENGINE_DEVICES_NONE,
                                 FERRY_GPU_DIRECT_AUTO, 1};
    CHECK(ferry_engine_init(&world, &opts, &eng));
    CHECK(ferry_engine_rank(eng, &rank_, &size_));
    T = N / NB;
    for (P = (int)sqrt((double)size_); size_ % P; P--)
        ;
    Q = size_ / P;
    int tiles = T * (T + 1) / 2;
    tile = calloc((size_t)tiles, sizeof *tile);
    copy = calloc((size_t)tiles, sizeof *copy);
    hdl = calloc((size_t)tiles, sizeof *hdl);
    chdl = calloc((size_t)tiles, sizeof *chdl);
    pending = calloc((size_t)id_count(), sizeof *pending);
    queue = malloc(sizeof(int) * (size_t)id_count());
    size_t bytes = sizeof(double) * (size_t)NB * (size_t)NB;
    /* The local tiles, generated in place and registered once. */
    for (int i = 0; i < T; i++)
        for (int j = 0; j <= i; j++)
            if (owner(i, j) == rank_) {
                double *a = malloc(bytes);
                gen_tile(i, j, a);
                tile[tri(i, j)] = a;
                CHECK(ferry_engine_register(eng, a, bytes, &hdl[tri(i, j)]));
            }
    /* The local tasks and their inputs. */
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
    CHECK(ferry_engine_register_handler(eng, TAG_READY, on_ready, NULL));
    CHECK(ferry_engine_barrier(eng));
    double t0 = MPI_Wtime();
    while (done_tasks < my_tasks) {
        if (qhead < qtail)
            run(queue[qhead++]);
        else
            CHECK(ferry_engine_progress(eng, NULL));
    }
    CHECK(ferry_engine_barrier(eng));
    double seconds = MPI_Wtime() - t0;
    /* log det = 2 Σ log L_kk, summed over the owners of the diagonal. */
    double local = 0, *all = malloc(sizeof(double) * (size_t)size_);
    for (int k = 0; k < T; k++)
        if (owner(k, k) == rank_)
            for (int d = 0; d < NB; d++)
                local += 2 * log(tile[tri(k, k)][d + d * NB]);
    CHECK(ferry_engine_allgather(eng, &local, sizeof local, all));
    double logdet = 0;
    for (int r = 0; r < size_; r++)
        logdet += all[r];
    /* The residual on rank 0, from every tile of L pulled with gets. */
    ferry_mem_handle *every = malloc(sizeof *every * (size_t)tiles * (size_t)size_);
    CHECK(ferry_engine_allgather(eng, hdl, sizeof *hdl * (size_t)tiles, every));
    double residual = -1;
    if (rank_ == 0 && N <= 2048) {
        double *full = calloc((size_t)N * (size_t)N, sizeof(double)), *buf = malloc(bytes);
        double *orig = calloc((size_t)N * (size_t)N, sizeof(double));
        ferry_mem_handle bh;
        CHECK(ferry_engine_register(eng, buf, bytes, &bh));
        for (int i = 0; i < T; i++)
            for (int j = 0; j <= i; j++) {
                int o = owner(i, j);
                if (o == 0) {
                    memcpy(buf, tile[tri(i, j)], bytes);
                } else {
                    volatile int got = 0;
                    CHECK(ferry_engine_get(eng, &bh, 0, &every[(size_t)o * (size_t)tiles + (size_t)tri(i, j)], 0, bytes,
                                           -1, NULL, 0, pulled_flag, (void *)&got));
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
        free(buf);
    }
    CHECK(ferry_engine_barrier(eng));
    if (rank_ == 0) {
        if (places.id)
            printf("ptg_cholesky   n %d (places of %s) nb %d ranks %d grid %dx%d\n", N, points, NB, size_, P, Q);
        else
            printf("ptg_cholesky   n %d nb %d seed %llu ranks %d grid %dx%d\n", N, NB, (unsigned long long)seed, size_,
                   P, Q);
        printf("time           %.3f s\n", seconds);
        if (residual >= 0)
            printf("residual       %.3e  (‖A−LLᵀ‖_F / (‖A‖_F·n·ε))\n", residual);
        printf("log det        %.6f\n", logdet);
    }
    for (int t = 0; t < tiles; t++) {
        if (tile[t])
            CHECK(ferry_engine_unregister(eng, &hdl[t]));
        if (copy[t])
            CHECK(ferry_engine_unregister(eng, &chdl[t]));
        free(tile[t]);
        free(copy[t]);
    }
    if (places.id)
        CHECK(ferry_places_free(places));
    CHECK(ferry_engine_finalize(eng));
    MPI_Finalize();
    return residual >= 0 && !(residual < 1) ? 1 : 0;
}
