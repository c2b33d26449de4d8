"""Accuracy of 16-bit special-function forms on the GPU: tanh.approx.f32 rounded to 16 bits (the FM_FAST_HELPERS
forms the kernels use) against tanh.approx.f16x2 / bf16x2 (two elements per instruction), for tanh, sigmoid, silu and
gelu. Needs CuPy and an sm_90 GPU (bf16x2 tanh).

    python bench/act16_probe.py

Prints, per activation and form, the largest error over the bound the GPU tests use (1.25 x the storage type's
rounding, 2^-11 for float16 and 2^-8 for bfloat16, relative above magnitude 1 and absolute below), for x that are
float16 values (what test_fast_activations_stay_within_16_bit_rounding feeds) and for float32 x (the kernel's biased
accumulators, rounded to 16 bits before a 16-bit tanh). The H100 answer (results/h100/act16_probe.txt) is why the
kernels keep the float32 forms: the 16-bit ones reach 1.1x the bound for tanh and 4.7x for silu, and ptxas splits
the pair instruction into two MUFU ops anyway (no faster).
"""

import math
import sys

import cupy as cp
import numpy as np

SRC = r"""
typedef unsigned int u32;
__device__ u32 pack(float lo, float hi, int bf) {
    u32 r;
    if (bf) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ float lo_f(u32 w, int bf) {
    if (bf) return __uint_as_float(w << 16);
    float f; unsigned short h = (unsigned short)(w & 0xffffu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ float r16(float v, int bf) { return lo_f(pack(v, 0.0f, bf), bf); }
__device__ float tanh32(float x) { float y; asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ float tanh16(float x, int bf) {  // the argument rounded to 16 bits, the MUFU's 16-bit tanh
    u32 a = pack(x, 0.0f, bf), y;
    if (bf) asm("tanh.approx.bf16x2 %0, %1;" : "=r"(y) : "r"(a));
    else asm("tanh.approx.f16x2 %0, %1;" : "=r"(y) : "r"(a));
    return lo_f(y, bf);
}
__device__ float gelu_arg(float x) {
    const float z = fminf(fmaxf(x * 0.707106781186547524f, -4.0f), 4.0f), z2 = z * z;
    return z * fmaf(z2, fmaf(z2, -0.0020268f, 0.10478712f), 1.12778009f);
}
extern "C" __global__ void probe(const float *xs, float *out, int n, int bf) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = xs[i];
    float *o = out + i;
    // 0/1: tanh; 2/3: sigmoid; 4/5: silu; 6/7: gelu. Even: f32 MUFU then rounded; odd: the 16-bit MUFU.
    o[0 * n] = r16(tanh32(x), bf);
    o[1 * n] = tanh16(x, bf);
    o[2 * n] = r16(fmaf(0.5f, tanh32(0.5f * x), 0.5f), bf);
    o[3 * n] = r16(fmaf(0.5f, tanh16(0.5f * x, bf), 0.5f), bf);
    o[4 * n] = r16(x * fmaf(0.5f, tanh32(0.5f * x), 0.5f), bf);
    float h = 0.5f * x;
    o[5 * n] = r16(fmaf(h, tanh16(h, bf), h), bf);
    o[6 * n] = r16(0.5f * x * (1.0f + tanh32(gelu_arg(x))), bf);
    o[7 * n] = r16(0.5f * x * (1.0f + tanh16(gelu_arg(x), bf)), bf);
}
"""

ACTS = {
    "tanh": np.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "gelu": lambda x: 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0))),
}


def main():
    kernel = cp.RawKernel(SRC, "probe", options=("--gpu-architecture=sm_90",))
    grid16 = np.concatenate([np.linspace(-12, 12, 48001), np.geomspace(1e-4, 12, 2000), -np.geomspace(1e-4, 12, 2000)])
    rng = np.random.default_rng(0)
    sets = {"float16 x": grid16.astype(np.float16).astype(np.float32),
            "float32 x": np.concatenate([rng.uniform(-12, 12, 200000), rng.uniform(-3, 3, 200000)]).astype(np.float32)}
    worst = 0.0
    for bf, tname, u in ((0, "float16", 2.0 ** -11), (1, "bfloat16", 2.0 ** -8)):
        for sname, xs in sets.items():
            if bf and sname == "float16 x":
                continue
            n = xs.size
            out = cp.empty(8 * n, cp.float32)
            kernel(((n + 255) // 256,), (256,), (cp.asarray(xs), out, np.int32(n), np.int32(bf)))
            res = cp.asnumpy(out).reshape(8, n).astype(np.float64)
            x64 = xs.astype(np.float64)
            for k, (act, f) in enumerate(ACTS.items()):
                ref = f(x64)
                bound = 1.25 * u * np.maximum(np.abs(ref), 1.0)
                cells = []
                for form, row in (("f32 MUFU", res[2 * k]), ("16-bit MUFU", res[2 * k + 1])):
                    ratio = np.abs(row - ref) / bound
                    j = int(np.argmax(ratio))
                    cells.append(f"{form} {ratio[j]:.3f} (x={x64[j]:.4g})")
                    if form == "16-bit MUFU" and tname == "float16":
                        worst = max(worst, ratio[j])
                print(f"{tname:8s} {sname:9s} {act:7s} max error / bound: " + "; ".join(cells))
    print(f"worst float16 16-bit-MUFU ratio {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
