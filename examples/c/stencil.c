/* The 2D heat-equation stencil of examples/src/bin/stencil.rs, written in C against ferry's C ABI.
 *
 * The step has a CPU body and a CUDA body (a kernel compiled by ferry with NVRTC from the source
 * below, --fmad=false): with FERRY_DEVICES=cuda the steps run on the GPUs, with the same bits.
 *
 * Same field, tiling, distribution (2D block over the squarest process grid), task sequence and
 * arithmetic as the Rust driver, so the final field — and its checksum — is bit-identical to it
 * on any rank count. The program initialises MPI itself (MPI_THREAD_MULTIPLE), as a framework
 * would, and checks that MPI is still initialised after ferry_finalize.
 *
 * Build:  mpicc -O2 -ffp-contract=off -std=c11 stencil.c $(pkg-config --cflags --libs ferry) -lm
 * Run:    mpirun -np 4 ./stencil --n 1024 --nb 256 --iters 100
 */
#include <ferry.h>
#include <inttypes.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef M_PI
#define M_PI 3.14159265358979323846 /* the same double as Rust's std::f64::consts::PI */
#endif

#define CHECK(call)                                                                            \
    do {                                                                                       \
        ferry_status s_ = (call);                                                              \
        if (s_ != FERRY_OK) {                                                                  \
            fprintf(stderr, "stencil.c: %s failed: %s: %s\n", #call, ferry_status_name(s_),      \
                    ferry_last_error());                                                       \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                      \
        }                                                                                      \
    } while (0)

static size_t N; /* interior points per side, the same for every task */

static double sine_mode(size_t n, size_t gi, size_t gj) {
    double h = 1.0 / ((double)n + 1.0);
    double xi = ((double)gi + 1.0) * h, xj = ((double)gj + 1.0) * h;
    return sin(M_PI * xi) * sin(M_PI * xj);
}

static double sine_mode_decay(size_t n, double alpha) {
    double h = 1.0 / ((double)n + 1.0);
    double s = sin(M_PI * h / 2.0);
    return 1.0 - 8.0 * alpha * s * s;
}

static uint64_t splitmix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, unsigned r) { return (x << r) | (x >> (64 - r)); }

static double *tile(const ferry_task_ctx *ctx, size_t k, size_t *rows, size_t *cols) {
    void *p = NULL;
    size_t r = 0, c = 0;
    if (ferry_task_tile(ctx, k, &p, &r, &c) != FERRY_OK) return NULL;
    if (rows) *rows = r;
    if (cols) *cols = c;
    return (double *)p;
}

/* Writes the four edges of u (rows x cols) into tiles first .. first+3 (N, S, W, E). */
static int publish_edges(const ferry_task_ctx *ctx, const double *u, size_t rows, size_t cols, size_t first) {
    double *n = tile(ctx, first, NULL, NULL), *s = tile(ctx, first + 1, NULL, NULL);
    double *w = tile(ctx, first + 2, NULL, NULL), *e = tile(ctx, first + 3, NULL, NULL);
    if (!n || !s || !w || !e) return 2;
    memcpy(n, u, cols * sizeof(double));
    memcpy(s, u + (rows - 1) * cols, cols * sizeof(double));
    for (size_t r = 0; r < rows; r++) {
        w[r] = u[r * cols];
        e[r] = u[r * cols + cols - 1];
    }
    return 0;
}

/* init: u (write), then its four edges (write). args: [nb]. */
static int init_body(const ferry_task_ctx *ctx, void *user) {
    (void)user;
    size_t rows = 0, cols = 0, i = 0, j = 0, nargs = 0;
    const int64_t *args;
    double *u = tile(ctx, 0, &rows, &cols);
    if (!u || ferry_task_coords(ctx, 0, &i, &j) != FERRY_OK || ferry_task_args(ctx, &args, &nargs) != FERRY_OK ||
        nargs != 1)
        return 1;
    size_t nb = (size_t)args[0];
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < cols; c++) u[r * cols + c] = sine_mode(N, i * nb + r, j * nb + c);
    return publish_edges(ctx, u, rows, cols, 1);
}

static double cell(double alpha, double u, double n, double s, double w, double e) {
    return u + alpha * (((n + s) + (w + e)) - 4.0 * u);
}

/* step: old field (read), new field (write), four new edges (write), then the neighbours' old
 * edges that exist, in N, S, W, E order. args: [has N, has S, has W, has E, alpha bits]. */
static int step_body(const ferry_task_ctx *ctx, void *user) {
    (void)user;
    size_t rows = 0, cols = 0, nargs = 0;
    const int64_t *a;
    if (ferry_task_args(ctx, &a, &nargs) != FERRY_OK || nargs != 5) return 1;
    double alpha;
    memcpy(&alpha, &a[4], sizeof alpha);
    const double *u = tile(ctx, 0, &rows, &cols);
    double *out = tile(ctx, 1, NULL, NULL);
    if (!u || !out) return 2;
    double *zr = calloc(cols, sizeof(double)), *zc = calloc(rows, sizeof(double));
    if (!zr || !zc) return 3;
    size_t k = 6;
    const double *north = a[0] ? tile(ctx, k++, NULL, NULL) : zr;
    const double *south = a[1] ? tile(ctx, k++, NULL, NULL) : zr;
    const double *west = a[2] ? tile(ctx, k++, NULL, NULL) : zc;
    const double *east = a[3] ? tile(ctx, k++, NULL, NULL) : zc;
    if (!north || !south || !west || !east) return 4;
    for (size_t r = 0; r < rows; r++) {
        const double *cur = u + r * cols;
        const double *n = r == 0 ? north : u + (r - 1) * cols;
        const double *s = r + 1 == rows ? south : u + (r + 1) * cols;
        double *o = out + r * cols;
        for (size_t c = 0; c < cols; c++) {
            double w = c == 0 ? west[r] : cur[c - 1];
            double e = c + 1 == cols ? east[r] : cur[c + 1];
            o[c] = cell(alpha, cur[c], n[c], s[c], w, e);
        }
    }
    free(zr);
    free(zc);
    return publish_edges(ctx, out, rows, cols, 2);
}

/* The CUDA version of the step and of the edge copy, written as the CPU code above. */
static const char *CUDA_SOURCE =
    "typedef unsigned long long u64;\n"
    "extern \"C\" __global__ void c_step(u64 rows, u64 cols, double alpha, const double *u,\n"
    "    const double *north, const double *south, const double *west, const double *east, double *out) {\n"
    "  u64 total = rows * cols, stride = (u64)gridDim.x * blockDim.x;\n"
    "  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {\n"
    "    u64 r = i / cols, c = i % cols;\n"
    "    double uc = u[i];\n"
    "    double n = r == 0 ? (north ? north[c] : 0.0) : u[i - cols];\n"
    "    double s = r + 1 == rows ? (south ? south[c] : 0.0) : u[i + cols];\n"
    "    double w = c == 0 ? (west ? west[r] : 0.0) : u[i - 1];\n"
    "    double e = c + 1 == cols ? (east ? east[r] : 0.0) : u[i + 1];\n"
    "    out[i] = uc + alpha * (((n + s) + (w + e)) - 4.0 * uc);\n"
    "  }\n"
    "}\n"
    "extern \"C\" __global__ void c_edges(u64 rows, u64 cols, const double *u,\n"
    "    double *n, double *s, double *w, double *e) {\n"
    "  u64 total = rows > cols ? rows : cols, stride = (u64)gridDim.x * blockDim.x;\n"
    "  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {\n"
    "    if (i < cols) { n[i] = u[i]; s[i] = u[(rows - 1) * cols + i]; }\n"
    "    if (i < rows) { w[i] = u[i * cols]; e[i] = u[i * cols + cols - 1]; }\n"
    "  }\n"
    "}\n";

static ferry_kernel K_STEP, K_EDGES;

static int dev_tile(const ferry_task_ctx *ctx, size_t k, void **p, size_t *rows, size_t *cols) {
    size_t r = 0, c = 0;
    if (ferry_task_tile(ctx, k, p, &r, &c) != FERRY_OK) return 1;
    if (rows) *rows = r;
    if (cols) *cols = c;
    return 0;
}

static uint32_t blocks_for(unsigned long long total) {
    unsigned long long b = (total + 255) / 256;
    return (uint32_t)(b < 65536 ? (b ? b : 1) : 65536);
}

/* The step's CUDA body: the same accesses and arguments as step_body, device pointers. */
static int step_cuda(const ferry_task_ctx *ctx, void *user) {
    (void)user;
    size_t rows = 0, cols = 0, nargs = 0;
    const int64_t *a;
    if (ferry_task_args(ctx, &a, &nargs) != FERRY_OK || nargs != 5) return 1;
    double alpha;
    memcpy(&alpha, &a[4], sizeof alpha);
    void *u, *out, *en, *es, *ew, *ee, *halo[4] = {NULL, NULL, NULL, NULL};
    if (dev_tile(ctx, 0, &u, &rows, &cols) || dev_tile(ctx, 1, &out, NULL, NULL) || dev_tile(ctx, 2, &en, NULL, NULL) ||
        dev_tile(ctx, 3, &es, NULL, NULL) || dev_tile(ctx, 4, &ew, NULL, NULL) || dev_tile(ctx, 5, &ee, NULL, NULL))
        return 2;
    size_t k = 6;
    for (int d = 0; d < 4; d++)
        if (a[d] && dev_tile(ctx, k++, &halo[d], NULL, NULL)) return 3;
    unsigned long long r = rows, c = cols;
    void *p1[] = {&r, &c, &alpha, &u, &halo[0], &halo[1], &halo[2], &halo[3], &out};
    uint32_t grid[3] = {blocks_for(r * c), 1, 1}, block[3] = {256, 1, 1};
    if (ferry_task_launch(ctx, K_STEP, grid, block, 0, p1) != FERRY_OK) {
        fprintf(stderr, "stencil.c: %s\n", ferry_last_error());
        return 4;
    }
    void *p2[] = {&r, &c, &out, &en, &es, &ew, &ee};
    uint32_t grid2[3] = {blocks_for(r > c ? r : c), 1, 1};
    if (ferry_task_launch(ctx, K_EDGES, grid2, block, 0, p2) != FERRY_OK) {
        fprintf(stderr, "stencil.c: %s\n", ferry_last_error());
        return 5;
    }
    return 0;
}

typedef struct {
    ferry_collection north, south, west, east;
} edges;

static edges make_edges(ferry_runtime rt, size_t n, size_t nb, size_t mt, size_t nt, ferry_distribution d, int p) {
    edges e;
    char name[32];
    snprintf(name, sizeof name, "north%d", p);
    CHECK(ferry_collection_new(rt, name, FERRY_F64, mt, n, 1, nb, d, &e.north));
    snprintf(name, sizeof name, "south%d", p);
    CHECK(ferry_collection_new(rt, name, FERRY_F64, mt, n, 1, nb, d, &e.south));
    snprintf(name, sizeof name, "west%d", p);
    CHECK(ferry_collection_new(rt, name, FERRY_F64, n, nt, nb, 1, d, &e.west));
    snprintf(name, sizeof name, "east%d", p);
    CHECK(ferry_collection_new(rt, name, FERRY_F64, n, nt, nb, 1, d, &e.east));
    return e;
}

int main(int argc, char **argv) {
    size_t n = 1024, nb = 256, iters = 100;
    double alpha = 0.2;
    for (int k = 1; k + 1 < argc; k += 2) {
        if (!strcmp(argv[k], "--n")) n = strtoull(argv[k + 1], NULL, 10);
        else if (!strcmp(argv[k], "--nb")) nb = strtoull(argv[k + 1], NULL, 10);
        else if (!strcmp(argv[k], "--iters")) iters = strtoull(argv[k + 1], NULL, 10);
        else if (!strcmp(argv[k], "--alpha")) alpha = strtod(argv[k + 1], NULL);
        else {
            fprintf(stderr, "stencil.c: unknown option %s (--n, --nb, --iters, --alpha)\n", argv[k]);
            return 2;
        }
    }
    if (n < 1 || nb < 1 || nb > n || !(alpha > 0.0 && alpha <= 0.25)) {
        fprintf(stderr, "stencil.c: need n >= 1, 1 <= nb <= n, 0 < alpha <= 0.25\n");
        return 2;
    }
    N = n;
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);

    ferry_runtime rt;
    CHECK(ferry_init(&rt));
    int32_t rank, size;
    CHECK(ferry_rank(rt, &rank, &size));
    size_t p, q;
    CHECK(ferry_grid_squarest((size_t)size, &p, &q));
    ferry_distribution d = {FERRY_DIST_BLOCK_2D, p, q, 0};
    ferry_collection fields[2];
    CHECK(ferry_collection_new(rt, "u0", FERRY_F64, n, n, nb, nb, d, &fields[0]));
    CHECK(ferry_collection_new(rt, "u1", FERRY_F64, n, n, nb, nb, d, &fields[1]));
    size_t mt, nt;
    CHECK(ferry_collection_tiles(fields[0], &mt, &nt));
    edges e[2] = {make_edges(rt, n, nb, mt, nt, d, 0), make_edges(rt, n, nb, mt, nt, d, 1)};

    ferry_class init, step;
    CHECK(ferry_class_new(rt, "init", init_body, NULL, NULL, &init));
    CHECK(ferry_cuda_kernel_new(rt, CUDA_SOURCE, "c_step", &K_STEP));
    CHECK(ferry_cuda_kernel_new(rt, CUDA_SOURCE, "c_edges", &K_EDGES));
    CHECK(ferry_class_new(rt, "step", step_body, step_cuda, NULL, &step));
    int64_t nb_arg = (int64_t)nb;
    for (size_t i = 0; i < mt; i++)
        for (size_t j = 0; j < nt; j++) {
            ferry_access acc[5] = {{fields[0], i, j, FERRY_WRITE},   {e[0].north, i, j, FERRY_WRITE},
                                   {e[0].south, i, j, FERRY_WRITE},  {e[0].west, i, j, FERRY_WRITE},
                                   {e[0].east, i, j, FERRY_WRITE}};
            CHECK(ferry_insert(rt, init, acc, 5, &nb_arg, 1, 0, -1));
        }
    CHECK(ferry_wait(rt));

    int64_t alpha_bits;
    memcpy(&alpha_bits, &alpha, sizeof alpha);
    double t0 = MPI_Wtime();
    for (size_t t = 0; t < iters; t++) {
        const edges *old = &e[t % 2], *nw = &e[(t + 1) % 2];
        ferry_collection src = fields[t % 2], dst = fields[(t + 1) % 2];
        for (size_t i = 0; i < mt; i++)
            for (size_t j = 0; j < nt; j++) {
                ferry_access acc[10] = {{src, i, j, FERRY_READ},        {dst, i, j, FERRY_WRITE},
                                        {nw->north, i, j, FERRY_WRITE}, {nw->south, i, j, FERRY_WRITE},
                                        {nw->west, i, j, FERRY_WRITE},  {nw->east, i, j, FERRY_WRITE}};
                size_t k = 6;
                int has[4] = {i > 0, i + 1 < mt, j > 0, j + 1 < nt};
                if (has[0]) acc[k++] = (ferry_access){old->south, i - 1, j, FERRY_READ};
                if (has[1]) acc[k++] = (ferry_access){old->north, i + 1, j, FERRY_READ};
                if (has[2]) acc[k++] = (ferry_access){old->east, i, j - 1, FERRY_READ};
                if (has[3]) acc[k++] = (ferry_access){old->west, i, j + 1, FERRY_READ};
                int64_t args[5] = {has[0], has[1], has[2], has[3], alpha_bits};
                CHECK(ferry_insert(rt, step, acc, k, args, 5, 0, -1));
            }
    }
    CHECK(ferry_wait(rt));
    double seconds = MPI_Wtime() - t0;

    /* Verification on the owners: analytic decay and the Rust driver's bitwise checksum. */
    ferry_collection u = fields[iters % 2];
    double g = pow(sine_mode_decay(n, alpha), (double)iters);
    double max_err = 0.0;
    uint64_t checksum = 0;
    double *buf = malloc(nb * nb * sizeof(double));
    for (size_t i = 0; i < mt; i++)
        for (size_t j = 0; j < nt; j++) {
            int32_t owner;
            size_t rows, cols;
            CHECK(ferry_collection_tile(u, i, j, &owner, &rows, &cols));
            if (owner != rank) continue;
            CHECK(ferry_tile_read(rt, u, i, j, buf, rows * cols * sizeof(double)));
            for (size_t r = 0; r < rows; r++)
                for (size_t c = 0; c < cols; c++) {
                    size_t gi = i * nb + r, gj = j * nb + c;
                    double v = buf[r * cols + c];
                    double want = g * sine_mode(n, gi, gj);
                    double err = fabs(v - want) / fmax(fabs(g), 2.2250738585072014e-308);
                    if (err > max_err) max_err = err;
                    uint64_t bits;
                    memcpy(&bits, &v, sizeof bits);
                    checksum += splitmix64(((uint64_t)(gi * n + gj)) ^ rotl(bits, 17));
                }
        }
    free(buf);
    double max_all;
    uint64_t sum_all;
    MPI_Allreduce(&max_err, &max_all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&checksum, &sum_all, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) {
        printf("stencil.c: %zux%zu grid, %zux%zu tiles (%zux%zu), %zu steps, %d ranks\n", n, n, nb, nb, mt, nt, iters,
               size);
        printf("seconds          %.4f\n", seconds);
        printf("max rel. error   %.3e\n", max_all);
        printf("checksum         %016" PRIx64 "\n", sum_all);
    }
    CHECK(ferry_finalize(rt));
    int initialised, finalized;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalized);
    if (rank == 0) printf("mpi after ferry  %s\n", initialised && !finalized ? "still initialised" : "GONE");
    int bad = !(initialised && !finalized) || !(max_all < 1e-9);
    MPI_Finalize();
    return bad;
}
