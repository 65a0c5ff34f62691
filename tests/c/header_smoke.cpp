// The header compiles as C++ (extern "C" linkage, no C-only constructs) and links.
#include <ferry.h>
#include <cstdio>

static int body(const ferry_task_ctx *ctx, void *) { return ferry_task_device(ctx) == -1 ? 0 : 1; }

int main() {
    ferry_body b = body;
    ferry_access a{ferry_collection{0}, 0, 0, FERRY_READ};
    ferry_distribution d{FERRY_DIST_BLOCK_CYCLIC_2D, 1, 1, 0};
    (void)a;
    (void)d;
    std::printf("%s %s\n", ferry_status_name(FERRY_OK), b != nullptr ? "body" : "none");
    return 0;
}
