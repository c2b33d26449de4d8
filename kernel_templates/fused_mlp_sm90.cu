// fused_mlp_sm90.cu - the fused MLP forward for sm_90a (Hopper): warpgroup MMA, activations in registers.
//
// Rendered by csrc/render.c like fused_mlp.cu (the mma.sync kernel, which runs everywhere else and every network
// this one does not take: plan.c, fm_plan_wgmma_unfit). Compiled by NVRTC for sm_90a.
//
// Why a second kernel: mma.sync reads each weight fragment from shared memory once per 16 or 32 rows and round-trips
// every activation through shared memory; on an H100 that kept the tensor pipe about half busy. wgmma reads the
// weights once per 64 rows straight from shared memory (a descriptor, no registers), and the fp32 accumulator
// fragment of one layer is, element for element, the A fragment of the next: a thread holds (row g, cols 2t, 2t+1)
// and (row g+8, same cols) of each 8-column tile in both. So between layers the activations never leave registers.
//
// Shape of the work:
// - A CTA is WARPS/4 warpgroups; each owns 64 consecutive rows of a row tile (warp w of it: rows 16w..16w+15) and
//   a persistent grid loops over row tiles. Warpgroups run their layers independently: while one waits on its MMAs,
//   another's epilogue (bias, activation, packing) issues, which is what keeps the tensor pipe fed.
// - Weights (all layers, resident) sit in shared memory in wgmma's K-major no-swizzle layout: 8 rows x 16 bytes core
//   matrices of 128 contiguous bytes, k fastest (LBO = 128 bytes, SBO = K * EB * 8 bytes); packed so on the host
//   (plan.c, fm_plan_w_index) and copied flat.
// - Each layer: one wgmma m64nNk16 per 16 inputs (A from registers, fp32 accumulators, N up to 256), then in
//   registers: bias, activation, the residual y = post(act(.) op r) with r the layer's
//   own input (the same thread holds the same (row, col) of it), padded columns forced to zero, packed to the next
//   layer's A fragments. The last layer writes out_t to a per-warp stage for coalesced stores.
// - Input: each warp copies its 16 rows of x into its stage buffer (converting, zero-padding) and reads the first
//   layer's A fragments with ldmatrix.
//
// Plan: {{PLAN_COMMENT}}

#define FM_WARPS {{WARPS}}
constexpr int ROWS_W = 16;  // rows per warp
static_assert({{M_TILES}} == 1 && {{RESIDENT}} == 1 && {{BUFFERS}} == 1 && {{W_SLOT_ELEMS}} == 0,
              "the wgmma plan: 16 rows per warp, resident weights, one stage buffer per warp");

#include "fm_common.cuh"

static_assert(FM_WARPS % 4 == 0, "whole warpgroups");
static_assert(FM_PREC != 2, "the wgmma kernel takes float16 or bfloat16");
constexpr int WGS = FM_WARPS / 4;      // warpgroups per CTA
constexpr int ROWS_CTA = 64 * WGS;     // rows per CTA tile

// ------------------------------------------------------------------------------------------------ wgmma

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

// The shared-memory descriptor of B, the rows of a K-major no-swizzle weight matrix starting at byte address
// `addr`: start address, LBO (next core matrix along k) and SBO (next 8 rows), each in 16-byte units.
__device__ __forceinline__ unsigned long long fm_desc(fm_u32 addr, fm_u32 sbo) {
    return (unsigned long long)((addr >> 4) & 0x3FFFu) | ((unsigned long long)(128u >> 4) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32);
}

// ------------------------------------------------------------------------------------------------ the layers

// Layer L for this warpgroup's 64 rows: one wgmma group over the whole input, then the epilogue into the output
// fragments (h: the next layer's A, one [4] per 16 columns) or, for the last layer, into the warp's output stage.
// a: the layer's input fragments; w: the layer's first weight byte (shared window); stage: this lane's byte address
// in the warp's stage at (row g, col 0).
template <int L>
__device__ __forceinline__ void fm_layer(fm_u32 (&a)[Layer<L>::K / 16][4], fm_u32 (&h)[Layer<L>::N / 16][4], fm_u32 w,
                                         const float *bias, fm_u32 stage, int lane) {
    typedef Layer<L> Ly;
    static_assert(Ly::A1_BUF < 0 && (Ly::RES == 0 || Ly::K == Ly::N), "no concat; residuals from the own input");
    static_assert(Ly::NC == Ly::N, "one wgmma group per layer");
    constexpr int KS = Ly::K / 16;               // k16 steps
    constexpr fm_u32 SBO = Ly::K * EB * 8;       // bytes from one 8-row group of weights to the next
    float d[Ly::N / 2];
    const unsigned long long desc = fm_desc(w, SBO);
    fm_fence_regs(a);
    fm_wg_fence();
#pragma unroll
    for (int s = 0; s < KS; ++s)  // k step s: two core matrices (32 bytes of k) further along each row group
        fm_wgmma<Ly::N>::run(d, a[s], desc + (unsigned long long)(s * 2 * 128 / 16), s > 0 ? 1 : 0);
    fm_wg_commit();
    fm_fence_regs(d);
    fm_wg_wait();
    fm_fence_regs(d);
    fm_fence_regs(a);

    const int t = lane & 3;
#pragma unroll
    for (int j = 0; j < Ly::N / 8; ++j) {  // 8-column tile j of the output
        const int col = 8 * j + 2 * t;     // this lane's columns col, col + 1 in rows g and g + 8
        float b0 = 0.0f, b1 = 0.0f;
        if constexpr (Ly::BIAS) {
            b0 = bias[Ly::B_OFF + col];
            b1 = bias[Ly::B_OFF + col + 1];
        }
        const bool live = Ly::NR == Ly::N || 8 * j < Ly::NR;  // compile-time: a padding tile writes zeros
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float v0 = 0.0f, v1 = 0.0f;
            if (live) {
                v0 = Ly::act(d[4 * j + 2 * hh] + b0);
                v1 = Ly::act(d[4 * j + 2 * hh + 1] + b1);
                if constexpr (Ly::RES != 0) {  // the own input at the same (row, col): fragment j/2, half j%2
                    float r0, r1;
                    fm_unpack2(a[j / 2][(j % 2) * 2 + hh], r0, r1);
                    v0 = Ly::post(Ly::RES == 1 ? v0 + r0 : v0 * r0);
                    v1 = Ly::post(Ly::RES == 1 ? v1 + r1 : v1 * r1);
                }
                if constexpr (Ly::NR < Ly::N) {
                    if (col >= Ly::NR) v0 = 0.0f;
                    if (col + 1 >= Ly::NR) v1 = 0.0f;
                }
            }
            if constexpr (L == LAST)
                fm_st_out2(stage + 8 * hh * STAGE_STRIDE * (int)sizeof(out_t) + col * (int)sizeof(out_t), v0, v1);
            else
                h[j / 2][(j % 2) * 2 + hh] = fm_pack2<FM_PREC + 1>(v0, v1);
        }
    }
}

// Layers L.. for this warpgroup's 64 rows, from layer L's input fragments a.
template <int L>
__device__ __forceinline__ void fm_network(fm_u32 (&a)[Layer<L>::K / 16][4], fm_u32 w_base, const float *bias,
                                           fm_u32 stage, int lane) {
    fm_u32 h[Layer<L>::N / 16][4];
    fm_layer<L>(a, h, w_base + EB * Layer<L>::W_OFF, bias, stage, lane);
    if constexpr (L < LAST) {
        static_assert(Layer<L + 1>::K == Layer<L>::N, "a layer's input is the previous layer's output");
        fm_network<L + 1>(h, w_base, bias, stage, lane);
    }
}

// ------------------------------------------------------------------------------------------------ the network

extern "C" __global__ void __launch_bounds__(THREADS, FM_BLOCKS_PER_SM)
{{KERNEL_NAME}}(const in_t *__restrict__ x,       // rows x IN_REAL, row-major, 16-byte aligned
                out_t *__restrict__ y,            // rows x OUT_REAL, row-major, 16-byte aligned
                const act_t *__restrict__ w,      // packed weights: W_OFF/K/N of each Layer<l>, core-matrix layout
                const float *__restrict__ bias,   // packed biases: B_OFF/N of each Layer<l>
                long long rows)                   // batch size, >= 1
{
    // Shared memory: [weights | biases | one stage buffer per warp (ROWS_W x ACT_STRIDE act_t)].
    extern __shared__ __attribute__((aligned(128))) unsigned char fm_smem_raw[];
    act_t *s_w = (act_t *)fm_smem_raw;
    float *s_bias = (float *)(s_w + W_SMEM_ELEMS);
    act_t *s_stage = (act_t *)(s_bias + B_FLOATS);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wg = warp >> 2, wq = warp & 3;  // warpgroup, and this warp's quarter (rows 16 * wq..) of its 64 rows
    act_t *buf = s_stage + warp * ROWS_W * ACT_STRIDE;
    const fm_u32 buf_addr = fm_smem_addr(buf);

    for (int i = threadIdx.x; i < B_FLOATS; i += THREADS)
        s_bias[i] = bias[i];
    fm_copy_block(s_w, w, W_SMEM_ELEMS);
    fm_copy_commit();
    fm_copy_wait<0>();
    // The weights were written through the generic proxy; wgmma reads them through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();

    const fm_u32 w_base = fm_smem_addr(s_w);
    const fm_u32 a_lane = buf_addr + (lane & 15) * ROW_B + (lane >> 4) * 16;  // ldmatrix roles, as in fused_mlp.cu
    const fm_u32 stage = buf_addr + (lane >> 2) * STAGE_STRIDE * (int)sizeof(out_t);
    const long long tiles = (rows + ROWS_CTA - 1) / ROWS_CTA;
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const long long r0 = tile * ROWS_CTA + wg * 64 + wq * ROWS_W;
        const long long left = rows - r0;
        const int nrows = left <= 0 ? 0 : (left < ROWS_W ? (int)left : ROWS_W);
        fm_load_input(buf, x, r0, nrows, lane);
        __syncwarp();
        fm_u32 a[IN_PAD / 16][4];
#pragma unroll
        for (int s = 0; s < IN_PAD / 16; ++s)
            fm_ldmatrix_x4(a[s], a_lane + s * 32);
        __syncwarp();  // every lane has its fragments before the output stage overwrites the input
        fm_network<0>(a, w_base, s_bias, stage, lane);
        __syncwarp();
        if (nrows > 0)
            fm_store_output(y, buf, r0, nrows, lane);
        __syncwarp();
    }
}
