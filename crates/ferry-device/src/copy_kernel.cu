// The copy kernels of ferry's device layer (device/sm_copy.rs); `ferry_copy_batch` is also
// launched bare by the `transfer` benchmark's anchor (ferry-kernels/src/links.rs:
// sm_pull_gbps). Each grid row copies entry blockIdx.y of the table: 16-byte words when both
// ends are 16-byte aligned, four loads in flight per thread, then the remaining bytes (all of
// them when not aligned) one by one.
typedef unsigned long long u64;
struct ferry_copy { u64 src; u64 dst; u64 len; };
struct ferry_copies { struct ferry_copy c[16]; };
struct ferry_acks { u64 w[16][2]; };
static __device__ __forceinline__ void ferry_copy_one(u64 src, u64 dst, u64 len) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 words = ((src | dst) & 15) == 0 ? len / 16 : 0;
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    for (u64 i = tid; i < words; i += 4 * stride) {
        uint4 v[4];
        #pragma unroll
        for (int j = 0; j < 4; j++) if (i + j * stride < words) v[j] = s[i + j * stride];
        #pragma unroll
        for (int j = 0; j < 4; j++) if (i + j * stride < words) d[i + j * stride] = v[j];
    }
    const unsigned char* sb = (const unsigned char*)src;
    unsigned char* db = (unsigned char*)dst;
    for (u64 i = words * 16 + tid; i < len; i += stride) db[i] = sb[i];
}
extern "C" __global__ void ferry_copy_batch(struct ferry_copies t, u64 n) {
    u64 k = blockIdx.y;
    if (k >= n) return;
    ferry_copy_one(t.c[k].src, t.c[k].dst, t.c[k].len);
}
// The same copies, then the acknowledgement words of IPC pulls (`na` pairs of address and
// value, the producers' words mapped here): written by the last block of the grid to finish, once
// every block has read its sources — the "last block" pattern of CUDA's threadFenceReduction
// sample. `done` is a counter of this device that is zero between launches (the last block
// resets it; launches that share it are ordered on one stream).
extern "C" __global__ void ferry_copy_batch_acked(struct ferry_copies t, u64 n, struct ferry_acks a, u64 na,
                                                  unsigned int* done) {
    u64 k = blockIdx.y;
    if (k < n) ferry_copy_one(t.c[k].src, t.c[k].dst, t.c[k].len);
    __syncthreads();
    if (threadIdx.x == 0) {
        // This block's loads are done (their values are stored) before it is counted.
        __threadfence();
        unsigned int total = gridDim.x * gridDim.y;
        if (atomicAdd(done, 1u) == total - 1) {
            __threadfence_system();
            for (u64 i = 0; i < na && i < 16; i++) *(volatile u64*)a.w[i][0] = a.w[i][1];
            __threadfence_system();
            *done = 0;
        }
    }
}
