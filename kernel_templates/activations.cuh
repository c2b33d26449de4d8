// activations.cuh - float32 device helpers that the activation expressions emitted by csrc/expr_emit.c call.
//
// Compiled by NVRTC with no include path: only CUDA's built-in math functions and intrinsics are used. The sigmoid
// family, tanh and sin/cos use the hardware's exp2/reciprocal/sin units (__expf, __fdividef, __sinf) with their
// argument handling done here: relative error ~1e-6, far below the 2^-11 (4.9e-4) of the fp16 storage between layers,
// at a fraction of the cost; accurate expf + IEEE division made tanh/silu networks 2-3x slower than relu ones (H100). Each formula is
// PyTorch's CUDA kernel for the same activation (aten/src/ATen/native/cuda/Activation*.cu), with its order of
// operations, and propagates NaN as PyTorch does. csrc/expr_funcs.c holds the float64 twin of every helper.

__device__ __forceinline__ float fm_min(float a, float b) { return (a < b || a != a) ? a : b; }
__device__ __forceinline__ float fm_max(float a, float b) { return (a > b || a != a) ? a : b; }
// Comparisons as 1 or 0 (0 for NaN operands), and the select of their results (csrc/expr_internal.h).
__device__ __forceinline__ float fm_gt(float a, float b) { return a > b ? 1.0f : 0.0f; }
__device__ __forceinline__ float fm_ge(float a, float b) { return a >= b ? 1.0f : 0.0f; }
__device__ __forceinline__ float fm_lt(float a, float b) { return a < b ? 1.0f : 0.0f; }
__device__ __forceinline__ float fm_le(float a, float b) { return a <= b ? 1.0f : 0.0f; }
__device__ __forceinline__ float fm_eq(float a, float b) { return a == b ? 1.0f : 0.0f; }
__device__ __forceinline__ float fm_where(float c, float a, float b) { return c != 0.0f ? a : b; }

// x^n for a constant small n (the emitter passes a literal, so after inlining the loop unrolls into n-1
// multiplications, in the order the CPU evaluator uses).
__device__ __forceinline__ float fm_powi(float b, int n) {
    int m = n < 0 ? -n : n;
    float r = m > 0 ? b : 1.0f;
#pragma unroll
    for (int i = 1; i < m; ++i)
        r *= b;
    return n < 0 ? 1.0f / r : r;
}

__device__ __forceinline__ float fm_square(float x) { return x * x; }

// sin and cos: sinf/cosf inline a Payne-Hanek reduction for |x| > 105615 at every call site, which made a SIREN-like
// network's kernel 1.6 MB and its compile take a minute. Instead: a two-part Cody-Waite reduction by 2*pi and the
// hardware's sin/cos on [-pi, pi] (absolute error 2^-21.4, CUDA C Programming Guide, "Intrinsic Functions"); larger
// |x| go to one out-of-line sinf/cosf. The quotient k = rint(x / 2pi) comes from adding and subtracting 1.5 * 2^23
// (the sum's ulp is 1, so the FFMA rounds to the nearest integer), two FMA-pipe instructions: rintf is an FRND,
// which runs on the special-function pipe beside the MUFU.SIN, so a sin cost two of that pipe's 16 slots per clock
// instead of one (siren256: 2^21 x 768 sines). With |k| <= 20861 the third part of 2pi (6.9e-15) moves r by at most
// 1.4e-10, far under r's own rounding (2.4e-7 near pi), so two parts are exact to float rounding.
__device__ __noinline__ float fm_sin_far(float x) { return sinf(x); }
__device__ __noinline__ float fm_cos_far(float x) { return cosf(x); }
__device__ __forceinline__ float fm_quot_2pi(float x) {  // rint(x / 2pi)
    return fmaf(x, 0.159154943091895335768883763372514362f, 12582912.0f) - 12582912.0f;
}
__device__ __forceinline__ float fm_reduce_2pi(float x) {
    const float k = fm_quot_2pi(x);
    const float r = fmaf(-k, 6.28318548202514648437500f, x);  // 2pi, 24 bits
    return fmaf(-k, -1.7484555314695172e-7f, r);              // the next 24
}
__device__ __forceinline__ float fm_sin(float x) {
    return fabsf(x) < 131072.0f ? __sinf(fm_reduce_2pi(x)) : fm_sin_far(x);
}
__device__ __forceinline__ float fm_cos(float x) {
    return fabsf(x) < 131072.0f ? __cosf(fm_reduce_2pi(x)) : fm_cos_far(x);
}
// Branch-free forms for the warpgroup kernels' epilogues, whose results are stored in 16 bits, so an error of a few
// 1e-5 is under the result's own rounding (2^-11 absolute below 1).
//
// fm_sin_d, fm_cos_d: the hardware unit on x itself. __sinf is an FMUL.RZ by 1/2pi, then MUFU.SIN on the revolutions,
// whose fraction the unit takes exactly: two instructions. Its error is that product's: below 64 revolutions (|x| <
// 402) one ulp of it is 2^-18 (2.4e-5 rad), and the float constant is 4e-8 of 1/2pi off (1.6e-5 rad at 400): 4e-5 in
// all (3.8e-5 found by emulating the product over every float16 in [-1, 1] times 1..390). Past that the ulp grows:
// 1.3e-4 near 1000.
__device__ __forceinline__ float fm_sin_d(float x) { return __sinf(x); }
__device__ __forceinline__ float fm_cos_d(float x) { return __cosf(x); }
// fm_sin_b, fm_cos_b: for arguments below 1000, a one-part reduction by 2pi first: |k| <= 163, and the second part
// would move r by at most 163 x 1.75e-7 = 2.9e-5. Five instructions.
__device__ __forceinline__ float fm_reduce_2pi_1(float x) {
    return fmaf(-fm_quot_2pi(x), 6.28318548202514648437500f, x);
}
__device__ __forceinline__ float fm_sin_b(float x) { return __sinf(fm_reduce_2pi_1(x)); }
__device__ __forceinline__ float fm_cos_b(float x) { return __cosf(fm_reduce_2pi_1(x)); }
// A layer whose arguments the weights keep below 400 or 1000 (render.c, fm_render_trig_bounded) takes fm_sin_d or
// fm_sin_b in `act` itself. Any other sin/cos layer of the warpgroup kernels takes fm_sin_t in Layer<l>::act_t:
// fm_sin_d, noting in `far` an argument of 400 or more (or NaN); the epilogue then redoes its columns with `act`, the
// accurate forms above (one warp-uniform branch per layer instead of one per element). siren256 (H100, 2^21 rows),
// layer 0 (x may be anything) on fm_sin_t: 1.40 ms with fm_sin_b and the far check from 1024, 1.30 ms with fm_sin_d
// from 400.
__device__ __forceinline__ float fm_sin_t(bool &far, float x) {
    far |= !(fabsf(x) < 400.0f);
    return fm_sin_d(x);
}
__device__ __forceinline__ float fm_cos_t(bool &far, float x) {
    far |= !(fabsf(x) < 400.0f);
    return fm_cos_d(x);
}

__device__ __forceinline__ float fm_relu(float x) { return x < 0.0f ? 0.0f : x; }

__device__ __forceinline__ float fm_leaky_relu(float x, float slope) { return x > 0.0f ? x : x * slope; }

__device__ __forceinline__ float fm_elu(float x, float alpha) { return x <= 0.0f ? expm1f(x) * alpha : x; }

// alpha and scale from Klambauer et al. 2017; PyTorch multiplies them once, in float, into the negative slope.
__device__ __forceinline__ float fm_selu(float x) {
    const float alpha = 1.67326324235437728481704f;
    const float scale = 1.05070098735548049341933f;
    return x <= 0.0f ? expm1f(x) * (alpha * scale) : x * scale;
}

__device__ __forceinline__ float fm_gelu(float x) { return x * 0.5f * (1.0f + erff(x * 0.707106781186547524f)); }

// tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow, and no cancellation worth the name above
// |x| = 0.05; below it the odd Taylor polynomial (next term 17 x^7 / 315 < 4e-11). Both are computed and one selected:
// a branch per element kept ptxas from interleaving the unrolled epilogue (pinn50, tanh: 0.73 -> 1.08 ms on H100).
__device__ __forceinline__ float fm_tanh(float x) {
    const float a = fabsf(x), x2 = x * x;
    const float e = __expf(-2.0f * a);
    const float big = copysignf(__fdividef(1.0f - e, 1.0f + e), x);
    const float small = x * fmaf(x2, fmaf(x2, 0.133333333f, -0.333333333f), 1.0f);
    return a < 0.05f ? small : big;
}

// tanh for layers whose result is rounded to 16 bits right after (fp16/bf16 storage, plan.c's fast_act): one MUFU op
// (tanh.approx.f32, sm_75+, relative error ~2^-11, the size of fp16's own rounding) instead of exp + reciprocal +
// the small-|x| polynomial; tanh networks (pinn50) were bound by the special-function units. A Layer<l> whose
// result is stored that way declares FM_FAST_HELPERS, whose members shadow the accurate helpers inside its act() and
// post() (class scope comes first in name lookup); float32-stored results keep the ~1e-6 forms above.
__device__ __forceinline__ float fm_tanh_fast(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// sigmoid(x) = 0.5 tanh(x / 2) + 0.5: one MUFU op for sigmoid and silu (flex) instead of exp + reciprocal; absolute
// error ~2^-12, below the 16-bit rounding of values of order 1 that follows.
// sigmoid(2 h) and silu(2 h) of h = x / 2 (the forms below on x; alone for a norm layer whose gamma and beta come
// halved, fm_plan.norm_half: its scale and shift yield h, and the FMUL by 1/2 per element goes).
__device__ __forceinline__ float fm_sigmoid_h(float h) { return fmaf(0.5f, fm_tanh_fast(h), 0.5f); }
__device__ __forceinline__ float fm_silu_h(float h) { return fmaf(h, fm_tanh_fast(h), h); }
__device__ __forceinline__ float fm_sigmoid_fast(float x) { return fm_sigmoid_h(0.5f * x); }
// erf(z) ~ tanh(z (c0 + c1 z^2 + c2 z^4)), z^2 clamped at 16 (erf(4) = 1 - 1.5e-8): a weighted least-squares fit of
// atanh(erf) on [0, 2.6] whose GELU, 0.5 x (1 + erf(x / sqrt 2)), is within 3e-5 of the exact one everywhere (the
// tanh-form gelu_tanh is 4.7e-4 off), so the 16-bit rounding that follows (and tanh.approx) dominate. One MUFU op
// instead of erff's polynomial and exp (res128's four gelu layers).
__device__ __forceinline__ float fm_gelu_fast(float x) {
    // In x (k = 1/sqrt 2 folded into the coefficients), with x^2 clamped at 32: past it p is z times the polynomial
    // at z^2 = 16 (> 2.28), so tanh is 1 to float and p never turns down as the quintic itself does (|z| ~ 5.9).
    // One FMNMX and six FMA-pipe instructions, where clamping z and then squaring it took two FMNMX and eight.
    // 0.5 x (1 + t) as x times the gate fma(0.5, t, 0.5): a residual's add then contracts into that multiply
    // (fma(x, gate, r)), one instruction fewer per element in res128's blocks than fma(h, t, h) + r with h = x / 2,
    // and the same count without a residual. (res128's SASS 4480 -> 4224 instructions, and ptxas took 0.7 s instead
    // of 1.4 for it.)
    const float x2 = fminf(x * x, 32.0f);
    const float p = x * fmaf(x2, fmaf(x2, -0.0020268f * 0.17677669529663688f, 0.10478712f * 0.35355339059327376f),
                             1.12778009f * 0.70710678118654752f);
    return x * fmaf(0.5f, fm_tanh_fast(p), 0.5f);
}
// silu(x) = x sigmoid(x) = h (1 + tanh(h)) with h = x / 2 (exact): one FMUL, the MUFU and one FFMA, a rounding fewer
// than x * fm_sigmoid_fast(x).
__device__ __forceinline__ float fm_silu_fast(float x) { return fm_silu_h(0.5f * x); }
#define FM_FAST_HELPERS \
    static __device__ __forceinline__ float fm_tanh(float x) { return fm_tanh_fast(x); } \
    static __device__ __forceinline__ float fm_sigmoid(float x) { return fm_sigmoid_fast(x); } \
    static __device__ __forceinline__ float fm_silu(float x) { return fm_silu_fast(x); } \
    static __device__ __forceinline__ float fm_gelu(float x) { return fm_gelu_fast(x); }

__device__ __forceinline__ float fm_gelu_tanh(float x) {
    const float beta = 0.797884560802865355879f; // sqrt(2/pi)
    const float kappa = 0.044715f;
    float inner = beta * (x + kappa * (x * x * x));
    return 0.5f * x * (1.0f + fm_tanh(inner));
}

// With e = exp(-|x|) in (0, 1]: 1/(1+e) for x >= 0, e/(1+e) below. No overflow, no inf/inf, and full relative
// precision for very negative x, where 1/(1+exp(-x)) rounds to 0 early.
__device__ __forceinline__ float fm_sigmoid(float x) {
    const float e = __expf(-fabsf(x));
    const float s = __fdividef(1.0f, 1.0f + e);
    return x >= 0.0f ? s : e * s;
}

__device__ __forceinline__ float fm_silu(float x) { return x * fm_sigmoid(x); }

// torch.nn.functional.softplus: linear above the threshold, where log1p(exp) would only round to x anyway.
__device__ __forceinline__ float fm_softplus(float x, float beta, float threshold) {
    return x * beta > threshold ? x : log1pf(expf(x * beta)) / beta;
}

// mish = x * tanh(log1p(e^x)) = x * n / (n + 2) with n = e^x (e^x + 2): one exp, one division, no cancellation for
// negative x (n ~ 2 e^x). Above x = 20 the factor is 1 in float (and n would overflow past 44).
__device__ __forceinline__ float fm_mish(float x) {
    const float t = __expf(fminf(x, 20.0f));
    const float n = t * (t + 2.0f);
    return x > 20.0f ? x : x * __fdividef(n, n + 2.0f);
}

__device__ __forceinline__ float fm_hardtanh(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

__device__ __forceinline__ float fm_relu6(float x) { return x < 0.0f ? 0.0f : (x > 6.0f ? 6.0f : x); }

// PyTorch's CUDA kernels multiply by 1/6 where its CPU kernels divide by 6: both are within an ulp.
__device__ __forceinline__ float fm_hardsigmoid(float x) { return fm_relu6(x + 3.0f) * (1.0f / 6.0f); }

__device__ __forceinline__ float fm_hardswish(float x) { return x * fm_relu6(x + 3.0f) * (1.0f / 6.0f); }

__device__ __forceinline__ float fm_softsign(float x) { return x / (1.0f + fabsf(x)); }
