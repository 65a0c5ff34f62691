// The copy kernel of ferry's device layer (device/sm_copy.rs), also launched bare by the
// `transfer` benchmark's anchor (ferry-kernels/src/links.rs: sm_pull_gbps). Copy blockIdx.y of
// the table: 16-byte words when both ends are 16-byte aligned, four loads in flight per
// thread, then the remaining bytes (all of them when not aligned) one by one.
typedef unsigned long long u64;
struct ferry_copy { u64 src; u64 dst; u64 len; };
struct ferry_copies { struct ferry_copy c[16]; };
extern "C" __global__ void ferry_copy_batch(struct ferry_copies t, u64 n) {
    u64 k = blockIdx.y;
    if (k >= n) return;
    u64 src = t.c[k].src, dst = t.c[k].dst, len = t.c[k].len;
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
