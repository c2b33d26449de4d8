/* ref.c - the CPU forward: the no-GPU path and the oracle for check=True.
 *
 * Semantics: float32 storage between layers, float64 accumulation, norm and activation (the GPU keeps fp16 between
 * layers and accumulates in fp32, so this is the more exact of the two). Rows go in blocks so each weight row is
 * read once per block, and four rows share each weight load. An 8-bit network (fm_spec.quant) is emulated instead:
 * its weights and the values between layers are replaced by code * scale with the kernels' own roundings
 * (fm_quant8), so the CPU path computes what the GPU does up to float32-versus-float64 arithmetic. */
#include "fm.h"

#include <math.h>
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

/* Column k of value -1 (what the layers see of x) for the row of x at xr, its features x_col floats apart: x's
 * feature k, or the input encoding's column k (fm_spec.enc_*), whose sine's argument is float32's product and sum as
 * the kernels form it (fm_encode), its sine in float64. */
static double fm_ref_x(const fm_spec *spec, const float *xr, int64_t x_col, int k) {
    if (spec->enc_cols == 0)
        return (double)xr[(int64_t)k * x_col];
    const float v = xr[(int64_t)spec->enc_src[k] * x_col];
    const float s = spec->enc_scale[k], p = spec->enc_phase[k];
    if (!spec->enc_sin[k]) /* x itself, or s x + p where the encoding scales it (fm_enc_x) */
        return s == 1.0f && p == 0.0f ? (double)v : (double)fmaf(s, v, p);
    return sin((double)fmaf(s, v, p));
}

/* Layer l's norm (spec->norm[l]) over each of the nr rows of z (n_out wide), in place: the statistics in float64,
 * the mean first and the variance about it (not E[z^2] - mean^2, which cancels where |mean| >> std); a softmax's the
 * row's max, then the sum of exp(z - max). */
static void fm_ref_norm(const fm_spec *spec, int l, double *z, int nr, int n_out) {
    const float *gamma = spec->norm_w[l], *beta = spec->norm_b[l];
    if (FM_NORM_IS_SOFT(spec->norm[l])) { /* exp(z - max) / sum, or its log: z - max - log(sum) */
        for (int r = 0; r < nr; ++r) {
            double *row = z + (size_t)r * n_out, max = row[0], sum = 0.0;
            for (int j = 1; j < n_out; ++j)
                max = row[j] > max ? row[j] : max;
            for (int j = 0; j < n_out; ++j)
                sum += exp(row[j] - max);
            const double log_sum = log(sum);
            for (int j = 0; j < n_out; ++j)
                row[j] = spec->norm[l] == FM_NORM_SOFTMAX ? exp(row[j] - max) / sum : row[j] - max - log_sum;
        }
        return;
    }
    for (int r = 0; r < nr; ++r) {
        double *row = z + (size_t)r * n_out, mean = 0.0, sq = 0.0;
        if (spec->norm[l] == FM_NORM_LAYER) {
            for (int j = 0; j < n_out; ++j)
                mean += row[j];
            mean /= n_out;
        }
        for (int j = 0; j < n_out; ++j)
            sq += (row[j] - mean) * (row[j] - mean);
        const double scale = 1.0 / sqrt(sq / n_out + spec->norm_eps[l]);
        for (int j = 0; j < n_out; ++j)
            row[j] = (row[j] - mean) * scale * (gamma ? (double)gamma[j] : 1.0) + (beta ? (double)beta[j] : 0.0);
    }
}

/* Layer l's input for rows r < nr: h (value l - 1, `cur`) or its concat with x (`x0`) in the spec's order. */
static const double *fm_ref_input(const fm_spec *spec, int l, const double *cur, const double *x0, int nr,
                                  double *cat) {
    if (spec->cat[l] == FM_CAT_NONE)
        return cur;
    int hw = spec->width[l], xw = spec->width[0], k_in = hw + xw;
    int h_at = spec->cat[l] == FM_CAT_AFTER ? 0 : xw, x_at = spec->cat[l] == FM_CAT_AFTER ? hw : 0;
    for (int r = 0; r < nr; ++r) {
        memcpy(cat + (size_t)r * k_in + h_at, cur + (size_t)r * hw, sizeof(double) * (size_t)hw);
        memcpy(cat + (size_t)r * k_in + x_at, x0 + (size_t)r * xw, sizeof(double) * (size_t)xw);
    }
    return cat;
}

/* The mean of n floats (0 for none). */
static double fm_ref_mean(const float *v, int n) {
    double sum = 0.0;
    for (int i = 0; v != NULL && i < n; ++i)
        sum += (double)v[i];
    return sum / n;
}

/* v stored as an 8-bit code with scale s and read back: what an 8-bit kernel keeps of a value between layers. The
 * product with the inverse is a float32 one, as on the GPU (render.c writes the same float32 inverse). */
static double fm_ref_fake_quant(double v, float s, fm_prec p) {
    const float inv = 1.0f / s;
    return (double)fm_dequant8(fm_quant8((float)v * inv, p), p) * (double)s;
}

/* Layer l's weights as the 8-bit kernel multiplies them: code * w_scale[n], rounded once to float32. The GPU scales
 * the sum of code products by act_scale * w_scale[n] instead; the two differ by float32 roundings only. */
static float *fm_ref_quant_weights(const fm_spec *spec, int l, const float *w) {
    const int n_out = spec->width[l + 1], k_in = fm_spec_in_features(spec, l);
    float *q = malloc(sizeof(float) * (size_t)n_out * (size_t)k_in + 1);
    for (int n = 0; q != NULL && n < n_out; ++n) {
        const float s = spec->w_scale[l][n];
        for (int k = 0; k < k_in; ++k) {
            const size_t i = (size_t)n * (size_t)k_in + (size_t)k;
            q[i] = (float)((double)fm_dequant8(fm_quant8((float)((double)w[i] / (double)s), spec->quant),
                                               spec->quant) * (double)s);
        }
    }
    return q;
}

/* Folds |v| of count values into *m (a NaN is remembered in *nan: fmax would drop it). */
static void fm_ref_amax(const double *v, size_t count, double *m, int *nan) {
    for (size_t i = 0; i < count; ++i) {
        const double a = fabs(v[i]);
        if (isnan(a))
            *nan = 1;
        else if (a > *m)
            *m = a;
    }
}

fm_status fm_ref_forward(const fm_spec *spec, const float *const *w, const float *const *b, const float *x,
                         int64_t rows, int64_t x_row, int64_t x_col, float *y, fm_error *err) {
    return fm_ref_forward_ex(spec, w, b, x, rows, x_row, x_col, y, fm_prec_is_8bit(spec->quant), NULL, err);
}

fm_status fm_ref_forward_ex(const fm_spec *spec, const float *const *w, const float *const *b, const float *x,
                            int64_t rows, int64_t x_row, int64_t x_col, float *y, int quant, double *amax,
                            fm_error *err) {
    const int L = spec->num_layers;
    if (quant && !fm_prec_is_8bit(spec->quant))
        return fm_fail(err, FM_ERR_VALUE, "a quantised CPU forward needs an int8 or float8 network; this one is not");
    if (quant && fm_spec_check_calibrated(spec, "the CPU forward", err) != FM_OK)
        return FM_ERR_VALUE;
    const fm_prec qp = spec->quant;
    const int z16 = fm_spec_z16(spec);
    int amax_nan[FM_MAX_LAYERS + 1] = {0};
    if (amax != NULL)
        for (int v = 0; v <= L; ++v)
            amax[v] = 0.0;
    /* Values read again later (residual operands, x for a concat) are kept per row block: saved[v + 1]. */
    int keep[FM_MAX_LAYERS + 1] = {0}, widest = 0, widest_in = 0;
    for (int l = 0; l < L; ++l) {
        if (spec->res_op[l] != FM_RES_NONE)
            keep[spec->res_src[l] + 1] = 1;
        if (spec->cat[l] != FM_CAT_NONE)
            keep[0] = 1;
        int k_in = fm_spec_in_features(spec, l);
        widest_in = k_in > widest_in ? k_in : widest_in;
    }
    for (int v = 0; v <= L; ++v)
        widest = spec->width[v] > widest ? spec->width[v] : widest;
    double *saved[FM_MAX_LAYERS + 1] = {NULL};
    float *wq[FM_MAX_LAYERS] = {NULL};
    const float *wl[FM_MAX_LAYERS];
    double *cur = malloc(sizeof(double) * FM_REF_ROWS * (size_t)widest);
    double *next = malloc(sizeof(double) * FM_REF_ROWS * (size_t)widest);
    double *cat = malloc(sizeof(double) * FM_REF_ROWS * (size_t)widest_in);
    fm_status st = FM_OK;
    int oom = cur == NULL || next == NULL || cat == NULL;
    for (int v = 0; v <= L && !oom; ++v)
        if (keep[v] && (saved[v] = malloc(sizeof(double) * FM_REF_ROWS * (size_t)spec->width[v])) == NULL)
            oom = 1;
    for (int l = 0; l < L; ++l) {
        wl[l] = w[l];
        if (quant && !oom && (wl[l] = wq[l] = fm_ref_quant_weights(spec, l, w[l])) == NULL)
            oom = 1;
    }
    if (oom) {
        st = fm_fail(err, FM_ERR_NOMEM, "out of memory for the CPU forward (%d features wide)", widest_in);
        goto cleanup;
    }
    const int k0 = spec->width[0], n_last = spec->width[L];
    for (int64_t r0 = 0; r0 < rows; r0 += FM_REF_ROWS) {
        int nr = rows - r0 < FM_REF_ROWS ? (int)(rows - r0) : FM_REF_ROWS;
        for (int r = 0; r < nr; ++r)
            for (int k = 0; k < k0; ++k)
                cur[(size_t)r * k0 + k] = fm_ref_x(spec, x + (r0 + r) * x_row, x_col, k);
        if (amax != NULL)
            fm_ref_amax(cur, (size_t)nr * (size_t)k0, &amax[0], &amax_nan[0]);
        for (size_t i = 0; quant && i < (size_t)nr * (size_t)k0; ++i)
            cur[i] = fm_ref_fake_quant(cur[i], spec->act_scale[0], qp);
        if (keep[0])
            memcpy(saved[0], cur, sizeof(double) * (size_t)nr * (size_t)k0);
        for (int l = 0; l < L; ++l) {
            int n_out = spec->width[l + 1];
            size_t count = (size_t)nr * (size_t)n_out;
            const double *in = fm_ref_input(spec, l, cur, saved[0], nr, cat);
            fm_ref_linear(in, nr, fm_spec_in_features(spec, l), wl[l], spec->has_bias[l] ? b[l] : NULL, n_out, next);
            /* an 8-bit GEMM chain's norm layer: its GEMM stores z = W h + b in float16 for the row pass (float32 z,
             * then rounded to nearest even: fm_spec_z16), a layernorm's or softmax's with its bias less the bias's
             * mean (blind to it: python/fusedmlp/_api.py, _prenorm_net) */
            if (quant && z16 && spec->norm[l] != FM_NORM_NONE) {
                const double shift = spec->norm[l] == FM_NORM_RMS ? 0.0 : fm_ref_mean(spec->has_bias[l] ? b[l] : NULL,
                                                                                       n_out);
                for (size_t i = 0; i < count; ++i)
                    next[i] = (double)fm_half_to_float(fm_float_to_half((float)(next[i] - shift)));
            }
            if (spec->norm[l] != FM_NORM_NONE)
                fm_ref_norm(spec, l, next, nr, n_out);
            if ((st = fm_spec_act_eval(spec, l, next, (size_t)nr, err)) != FM_OK)
                goto cleanup;
            if (spec->res_op[l] != FM_RES_NONE) { /* r: the kept value, as wide as this output */
                const double *r = saved[spec->res_src[l] + 1];
                for (size_t i = 0; i < count; ++i)
                    next[i] = spec->res_op[l] == FM_RES_ADD ? next[i] + r[i] : next[i] * r[i];
                if ((st = fm_expr_eval(spec->res_post[l], next, next, count, err)) != FM_OK)
                    goto cleanup;
            }
            for (size_t i = 0; i < count; ++i) /* float32 storage between layers */
                next[i] = (double)(float)next[i];
            if (amax != NULL)
                fm_ref_amax(next, count, &amax[l + 1], &amax_nan[l + 1]);
            /* int8 relu layers without residual or norm: the kernels fold relu into the clamp (fm_plan.q_fold), so a
             * NaN there is stored as 0, not -127 */
            const char *unary = fm_spec_act_unary(spec, l);
            const int relu_clamp = qp == FM_PREC_INT8 && spec->res_op[l] == FM_RES_NONE &&
                                   spec->norm[l] == FM_NORM_NONE && unary != NULL && strcmp(unary, "relu") == 0;
            for (size_t i = 0; quant && l + 1 < L && i < count; ++i) /* 8-bit storage: layer l + 1's input scale */
                next[i] = relu_clamp && isnan(next[i]) ? 0.0
                                                       : fm_ref_fake_quant(next[i], spec->act_scale[l + 1], qp);
            if (keep[l + 1])
                memcpy(saved[l + 1], next, sizeof(double) * count);
            double *swap = cur;
            cur = next;
            next = swap;
        }
        for (size_t i = 0; i < (size_t)nr * (size_t)n_last; ++i)
            y[(size_t)r0 * n_last + i] = (float)cur[i];
    }
    for (int v = 0; amax != NULL && v <= L; ++v)
        if (amax_nan[v])
            amax[v] = NAN;
cleanup:
    for (int l = 0; l < L; ++l)
        free(wq[l]);
    for (int v = 0; v <= L; ++v)
        free(saved[v]);
    free(cur);
    free(next);
    free(cat);
    return st;
}
