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
// - Input: each warp's next 16 rows of x are in flight (cp.async) while it computes the current ones: straight into
//   its input buffer's rows when x is already act_t in rows of whole 16-byte pieces (tcnn64, tcnn128 and res128 in
//   float16), otherwise as raw bytes converted into the input buffer when they are needed. The first layer's A
//   fragments come from the input buffer by ldmatrix. Without the prefetch, the wait for x was tcnn64's largest
//   stall (ncu, H100: long scoreboard), with only 4 warps per scheduler to hide it.
//
// Plan: {{PLAN_COMMENT}}

#define FM_WARPS {{WARPS}}
constexpr int ROWS_W = 16;  // rows per warp
static_assert({{M_TILES}} == 1 && {{RESIDENT}} == 1 && {{BUFFERS}} == 1 && {{W_SLOT_ELEMS}} == 0,
              "the wgmma plan: 16 rows per warp, resident weights, its own per-warp buffers");

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

// Whether any of layers 0..L adds a residual.
template <int L> __device__ constexpr bool fm_has_residual() {
    if constexpr (L < 0)
        return false;
    else
        return Layer<L>::RES != 0 || fm_has_residual<L - 1>();
}

// Columns [C0, C0 + W) of layer L for this warpgroup's 64 rows, W = min(NC, N - C0): one wgmma group over the whole
// input, then the epilogue into the output fragments (h: the next layer's A, one [4] per 16 columns) or, for the last
// layer, into the warp's output stage; then the next group. A layer is one group unless a forced n_chunk splits it
// (NC < N). In the source each group is waited for and its epilogue run before the next starts, but ptxas issues the
// next group's MMAs before the previous group's epilogue (the register fences are empty asm it does not see), so the
// groups' accumulators are live together and a split saves no registers (bench/NOTES.md, v15). a: the layer's input
// fragments; w: the layer's first weight byte (shared window); stage: this lane's byte address in the warp's stage at
// (row g, col 0).
template <int L, int C0>
__device__ __forceinline__ void fm_layer_cols(fm_u32 (&a)[Layer<L>::K / 16][4], fm_u32 (&h)[Layer<L>::N / 16][4],
                                              fm_u32 w, const float *bias, fm_u32 stage, int lane) {
    typedef Layer<L> Ly;
    constexpr int W = Ly::N - C0 < Ly::NC ? Ly::N - C0 : Ly::NC;
    static_assert(W % 16 == 0 && C0 % 16 == 0, "whole 16-column groups");
    constexpr int KS = Ly::K / 16;               // k16 steps
    constexpr fm_u32 SBO = Ly::K * EB * 8;       // bytes from one 8-row group of weights to the next
    // The accumulators start at the bias (then every k step accumulates): no FADDs in the epilogue, and the bias
    // values' registers are the accumulators (flex's 128 bytes of spills went). Not in networks with residuals:
    // there ptxas hoists the next layer's bias loads while the input fragments are still live (res128 at 12 warps
    // went from 159 registers to 168 and 228 bytes of spills).
    constexpr bool BIAS_IN_D = Ly::BIAS && !fm_has_residual<LAST>();
    // A group of a split layer always starts from accumulators this thread wrote (the bias, or zeros): with scale-d
    // 0 on the first k step (the instruction ignores the accumulators' old values), the second group of a split
    // layer came out wrong on the H100 (NVRTC 13, bench/wgmma_split_diag.py: every split layer without a bias in
    // the accumulators, every group after the first reusing the first's registers).
    constexpr bool D_SET = BIAS_IN_D || W < Ly::N;
    const int t = lane & 3;
    float d[W / 2];  // this lane's (row g + 8 hh, cols C0 + 8 j + 2 t, + 1) at d[4 j + 2 hh], d[4 j + 2 hh + 1]
    if constexpr (D_SET) {
#pragma unroll
        for (int j = 0; j < W / 8; ++j) {
            const int col = C0 + 8 * j + 2 * t;
            const float b0 = BIAS_IN_D ? bias[Ly::B_OFF + col] : 0.0f, b1 = BIAS_IN_D ? bias[Ly::B_OFF + col + 1] : 0.0f;
            d[4 * j] = d[4 * j + 2] = b0;
            d[4 * j + 1] = d[4 * j + 3] = b1;
        }
    }
    const unsigned long long desc = fm_desc(w + (C0 / 8) * SBO, SBO);  // the group's W weight rows
    fm_fence_regs(a);
    fm_wg_fence();
#pragma unroll
    for (int s = 0; s < KS; ++s)  // k step s: two core matrices (32 bytes of k) further along each row group
        fm_wgmma<W>::run(d, a[s], desc + (unsigned long long)(s * 2 * 128 / 16), s > 0 || D_SET ? 1 : 0);
    fm_wg_commit();
    fm_fence_regs(d);
    fm_wg_wait();
    fm_fence_regs(d);
    fm_fence_regs(a);

#pragma unroll
    for (int j = 0; j < W / 8; ++j) {     // 8-column tile J of the output
        const int J = C0 / 8 + j;
        const int col = 8 * J + 2 * t;     // this lane's columns col, col + 1 in rows g and g + 8
        float b0 = 0.0f, b1 = 0.0f;  // the bias of a network with residuals is added here
        if constexpr (Ly::BIAS && !BIAS_IN_D) {
            b0 = bias[Ly::B_OFF + col];
            b1 = bias[Ly::B_OFF + col + 1];
        }
        const bool live = Ly::NR == Ly::N || 8 * J < Ly::NR;  // compile-time: a padding tile writes zeros
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float v0 = d[4 * j + 2 * hh], v1 = d[4 * j + 2 * hh + 1], r0 = 0.0f, r1 = 0.0f;
            if constexpr (Ly::BIAS && !BIAS_IN_D) {
                v0 += b0;
                v1 += b1;
            }
            if constexpr (Ly::RES != 0)  // the own input at the same (row, col): fragment J/2, half J%2
                fm_unpack2(a[J / 2][(J % 2) * 2 + hh], r0, r1);
            if constexpr (L == LAST) {
                const fm_u32 addr = stage + 8 * hh * STAGE_STRIDE * (int)sizeof(out_t) + col * (int)sizeof(out_t);
                if constexpr (FM_OUT_TYPE == 0) {
                    if (live)
                        fm_epilogue<L>(v0, v1, r0, r1, col);
                    else
                        v0 = v1 = 0.0f;
                    fm_st_out2(addr, v0, v1);
                } else {
                    fm_st_shared(addr, live ? fm_epilogue16<L, FM_OUT_TYPE>(v0, v1, r0, r1, col) : 0u);
                }
            } else {
                h[J / 2][(J % 2) * 2 + hh] = live ? fm_epilogue16<L, FM_PREC + 1>(v0, v1, r0, r1, col) : 0u;
            }
        }
    }
    if constexpr (C0 + W < Ly::N)
        fm_layer_cols<L, C0 + W>(a, h, w, bias, stage, lane);
}

// Layer L for this warpgroup's 64 rows (see fm_layer_cols).
template <int L>
__device__ __forceinline__ void fm_layer(fm_u32 (&a)[Layer<L>::K / 16][4], fm_u32 (&h)[Layer<L>::N / 16][4], fm_u32 w,
                                         const float *bias, fm_u32 stage, int lane) {
    static_assert(Layer<L>::A1_BUF < 0 && (Layer<L>::RES == 0 || Layer<L>::K == Layer<L>::N),
                  "no concat; residuals from the own input");
    fm_layer_cols<L, 0>(a, h, w, bias, stage, lane);
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

// ------------------------------------------------------------------------------------------------ input

// Per warp: the input buffer (ROWS_W rows of ROW_B: x as act_t, padding columns zero), the output stage (as large),
// and, unless x's rows land in the input buffer verbatim (IN_DIRECT), a raw buffer holding the warp's 16 rows of x
// as they are in global memory (contiguous: a strip of x is one run of bytes).
constexpr bool IN_DIRECT = IN_RAW && (IN_REAL * EB) % 16 == 0;
constexpr int RAW_B = IN_DIRECT ? 0 : (ROWS_W * IN_REAL * (int)sizeof(in_t) + 15) / 16 * 16;
constexpr int BUF_B = ROWS_W * ROW_B;
constexpr int WARP_B = 2 * BUF_B + RAW_B;
static_assert(W_SMEM_ELEMS * EB + B_FLOATS * 4 + FM_WARPS * WARP_B == SMEM_BYTES,
              "the layout below is the plan's (plan.c, fm_plan_wgmma_layout and fm_plan_wgmma_raw_bytes)");

__device__ __forceinline__ void fm_copy16_async(fm_u32 dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// The 16 bytes at dst: the first n elements of src (in_t), then zeros; synchronous. For the piece that straddles the
// end of x, where a cp.async would name bytes past it (its src-size form zero-fills them, but still names them, and
// compute-sanitizer reports that as an out-of-bounds read).
__device__ __forceinline__ void fm_copy16_tail(fm_u32 dst, const in_t *src, int n) {
    fm_u32 w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if constexpr (sizeof(in_t) == 4) {
            w[k] = k < n ? __float_as_uint(src[k]) : 0u;
        } else {
            const fm_u32 lo = 2 * k < n ? (fm_u32)src[2 * k] : 0u, hi = 2 * k + 1 < n ? (fm_u32)src[2 * k + 1] : 0u;
            w[k] = lo | (hi << 16);
        }
    }
    fm_st_shared(dst, w[0], w[1]);
    fm_st_shared(dst + 8, w[2], w[3]);
}

// Starts this warp's copy of x rows [r0, r0 + 16) into its input buffer (IN_DIRECT: each row's 16-byte pieces to
// its padded row) or raw buffer (the strip's bytes), as one cp.async group, so that it lands while the warp computes
// the tile before. What lies past the end of x is written as zeros.
__device__ __forceinline__ void fm_prefetch_x(fm_u32 in_buf, fm_u32 raw, const in_t *__restrict__ x, long long r0,
                                              long long rows, int lane) {
    if constexpr (IN_DIRECT) {
        constexpr int PIECES = IN_REAL * EB / 16;  // per row
#pragma unroll
        for (int i = lane; i < ROWS_W * PIECES; i += 32) {
            const int row = i / PIECES, c = i % PIECES;
            const fm_u32 dst = in_buf + row * ROW_B + 16 * c;
            if (r0 + row < rows) {
                fm_copy16_async(dst, x + (r0 + row) * IN_REAL + c * (16 / EB));
            } else {
                fm_st_shared(dst, 0u, 0u);
                fm_st_shared(dst + 8, 0u, 0u);
            }
        }
    } else {
        constexpr int E16 = 16 / (int)sizeof(in_t);  // elements per 16-byte piece
        const long long first = r0 * IN_REAL, end = rows * IN_REAL;  // elements of x (a strip starts 16-byte aligned)
#pragma unroll
        for (int i = lane; i < RAW_B / 16; i += 32) {
            const long long at = first + (long long)E16 * i;
            if (end - at >= E16)
                fm_copy16_async(raw + 16 * i, x + at);
            else
                fm_copy16_tail(raw + 16 * i, x + at, end > at ? (int)(end - at) : 0);
        }
    }
    fm_copy_commit();
}

// ------------------------------------------------------------------------------------------------ the network

extern "C" __global__ void __launch_bounds__(THREADS, FM_BLOCKS_PER_SM)
{{KERNEL_NAME}}(const in_t *__restrict__ x,       // rows x IN_REAL, row-major, 16-byte aligned
                out_t *__restrict__ y,            // rows x OUT_REAL, row-major, 16-byte aligned
                const act_t *__restrict__ w,      // packed weights: W_OFF/K/N of each Layer<l>, core-matrix layout
                const float *__restrict__ bias,   // packed biases: B_OFF/N of each Layer<l>
                long long rows)                   // batch size, >= 1
{
    // Shared memory: [weights | biases | per warp: input buffer, output stage, raw x (WARP_B bytes)].
    extern __shared__ __attribute__((aligned(128))) unsigned char fm_smem_raw[];
    act_t *s_w = (act_t *)fm_smem_raw;
    float *s_bias = (float *)(s_w + W_SMEM_ELEMS);
    unsigned char *s_warps = (unsigned char *)(s_bias + B_FLOATS);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wg = warp >> 2, wq = warp & 3;  // warpgroup, and this warp's quarter (rows 16 * wq..) of its 64 rows
    act_t *in_buf = (act_t *)(s_warps + warp * WARP_B);
    act_t *out_buf = (act_t *)(s_warps + warp * WARP_B + BUF_B);
    const in_t *raw = (const in_t *)(s_warps + warp * WARP_B + 2 * BUF_B);
    const fm_u32 in_addr = fm_smem_addr(in_buf), out_addr = fm_smem_addr(out_buf), raw_addr = in_addr + 2 * BUF_B;

    for (int i = threadIdx.x; i < B_FLOATS; i += THREADS)
        s_bias[i] = bias[i];
    fm_copy_block(s_w, w, W_SMEM_ELEMS);
    fm_copy_commit();
    // The input buffer's padding columns stay zero: only x's columns are ever written into it.
    for (int i = lane; i < BUF_B / 16; i += 32)
        *(fm_v4 *)((unsigned char *)in_buf + 16 * i) = fm_v4{0u, 0u, 0u, 0u};
    __syncwarp();
    const long long tiles = (rows + ROWS_CTA - 1) / ROWS_CTA;
    const int strip = wg * 64 + wq * ROWS_W;  // this warp's first row in a tile
    if ((long long)blockIdx.x < tiles)
        fm_prefetch_x(in_addr, raw_addr, x, blockIdx.x * (long long)ROWS_CTA + strip, rows, lane);
    fm_copy_wait<1>();  // the weights (the older group)
    // The weights were written through the generic proxy; wgmma reads them through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();

    const fm_u32 w_base = fm_smem_addr(s_w);
    const fm_u32 a_lane = in_addr + (lane & 15) * ROW_B + (lane >> 4) * 16;  // ldmatrix roles, as in fused_mlp.cu
    const fm_u32 stage = out_addr + (lane >> 2) * STAGE_STRIDE * (int)sizeof(out_t);
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const long long r0 = tile * ROWS_CTA + strip;
        const long long left = rows - r0;
        const int nrows = left <= 0 ? 0 : (left < ROWS_W ? (int)left : ROWS_W);
        fm_copy_wait<0>();  // this lane's part of the tile's x has landed
        __syncwarp();       // and every lane's
        if constexpr (!IN_DIRECT) {
            fm_load_input<false>(in_buf, raw, 0, ROWS_W, lane);  // rows past x arrived as zeros
            __syncwarp();
        }
        fm_u32 a[IN_PAD / 16][4];
#pragma unroll
        for (int s = 0; s < IN_PAD / 16; ++s)
            fm_ldmatrix_x4(a[s], a_lane + s * 32);
        __syncwarp();  // every lane has its fragments before the next tile's x lands over them
        if (tile + gridDim.x < tiles)
            fm_prefetch_x(in_addr, raw_addr, x, r0 + (long long)gridDim.x * ROWS_CTA, rows, lane);
        fm_network<0>(a, w_base, s_bias, stage, lane);
        __syncwarp();
        if (nrows > 0)
            fm_store_output(y, out_buf, r0, nrows, lane);
        __syncwarp();  // the stage is read before the next tile's last layer writes it
    }
}
