/* util.c - the error record and the growable string every stage shares. */
#include "fm.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
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
    }
    return "?";
}

size_t fm_dtype_size(fm_dtype d) { return d == FM_F32 ? 4 : 2; }

uint16_t fm_float_to_half(float f) {
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
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u)))
        ++half;
    return (uint16_t)(sign | half);
}

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
    }
    return "?";
}

size_t fm_prec_size(fm_prec p) { return p == FM_PREC_TF32 ? 4 : 2; }

/* bf16 and tf32 mma.sync shapes arrived with Ampere (PTX ISA, "Matrix shape" table: .bf16/.tf32 need sm_80). */
int fm_prec_min_arch(fm_prec p) { return p == FM_PREC_F16 ? 75 : 80; }

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
    }
    return 0;
}

float fm_bits_value(uint32_t bits, fm_prec p) {
    if (p == FM_PREC_F16)
        return fm_half_to_float((uint16_t)bits);
    uint32_t x = p == FM_PREC_BF16 ? bits << 16 : bits;
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}
