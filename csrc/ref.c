/* ref.c - the CPU forward: the no-GPU path and the oracle for check=True.
 *
 * Semantics: float32 storage between layers, float64 accumulation and activation (the GPU keeps fp16 between
 * layers and accumulates in fp32, so this is the more exact of the two). Rows go in blocks so each weight row is
 * read once per block, and four rows share each weight load. */
#include "fm.h"

#include <stdlib.h>
#include <string.h>

enum { FM_REF_ROWS = 64 };

/* out[r * n_out + n] = b[n] + sum_k in[r * k_in + k] * w[n * k_in + k], for r < rows (<= FM_REF_ROWS). */
static void fm_ref_linear(const double *in, int rows, int k_in, const float *w, const float *b, int n_out,
                          double *out) {
    for (int n = 0; n < n_out; ++n) {
        const float *wn = w + (size_t)n * k_in;
        double bias = b ? (double)b[n] : 0.0;
        int r = 0;
        for (; r + 4 <= rows; r += 4) {
            const double *a0 = in + (size_t)r * k_in, *a1 = a0 + k_in, *a2 = a1 + k_in, *a3 = a2 + k_in;
            double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            for (int k = 0; k < k_in; ++k) {
                double wk = (double)wn[k];
                s0 += a0[k] * wk;
                s1 += a1[k] * wk;
                s2 += a2[k] * wk;
                s3 += a3[k] * wk;
            }
            out[(size_t)r * n_out + n] = s0 + bias;
            out[(size_t)(r + 1) * n_out + n] = s1 + bias;
            out[(size_t)(r + 2) * n_out + n] = s2 + bias;
            out[(size_t)(r + 3) * n_out + n] = s3 + bias;
        }
        for (; r < rows; ++r) {
            const double *a = in + (size_t)r * k_in;
            double s = 0;
            for (int k = 0; k < k_in; ++k)
                s += a[k] * (double)wn[k];
            out[(size_t)r * n_out + n] = s + bias;
        }
    }
}

fm_status fm_ref_forward(const fm_spec *spec, const float *const *w, const float *const *b, const float *x,
                         int64_t rows, int64_t x_row, int64_t x_col, float *y, fm_error *err) {
    int widest = 0;
    for (int l = 0; l <= spec->num_layers; ++l)
        if (spec->width[l] > widest)
            widest = spec->width[l];
    double *cur = malloc(sizeof(double) * FM_REF_ROWS * (size_t)widest);
    double *next = malloc(sizeof(double) * FM_REF_ROWS * (size_t)widest);
    fm_status st = FM_OK;
    if (cur == NULL || next == NULL) {
        st = fm_fail(err, FM_ERR_NOMEM, "out of memory for the CPU forward (%d features wide)", widest);
        goto cleanup;
    }
    const int k0 = spec->width[0], n_last = spec->width[spec->num_layers];
    for (int64_t r0 = 0; r0 < rows; r0 += FM_REF_ROWS) {
        int nr = rows - r0 < FM_REF_ROWS ? (int)(rows - r0) : FM_REF_ROWS;
        for (int r = 0; r < nr; ++r)
            for (int k = 0; k < k0; ++k)
                cur[(size_t)r * k0 + k] = (double)x[(r0 + r) * x_row + (int64_t)k * x_col];
        for (int l = 0; l < spec->num_layers; ++l) {
            int k_in = spec->width[l], n_out = spec->width[l + 1];
            size_t count = (size_t)nr * (size_t)n_out;
            fm_ref_linear(cur, nr, k_in, w[l], spec->has_bias[l] ? b[l] : NULL, n_out, next);
            if ((st = fm_expr_eval(spec->act[l], next, next, count, err)) != FM_OK)
                goto cleanup;
            if (spec->res_op[l] != FM_RES_NONE) { /* r is this layer's own input: cur, of the same width */
                for (size_t i = 0; i < count; ++i)
                    next[i] = spec->res_op[l] == FM_RES_ADD ? next[i] + cur[i] : next[i] * cur[i];
                if ((st = fm_expr_eval(spec->res_post[l], next, next, count, err)) != FM_OK)
                    goto cleanup;
            }
            for (size_t i = 0; i < count; ++i) /* float32 storage between layers */
                next[i] = (double)(float)next[i];
            double *swap = cur;
            cur = next;
            next = swap;
        }
        for (size_t i = 0; i < (size_t)nr * (size_t)n_last; ++i)
            y[(size_t)r0 * n_last + i] = (float)cur[i];
    }
cleanup:
    free(cur);
    free(next);
    return st;
}
