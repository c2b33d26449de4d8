// pad_rows.cu - x copied to rows of whole 16-byte pieces of the compute dtype (float16 or bfloat16), zeros after its
// X_COLS features, for a GEMM that reads x as an input part (gemm_layer.cu; python/fusedmlp/_segments.py). Such a
// GEMM copies a part as it is with cp.async when its rows are whole 16-byte pieces of the compute dtype; x of 259
// float16 features (sdf512's, re-injected halfway: 518-byte rows) is not, and the GEMM then converted it element
// pair by element pair through registers on the way in, by the threads that issue the MMAs. This kernel runs once
// before the chain's first GEMM that reads x (one pass over x, a copy written once), and that GEMM copies the copy.
//
// With an input encoding (fm_common.cuh's ENC_COLS, FusedMLP's encoding=) the copy is the encoded x, the layers'
// columns as the fused kernels' loader makes them (fm_encode_input): a thread a staged row, each column from its
// compile-time Enc<C>, so that every GEMM reading x reads the encoding and no GEMM computes one.
//
// Shape of the work: a CTA takes ROWS_CTA consecutive rows of x, which are one contiguous span of memory: it stages
// the span in shared memory with 16-byte loads (bytes where x's start is not 16-byte aligned), then writes each
// padded row in 16-byte pieces, consecutive threads consecutive pieces. Values are converted as the GEMM's own
// converting loads convert them (to float, then the nearest float16 / bfloat16), so the copy holds the same bits.
//
// Plan: {{PLAN_COMMENT}}

#define FM_WARPS {{WARPS}}
constexpr int ROWS_W = 16;  // (fm_common.cuh's input helper, which this kernel does not use, names it)

#include "fm_common.cuh"

constexpr int ROWS_CTA = {{ROWS_CTA}};  // rows of x a CTA
constexpr int XC = {{X_COLS}};          // x's features
constexpr int XR = {{X_ROW}};           // elements a row of the copy: XC rounded up to whole 16-byte pieces
constexpr int PIECES = XR / 8;          // 16-byte pieces a row of the copy
constexpr int XB = XC * (int)sizeof(in_t);  // bytes a row of x
static_assert((FM_PREC <= 1 && FM_OUT_TYPE == FM_PREC + 1) || (FM_PREC >= 3 && FM_OUT_TYPE == 1 && ENC_COLS > 0),
              "the copy is in the 16-bit compute dtype (float16 for an 8-bit network's encoded x)");
static_assert(FM_IN_TYPE <= 2 && XR % 8 == 0 && (ENC_COLS ? XR >= ENC_COLS && XR - ENC_COLS < 8 && XC == IN_REAL
                                                          : XR >= XC && XR - XC < 8), "rows of whole 16-byte pieces");

// Columns [C, XR) of an encoded row whose features are v, as pairs packed into w (zeros past ENC_COLS).
template <int C>
__device__ __forceinline__ void fm_encode_pairs(fm_u32 *w, const float (&v)[ENC_X]) {
    if constexpr (C < XR) {
        float f[2];
#pragma unroll
        for (int j = 0; j < 2; ++j)
            f[j] = 0.0f;
        if constexpr (C < ENC_COLS)
            f[0] = fm_enc_value<C>(v);
        if constexpr (C + 1 < ENC_COLS)
            f[1] = fm_enc_value<C + 1>(v);
        w[C / 2] = fm_pack2<FM_OUT_TYPE>(f[0], f[1]);
        fm_encode_pairs<C + 2>(w, v);
    }
}
static_assert(ROWS_CTA * XB == SMEM_BYTES, "the plan's shared memory is the staged rows (gemm.c)");

// x's rows as they are, each padded with zeros to XR: consecutive threads consecutive 16-byte pieces.
__device__ __forceinline__ void fm_copy_rows(const in_t *staged, out_t *__restrict__ y, long long r0, int nr) {
    for (int c = threadIdx.x; c < nr * PIECES; c += THREADS) {
        const int r = c / PIECES, k = (c % PIECES) * 8;
        fm_u32 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = k + 2 * j;
            const float v0 = col < XC ? fm_in_to_f(staged[r * XC + col]) : 0.0f;
            const float v1 = col + 1 < XC ? fm_in_to_f(staged[r * XC + col + 1]) : 0.0f;
            v[j] = fm_pack2<FM_OUT_TYPE>(v0, v1);
        }
        fm_stg16(y + (r0 + r) * XR + k, fm_v4{v[0], v[1], v[2], v[3]});
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, FM_BLOCKS_PER_SM)
{{KERNEL_NAME}}(const void *__restrict__ x,      // rows x XC of FM_IN_TYPE
                out_t *__restrict__ y,            // rows x XR of the compute dtype: the copy
                const act_t *__restrict__ w,      // (unused)
                const float *__restrict__ bias,   // (unused)
                long long rows,                   // batch size, >= 1
                const void *__restrict__ x1,      // (unused)
                const void *__restrict__ res)     // (unused)
{
    (void)w;
    (void)bias;
    (void)x1;
    (void)res;
    extern __shared__ __attribute__((aligned(16))) unsigned char fm_smem_raw[];
    fm_grid_wait();  // (fm_common.cuh) the kernel before this one on the stream is done: x may be read, y written
    fm_grid_release();
    const long long r0 = (long long)blockIdx.x * ROWS_CTA;
    const int nr = rows - r0 < ROWS_CTA ? (int)(rows - r0) : ROWS_CTA;
    const int bytes = nr * XB;
    const unsigned char *src = (const unsigned char *)x + r0 * XB;
    if (((unsigned long long)src & 15) == 0) {
        const int whole = bytes & ~15;
        for (int i = threadIdx.x * 16; i < whole; i += THREADS * 16)
            *(fm_v4 *)(fm_smem_raw + i) = *(const fm_v4 *)(src + i);
        for (int i = whole + threadIdx.x; i < bytes; i += THREADS)
            fm_smem_raw[i] = src[i];
    } else {  // x's start not 16-byte aligned (a view into a larger array): its elements one by one
        for (int i = threadIdx.x; i < nr * XC; i += THREADS)
            ((in_t *)fm_smem_raw)[i] = ((const in_t *)src)[i];
    }
    __syncthreads();
    const in_t *staged = (const in_t *)fm_smem_raw;  // the CTA's rows of x
    if constexpr (ENC_COLS > 0) {
        for (int r = threadIdx.x; r < nr; r += THREADS) {
            float v[ENC_X];
#pragma unroll
            for (int i = 0; i < ENC_X; ++i)
                v[i] = fm_in_to_f(staged[r * XC + i]);
            fm_u32 w[XR / 2];
            fm_encode_pairs<0>(w, v);
#pragma unroll
            for (int k = 0; k < PIECES; ++k)
                fm_stg16(y + (r0 + r) * XR + 8 * k, fm_v4{w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]});
        }
    } else {
        fm_copy_rows(staged, y, r0, nr);
    }
}

