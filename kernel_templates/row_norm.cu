// row_norm.cu - the second half of a norm layer that runs as a GEMM: a LayerNorm / RMSNorm (or a softmax / log_softmax,
// fm_soft_row) of z = W h + b over the layer's NR columns, then the rest of the layer's epilogue, y = post(act(norm(z)
// * gamma + beta) op r), converted to y's dtype. A GEMM computes a row in tiles of columns and cannot see a row's
// statistics, so a norm layer no fused kernel holds (wider than 256 features, or past a cut) is two kernels: the GEMM
// with the epilogue cut before the norm (bias only; a layernorm's weights and bias stored less their means over the
// outputs, so z has a near-zero row mean and rounding it to the compute dtype's storage costs its bits of the
// deviations only: python/fusedmlp/_api.py, _prenorm_net), which writes z once; then this kernel, which reads each row
// of z once and writes the layer's output once. That is the traffic of PyTorch's best form of the same layer
// (torch.compile: a GEMM, then one fused norm-and-activation kernel). An 8-bit network's z is float16 (of its weights'
// codes; a layernorm's bias less its mean alone), its residual operand codes or x, and its output the next layer's
// codes, as its GEMMs' are (gemm_layer.cu).
//
// Shape of the work: a warp a row (FM_WARPS rows a CTA, one CTA per FM_WARPS rows). The lanes take the row's chunks
// of VE elements in turn (chunk c at lane c % 32), VE the widest of 8, 4, 2, 1 that divides NR, so a warp's load is
// 32 consecutive chunks and every access is aligned (the rows of z, y and the residual operand all start at
// multiples of NR elements; the pointers are 16-byte aligned). Up to 64 values a lane (NR <= 2048) the row stays in
// registers: the statistics in two passes over them (the variance about the mean, not E[z^2] - mean^2), then the
// output. A wider row is read twice (its statistics with sums about the row's first element, then the output; the
// second read mostly hits L1/L2).
//
// Plan: {{PLAN_COMMENT}}

#define FM_WARPS {{WARPS}}
#define FM_RES_TYPE {{RES_TYPE}}  // the residual operand in global memory (-1: no residual), fm_dtype codes
constexpr int ROWS_W = 16;        // (fm_common.cuh's input helper, which this kernel does not use, names it)

#include "fm_common.cuh"

typedef Layer<0> Ly;
static_assert(Ly::NORM >= 1 && Ly::NORM <= 4, "a norm layer's second pass");
// z in float32 or 16 bits (an 8-bit network's in float16: csrc/gemm.c, fm_plan_gemm_norm); an 8-bit network's residual
// operand and result may be its codes (FM_RES_TYPE / FM_OUT_TYPE 3: times RSCALE, times QOUT)
static_assert(FM_IN_TYPE <= 2 && (FM_PREC >= 3 || (FM_OUT_TYPE <= 2 && FM_RES_TYPE <= 2)), "codes are 8-bit only");
constexpr int NR = Ly::NR, NP = Ly::N;  // gamma at bias[NP], beta at bias[2 NP] (fm_plan_pack_norms)
constexpr int VE = NR % 8 == 0 ? 8 : NR % 4 == 0 ? 4 : NR % 2 == 0 ? 2 : 1;  // elements a chunk
constexpr int NCH = NR / VE, CPL = (NCH + 31) / 32;                          // chunks a row, a lane
constexpr bool IN_REGS = CPL * VE <= 64;

// VE elements of global type TY (0 float32, 1 float16, 2 bfloat16; 3 an 8-bit network's codes) from element i of p, as
// floats; p + i is aligned to the whole access (VE * size bytes, at most 16 a load).
template <int TY> __device__ __forceinline__ void fm_ldv(const void *p, long long i, float (&f)[VE]) {
#if FM_PREC >= 3
    if constexpr (TY == 3) {  // an 8-bit network's codes: their values, not yet times their scale
        const unsigned char *q = (const unsigned char *)p + i;
        fm_u32 w[VE / 4 > 0 ? VE / 4 : 1];
        if constexpr (VE == 8) {
            const fm_v2 v = *(const fm_v2 *)q;
            w[0] = v.x, w[1] = v.y;
        } else if constexpr (VE == 4) {
            w[0] = *(const fm_u32 *)q;
        } else if constexpr (VE == 2) {
            w[0] = *(const unsigned short *)q;
        } else {
            w[0] = *q;
        }
#pragma unroll
        for (int j = 0; j < VE; j += 2) {  // (VE is 1 or even)
            float lo, hi;
            fm_code2_to_f((unsigned short)(w[j / 4] >> (8 * (j % 4))), lo, hi);
            f[j] = lo;
            if constexpr (VE > 1)
                f[j + 1] = hi;
        }
        return;
    }
#endif
    if constexpr (TY == 0) {
        const float *q = (const float *)p + i;
        if constexpr (VE >= 4) {
#pragma unroll
            for (int j = 0; j < VE; j += 4) {
                const fm_v4 v = *(const fm_v4 *)(q + j);
                f[j] = __uint_as_float(v.x), f[j + 1] = __uint_as_float(v.y);
                f[j + 2] = __uint_as_float(v.z), f[j + 3] = __uint_as_float(v.w);
            }
        } else if constexpr (VE == 2) {
            const fm_v2 v = *(const fm_v2 *)q;
            f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y);
        } else {
            f[0] = *q;
        }
    } else {
        const fm_half *q = (const fm_half *)p + i;
        fm_u32 w[VE / 2 > 0 ? VE / 2 : 1];
        if constexpr (VE == 8) {
            const fm_v4 v = *(const fm_v4 *)q;
            w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
        } else if constexpr (VE == 4) {
            const fm_v2 v = *(const fm_v2 *)q;
            w[0] = v.x, w[1] = v.y;
        } else if constexpr (VE == 2) {
            w[0] = *(const fm_u32 *)q;
        } else {
            f[0] = fm_16_to_f<TY>(*q);
            return;
        }
#pragma unroll
        for (int j = 0; j < VE / 2; ++j) {
            f[2 * j] = fm_16_to_f<TY>((fm_half)(w[j] & 0xffffu));
            f[2 * j + 1] = fm_16_to_f<TY>((fm_half)(w[j] >> 16));
        }
    }
}

// VE floats to element i of y (out_t, FM_OUT_TYPE), rounded to nearest even where y is 16-bit; an 8-bit network's
// codes of the floats (already times QOUT) where y is the next layer's input (FM_OUT_TYPE 3).
__device__ __forceinline__ void fm_stv(out_t *y, long long i, const float (&f)[VE]) {
    out_t *q = y + i;
#if FM_OUT_TYPE == 3
    if constexpr (VE == 1) {
        *q = (out_t)(fm_quant2(f[0], 0.0f) & 0xffu);
    } else {
        if constexpr (VE == 8)
            *(fm_v2 *)q = fm_v2{fm_quant4(f[0], f[1], f[2], f[3]), fm_quant4(f[4], f[5], f[6], f[7])};
        else if constexpr (VE == 4)
            *(fm_u32 *)q = fm_quant4(f[0], f[1], f[2], f[3]);
        else
            *(unsigned short *)q = fm_quant2(f[0], f[1]);
    }
#elif FM_OUT_TYPE == 0
    if constexpr (VE >= 4) {
#pragma unroll
        for (int j = 0; j < VE; j += 4)
            *(fm_v4 *)(q + j) = fm_v4{__float_as_uint(f[j]), __float_as_uint(f[j + 1]), __float_as_uint(f[j + 2]),
                                      __float_as_uint(f[j + 3])};
    } else if constexpr (VE == 2) {
        *(fm_v2 *)q = fm_v2{__float_as_uint(f[0]), __float_as_uint(f[1])};
    } else {
        *q = f[0];
    }
#else
    if constexpr (VE == 1) {
        *q = (out_t)(fm_pack2<FM_OUT_TYPE>(f[0], 0.0f) & 0xffffu);
    } else {
        fm_u32 w[VE / 2 > 0 ? VE / 2 : 1];
#pragma unroll
        for (int j = 0; j < VE / 2; ++j)
            w[j] = fm_pack2<FM_OUT_TYPE>(f[2 * j], f[2 * j + 1]);
        if constexpr (VE == 8)
            *(fm_v4 *)q = fm_v4{w[0], w[1], w[2], w[3]};
        else if constexpr (VE == 4)
            *(fm_v2 *)q = fm_v2{w[0], w[1]};
        else
            *(fm_u32 *)q = w[0];
    }
#endif
}

__device__ __forceinline__ float fm_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Chunk c of the row (its elements c VE..) through the rest of the epilogue, stored to y: z's normalised values v
// (already (z - mean) * rstd) times gamma plus beta, then act, the residual and post.
__device__ __forceinline__ void fm_finish(float (&v)[VE], out_t *__restrict__ y, const float *__restrict__ bias,
                                          const void *__restrict__ res, long long row, int c) {
    float g[VE], b[VE], r[VE];
    fm_ldv<0>(bias, NP + c * VE, g);
    fm_ldv<0>(bias, 2 * NP + c * VE, b);
#if FM_RES_TYPE >= 0
    fm_ldv<FM_RES_TYPE>(res, row * NR + c * VE, r);
#if FM_PREC >= 3
    if constexpr (FM_RES_TYPE != 3) {  // x: the codes an 8-bit network keeps of it (csrc/ref.c; gemm_layer.cu's)
        constexpr float RQ = 1.0f / Ly::RSCALE;
#pragma unroll
        for (int e = 0; e < VE; e += 2) {
            float lo, hi;
            fm_code2_to_f(fm_quant2(r[e] * RQ, e + 1 < VE ? r[e + 1] * RQ : 0.0f), lo, hi);
            r[e] = lo;
            if (e + 1 < VE)
                r[e + 1] = hi;
        }
    }
#pragma unroll
    for (int e = 0; e < VE; ++e)
        r[e] *= Ly::RSCALE;
#endif
#else
    (void)res;
#pragma unroll
    for (int e = 0; e < VE; ++e)
        r[e] = 0.0f;
#endif
#pragma unroll
    for (int e = 0; e < VE; ++e) {
        float o = Ly::act(fmaf(v[e], g[e], b[e]), c * VE + e);
        if constexpr (Ly::RES != 0)
            o = Ly::post(Ly::RES == 1 ? o + r[e] : o * r[e]);
#if FM_OUT_TYPE == 3
        o *= Ly::QOUT;  // (fm_stv stores its code)
#endif
        v[e] = o;
    }
    fm_stv(y, row * NR + c * VE, v);
}

__device__ __forceinline__ float fm_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// This lane's chunks of the row from z0 on (c = lane, lane + 32, ...), each read and handed to f(c, its VE values).
template <typename F>
__device__ __forceinline__ void fm_row_chunks(const void *__restrict__ x, long long z0, int lane, F f) {
#pragma unroll 4
    for (int c = lane; c < NCH; c += 32) {
        float v[VE];
        fm_ldv<FM_IN_TYPE>(x, z0 + c * VE, v);
        f(c, v);
    }
}

// A softmax (NORM 3) or log_softmax (4) row from z0 on: its max m, s = sum exp(z - m), then exp(z - m) / s or
// z - m - log s through fm_finish (gamma ones and beta zeros: exact). In registers up to 64 values a lane; a wider row
// is read three times (max, sum, values; the second and third reads mostly hit L1/L2).
__device__ __forceinline__ void fm_soft_row(const void *__restrict__ x, out_t *__restrict__ y,
                                            const float *__restrict__ bias, const void *__restrict__ res,
                                            long long row, long long z0, int lane) {
    float m = __int_as_float(0xff800000), s = 0.0f;  // -inf, 0: no column yet
    if constexpr (IN_REGS) {
        float v[CPL][VE];
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            if (NCH % 32 == 0 || i * 32 + lane < NCH) {
                fm_ldv<FM_IN_TYPE>(x, z0 + (i * 32 + lane) * VE, v[i]);
#pragma unroll
                for (int e = 0; e < VE; ++e)
                    m = fmaxf(m, v[i][e]);
            }
        }
        m = fm_warp_max(m);
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            if (NCH % 32 == 0 || i * 32 + lane < NCH) {
#pragma unroll
                for (int e = 0; e < VE; ++e) {
                    const float ex = __expf(v[i][e] - m);
                    s += ex;
                    if constexpr (Ly::NORM == 3)
                        v[i][e] = ex;
                }
            }
        }
        s = fm_warp_sum(s);
        const float inv = 1.0f / s, shift = m + __logf(s);
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            if (NCH % 32 == 0 || i * 32 + lane < NCH) {
#pragma unroll
                for (int e = 0; e < VE; ++e)
                    v[i][e] = Ly::NORM == 3 ? v[i][e] * inv : v[i][e] - shift;
                fm_finish(v[i], y, bias, res, row, i * 32 + lane);
            }
        }
    } else {  // each pass reads the row's chunks again
        fm_row_chunks(x, z0, lane, [&](int, float (&f)[VE]) {
#pragma unroll
            for (int e = 0; e < VE; ++e)
                m = fmaxf(m, f[e]);
        });
        m = fm_warp_max(m);
        fm_row_chunks(x, z0, lane, [&](int, float (&f)[VE]) {
#pragma unroll
            for (int e = 0; e < VE; ++e)
                s += __expf(f[e] - m);
        });
        s = fm_warp_sum(s);
        const float inv = 1.0f / s, shift = m + __logf(s);
        fm_row_chunks(x, z0, lane, [&](int c, float (&f)[VE]) {
#pragma unroll
            for (int e = 0; e < VE; ++e)
                f[e] = Ly::NORM == 3 ? __expf(f[e] - m) * inv : f[e] - shift;
            fm_finish(f, y, bias, res, row, c);
        });
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, FM_BLOCKS_PER_SM)
{{KERNEL_NAME}}(const void *__restrict__ x,      // z = W h + b: rows x NR of FM_IN_TYPE
                out_t *__restrict__ y,            // rows x NR of out_t: the layer's output
                const act_t *__restrict__ w,      // (unused: the GEMM before this kernel multiplied)
                const float *__restrict__ bias,   // NP floats (unused), then gamma and beta, NP each
                long long rows,                   // batch size, >= 1
                const void *__restrict__ x1,      // (unused: a concat is the GEMM's)
                const void *__restrict__ res)     // the residual operand: rows x NR of FM_RES_TYPE, or null
{
    (void)w;
    (void)x1;
    fm_grid_wait();  // (fm_common.cuh) the kernel before this one on the stream is done: z may be read, y written
    fm_grid_release();
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * FM_WARPS + (threadIdx.x >> 5);
    if (row >= rows)
        return;
    const long long z0 = row * NR;
    if constexpr (Ly::NORM >= 3) {
        fm_soft_row(x, y, bias, res, row, z0, lane);
    } else if constexpr (IN_REGS) {
        float v[CPL][VE];
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            const int c = i * 32 + lane;
            if (NCH % 32 == 0 || c < NCH) {
                fm_ldv<FM_IN_TYPE>(x, z0 + c * VE, v[i]);
            } else {
#pragma unroll
                for (int e = 0; e < VE; ++e)
                    v[i][e] = 0.0f;
            }
#pragma unroll
            for (int e = 0; e < VE; ++e)
                s += v[i][e];
        }
        const float mean = Ly::NORM == 1 ? fm_warp_sum(s) * (1.0f / NR) : 0.0f;
        float q = 0.0f;
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            if (NCH % 32 == 0 || i * 32 + lane < NCH) {
#pragma unroll
                for (int e = 0; e < VE; ++e) {
                    const float d = v[i][e] - mean;
                    q = fmaf(d, d, q);
                }
            }
        }
        const float rstd = rsqrtf(fm_warp_sum(q) * (1.0f / NR) + Ly::EPS);
#pragma unroll
        for (int i = 0; i < CPL; ++i) {
            const int c = i * 32 + lane;
            if (NCH % 32 == 0 || c < NCH) {
#pragma unroll
                for (int e = 0; e < VE; ++e)
                    v[i][e] = (v[i][e] - mean) * rstd;
                fm_finish(v[i], y, bias, res, row, c);
            }
        }
    } else {
        // sums about the row's first element k (a layernorm's; rmsnorm's about 0), so a large common part of the row
        // does not cancel its deviations' bits in s2 / NR - (s1 / NR)^2
        float k = 0.0f;
        if constexpr (Ly::NORM == 1) {
            float f[VE];
            fm_ldv<FM_IN_TYPE>(x, z0, f);
            k = f[0];
        }
        float s1 = 0.0f, s2 = 0.0f;
        fm_row_chunks(x, z0, lane, [&](int, float (&f)[VE]) {
#pragma unroll
            for (int e = 0; e < VE; ++e) {
                const float d = f[e] - k;
                s1 += d;
                s2 = fmaf(d, d, s2);
            }
        });
        const float m1 = fm_warp_sum(s1) * (1.0f / NR), m2 = fm_warp_sum(s2) * (1.0f / NR);
        const float mean = Ly::NORM == 1 ? k + m1 : 0.0f, var = Ly::NORM == 1 ? fmaxf(m2 - m1 * m1, 0.0f) : m2;
        const float rstd = rsqrtf(var + Ly::EPS);
        fm_row_chunks(x, z0, lane, [&](int c, float (&f)[VE]) {
#pragma unroll
            for (int e = 0; e < VE; ++e)
                f[e] = (f[e] - mean) * rstd;
            fm_finish(f, y, bias, res, row, c);
        });
    }
}
