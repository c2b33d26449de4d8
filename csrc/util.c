/* util.c - the error record and the growable string every stage shares. */
#include "fm.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

const char *fm_status_to_string(fm_status st) {
    switch (st) {
    case FM_OK: return "ok";
    case FM_ERR_VALUE: return "invalid value";
    case FM_ERR_SHAPE: return "shape mismatch";
    case FM_ERR_EXPR: return "invalid activation expression";
    case FM_ERR_LIMIT: return "beyond the fused kernel's limits";
    case FM_ERR_NOMEM: return "out of host memory";
    case FM_ERR_LIBRARY: return "library not found";
    case FM_ERR_COMPILE: return "kernel compilation failed";
    case FM_ERR_CUDA: return "CUDA driver error";
    case FM_ERR_TEMPLATE: return "bad kernel template";
    case FM_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

fm_status fm_fail(fm_error *err, fm_status st, const char *fmt, ...) {
    if (err == NULL || err->status != FM_OK)
        return st;
    err->status = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    return st;
}

void fm_error_hint(fm_error *err, const char *fmt, ...) {
    if (err == NULL || err->hint[0] != '\0')
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->hint, sizeof err->hint, fmt, ap);
    va_end(ap);
}

void fm_error_clear(fm_error *err) {
    if (err == NULL)
        return;
    free(err->log);
    memset(err, 0, sizeof *err);
}

static int fm_str_reserve(fm_str *s, size_t extra) {
    if (s->oom)
        return 0;
    size_t need = s->len + extra + 1;
    if (need <= s->cap)
        return 1;
    size_t cap = s->cap ? s->cap : 256;
    while (cap < need)
        cap *= 2;
    char *p = realloc(s->data, cap);
    if (p == NULL) {
        s->oom = 1;
        return 0;
    }
    s->data = p;
    s->cap = cap;
    return 1;
}

void fm_str_appendn(fm_str *s, const char *text, size_t n) {
    if (!fm_str_reserve(s, n))
        return;
    memcpy(s->data + s->len, text, n);
    s->len += n;
    s->data[s->len] = '\0';
}

void fm_str_append(fm_str *s, const char *text) { fm_str_appendn(s, text, strlen(text)); }

void fm_str_printf(fm_str *s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || !fm_str_reserve(s, (size_t)n))
        return;
    va_start(ap, fmt);
    vsnprintf(s->data + s->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    s->len += (size_t)n;
}

void fm_str_free(fm_str *s) {
    free(s->data);
    memset(s, 0, sizeof *s);
}

const char *fm_dtype_name(fm_dtype d) {
    switch (d) {
    case FM_F32: return "float32";
    case FM_F16: return "float16";
    case FM_BF16: return "bfloat16";
    case FM_CODES: return "codes";
    }
    return "?";
}

size_t fm_dtype_size(fm_dtype d) { return d == FM_F32 ? 4 : d == FM_CODES ? 1 : 2; }

/* (static inline, so that fm_round_row's loop inlines it: a call an element was 40% of a weight pack's time) */
static inline uint16_t fm_half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t mag = x & 0x7fffffffu;
    if (mag >= 0x7f800000u) /* inf or NaN: keep a quiet NaN payload bit */
        return (uint16_t)(sign | 0x7c00u | (mag > 0x7f800000u ? 0x200u : 0u));
    if (mag >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (mag < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (mag < 0x33000000u)
            return (uint16_t)sign; /* below half the smallest subnormal: rounds to zero */
        uint32_t exp = mag >> 23;
        uint32_t mant = (mag & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - exp; /* 14..24 */
        uint32_t half = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
        if (rem > mid || (rem == mid && (half & 1u)))
            ++half;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((mag - 0x38000000u) >> 13);
    uint32_t rem = mag & 0x1fffu;
    /* (without a branch: random weights' rounding directions mispredicted one in two, ~5 ns an element) */
    half += (uint32_t)(rem > 0x1000u) | ((uint32_t)(rem == 0x1000u) & half);
    return (uint16_t)(sign | half);
}

uint16_t fm_float_to_half(float f) { return fm_half_bits(f); }

float fm_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, x;
    if (exp == 0x1fu)
        x = sign | 0x7f800000u | (mant << 13);
    else if (exp != 0)
        x = sign | ((exp + 112u) << 23) | (mant << 13);
    else if (mant == 0)
        x = sign;
    else { /* subnormal: normalise */
        exp = 113u;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            --exp;
        }
        x = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

const char *fm_prec_name(fm_prec p) {
    switch (p) {
    case FM_PREC_F16: return "float16";
    case FM_PREC_BF16: return "bfloat16";
    case FM_PREC_TF32: return "tf32";
    case FM_PREC_INT8: return "int8";
    case FM_PREC_E4M3: return "float8";
    }
    return "?";
}

size_t fm_prec_size(fm_prec p) { return p == FM_PREC_TF32 ? 4 : fm_prec_is_8bit(p) ? 1 : 2; }

int fm_prec_is_8bit(fm_prec p) { return p == FM_PREC_INT8 || p == FM_PREC_E4M3; }

/* bf16, tf32 and s8 m16n8k32 mma.sync shapes arrived with Ampere, e4m3 m16n8k32 with Ada (PTX ISA, "Matrix shape"
 * table: .bf16/.tf32/.s8 need sm_80, .e4m3 sm_89). */
int fm_prec_min_arch(fm_prec p) { return p == FM_PREC_F16 ? 75 : p == FM_PREC_E4M3 ? 89 : 80; }

/* float32 bits with the low `drop` mantissa bits rounded off to nearest even; NaN stays a quiet NaN, values past
 * the largest finite result round to inf through the exponent carry, as the hardware's cvt.rn does. */
static uint32_t fm_round_mantissa(uint32_t x, int drop) {
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return x | (1u << 22);
    uint32_t lsb = (x >> drop) & 1u;
    x += (1u << (drop - 1)) - 1u + lsb;
    return x & ~((1u << drop) - 1u);
}

uint32_t fm_round_bits(float f, fm_prec p) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    switch (p) {
    case FM_PREC_F16: return fm_float_to_half(f);
    case FM_PREC_BF16: return fm_round_mantissa(x, 16) >> 16;
    case FM_PREC_TF32: return fm_round_mantissa(x, 13);
    case FM_PREC_INT8:
    case FM_PREC_E4M3: return fm_quant8(f, p);
    }
    return 0;
}

void fm_round_row(const float *src, int n, fm_prec p, uint32_t *bits) {
    if (p == FM_PREC_F16) /* (the common case in a loop of its own: the conversion inlined, no switch an element) */
        for (int i = 0; i < n; ++i)
            bits[i] = fm_half_bits(src[i]);
    else
        for (int i = 0; i < n; ++i)
            bits[i] = fm_round_bits(src[i], p);
}

float fm_bits_value(uint32_t bits, fm_prec p) {
    if (fm_prec_is_8bit(p))
        return fm_dequant8((uint8_t)bits, p);
    if (p == FM_PREC_F16)
        return fm_half_to_float((uint16_t)bits);
    uint32_t x = p == FM_PREC_BF16 ? bits << 16 : bits;
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

float fm_quant_max(fm_prec p) { return p == FM_PREC_E4M3 ? 448.0f : 127.0f; }

/* e4m3 (OCP FP8 E4M3, "fn": no infinities, 0x7f / 0xff NaN): 4 exponent bits of bias 7, 3 mantissa bits, normals
 * from 2^-6, subnormals in steps of 2^-9, largest finite 448 = 1.75 * 2^8. Nearest even, saturating. */
static uint8_t fm_e4m3_code(float v) {
    if (isnan(v))
        return 0x7f;
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    const double a = fabs((double)v);
    if (a >= 448.0) /* satfinite: 464 and up would round past the largest finite value; it saturates there */
        return sign | 0x7e;
    int e;
    frexp(a, &e);    /* a = f * 2^e, f in [0.5, 1): the binade [2^(e-1), 2^e) */
    int q_exp = e - 1 < -6 ? -6 : e - 1;           /* subnormals share the smallest normal binade's step */
    const double step = ldexp(1.0, q_exp - 3);     /* 3 mantissa bits */
    const double r = nearbyint(a / step) * step;   /* exact: a / step is a power-of-two scaling; ties to even */
    if (r == 0.0)
        return sign;
    frexp(r, &e);
    if (e - 1 < -6) /* subnormal: exponent field 0, mantissa r / 2^-9 */
        return sign | (uint8_t)(r / ldexp(1.0, -9));
    const int mant = (int)(r / ldexp(1.0, e - 1) * 8.0) - 8;
    return sign | (uint8_t)((e - 1 + 7) << 3) | (uint8_t)mant;
}

uint8_t fm_quant8(float v, fm_prec p) {
    if (p == FM_PREC_E4M3)
        return fm_e4m3_code(v);
    /* The kernel clamps with fmaxf/fminf, then cvt.rni: NaN meets fmaxf first and becomes -127. */
    const float t = fminf(fmaxf(v, -127.0f), 127.0f);
    return (uint8_t)(int8_t)nearbyintf(t);
}

float fm_dequant8(uint8_t code, fm_prec p) {
    if (p != FM_PREC_E4M3)
        return (float)(int8_t)code;
    const int e = (code >> 3) & 0xf, m = code & 7;
    if (e == 15 && m == 7)
        return NAN;
    const double mag = e == 0 ? ldexp((double)m, -9) : ldexp((double)(8 + m), e - 10);
    return (float)((code & 0x80) ? -mag : mag);
}
