template <int N> struct fm_wgmma;  // fm_wgmma<N>::run(d, a, desc, scale_d): d (+)= A(64x16) * B(16xN)
{{WGMMA}}

__device__ __forceinline__ void fm_wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void fm_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void fm_wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Pins accumulator registers around the asynchronous MMA, so the compiler neither reads them early nor moves them.
template <int N> __device__ __forceinline__ void fm_fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+f"(d[i])::"memory");
}
template <int N> __device__ __forceinline__ void fm_fence_regs(fm_u32 (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            asm volatile("" : "+r"(a[i][j])::"memory");
}

// The shared-memory descriptor of a K-major no-swizzle matrix starting at byte address `addr`: start address, LBO
// (bytes to the next core matrix along k) and SBO (to the next 8 rows), each in 16-byte units.
__device__ __forceinline__ unsigned long long fm_desc2(fm_u32 addr, fm_u32 lbo, fm_u32 sbo) {
    return (unsigned long long)((addr >> 4) & 0x3FFFu) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32);
}
// B's: the weight rows, whose core matrices along k are contiguous (LBO 128 bytes).
__device__ __forceinline__ unsigned long long fm_desc(fm_u32 addr, fm_u32 sbo) { return fm_desc2(addr, 128u, sbo); }