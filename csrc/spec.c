/*
 * spec.c - validates an MLP description: weight shapes that chain, bias lengths, one parsed activation per layer.
 * Width limits are the plan's business (they depend on the GPU); this file checks only what is wrong anywhere.
 */
#include "fm.h"

#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The activation text for an error message: at most 60 bytes, non-printable bytes as '?', since the text is
 * whatever the user passed and the message goes to a terminal. */
static void fm_spec_quote(const char *text, char *buf, size_t size) {
    size_t j = 0, i = 0;
    for (; text[i] != '\0' && i < 60 && j + 4 < size; i++) {
        unsigned char c = (unsigned char)text[i];
        buf[j++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    if (text[i] != '\0' && j + 4 < size) {
        memcpy(buf + j, "...", 3);
        j += 3;
    }
    buf[j] = '\0';
}

/* Checks layer l's shapes; x_width is the network input's (for a concat layer), cat its FM_CAT_* mode. */
static fm_status fm_spec_check_layer(int l, const int64_t *shapes, const int64_t *bias_len, int cat, fm_error *err) {
    int64_t out = shapes[2 * l], in = shapes[2 * l + 1];
    if (out < 1 || in < 1)
        return fm_fail(err, FM_ERR_SHAPE,
                       "weights[%d] has shape (%lld, %lld); every dimension must be >= 1", l, (long long)out,
                       (long long)in);
    if (out > INT_MAX || in > INT_MAX)
        return fm_fail(err, FM_ERR_LIMIT, "weights[%d] has shape (%lld, %lld); dimensions above %d are not supported",
                       l, (long long)out, (long long)in, INT_MAX);
    if (cat != FM_CAT_NONE && cat != FM_CAT_AFTER && cat != FM_CAT_BEFORE)
        return fm_fail(err, FM_ERR_VALUE, "concat mode %d of layer %d is not none (0), after (1) or before (2)", cat, l);
    if (cat != FM_CAT_NONE && l == 0)
        return fm_fail(err, FM_ERR_VALUE, "layer 0 has an input concat; its input already is the network input x, "
                                          "so only layers 1.. can concatenate x to their input");
    int64_t x_width = shapes[1], want = l == 0 ? in : shapes[2 * (l - 1)] + (cat != FM_CAT_NONE ? x_width : 0);
    if (in != want) {
        if (cat != FM_CAT_NONE)
            fm_fail(err, FM_ERR_SHAPE,
                    "weights[%d] has shape (%lld, %lld), but layer %d's input is the concat of layer %d's %lld outputs "
                    "and the network's %lld inputs: %lld features",
                    l, (long long)out, (long long)in, l, l - 1, (long long)shapes[2 * (l - 1)], (long long)x_width,
                    (long long)want);
        else
            fm_fail(err, FM_ERR_SHAPE,
                    "weights[%d] has shape (%lld, %lld) but weights[%d] has shape (%lld, %lld): layer %d takes %lld "
                    "input features while layer %d produces %lld",
                    l, (long long)out, (long long)in, l - 1, (long long)shapes[2 * (l - 1)],
                    (long long)shapes[2 * (l - 1) + 1], l, (long long)in, l - 1, (long long)shapes[2 * (l - 1)]);
        fm_error_hint(err, "weights use nn.Linear.weight's layout (out_features, in_features): each layer's "
                           "in_features must equal the previous layer's out_features (plus the network's "
                           "in_features where the layer concatenates the input)");
        return FM_ERR_SHAPE;
    }
    if (bias_len != NULL && bias_len[l] != -1 && bias_len[l] != out)
        return fm_fail(err, FM_ERR_SHAPE, "biases[%d] has %lld elements; layer %d has %lld outputs (weights[%d].shape[0])",
                       l, (long long)bias_len[l], l, (long long)out, l);
    return FM_OK;
}

/* Parses layer l's activation; a NULL text is the identity. On failure the parser's column is kept and its message
 * gets the layer and the text in front. */
static fm_status fm_spec_parse_labelled(const char *label, int l, const char *text, fm_expr **act, fm_error *err) {
    fm_error perr = {0};
    fm_status st = fm_expr_parse(text != NULL ? text : "none", act, &perr);
    if (st == FM_OK)
        return FM_OK;
    if (err != NULL && err->status == FM_OK) {
        char quoted[80];
        fm_spec_quote(text != NULL ? text : "none", quoted, sizeof quoted);
        fm_fail(err, st, "%s of layer %d ('%s'): %s", label, l, quoted, perr.message);
        err->column = perr.column;
        if (perr.hint[0] != '\0')
            fm_error_hint(err, "%s", perr.hint);
    }
    fm_error_clear(&perr);
    return st;
}

/* Layer l's activation: one expression, or column pieces "expr:count | expr:count ..." (fm_spec.act_pieces), whose
 * counts must add up to the layer's outputs, on the last layer only (the kernels' epilogues know the column there). */
static fm_status fm_spec_parse_act(fm_spec *spec, int l, int last, int outputs, const char *text, fm_error *err) {
    if (text == NULL || strchr(text, '|') == NULL)
        return fm_spec_parse_labelled("activation", l, text, &spec->act[l], err);
    char quoted[80];
    fm_spec_quote(text, quoted, sizeof quoted);
    if (!last)
        return fm_fail(err, FM_ERR_LIMIT, "activation of layer %d ('%s') has column pieces; pieces are supported "
                       "on the last layer only", l, quoted);
    int n = 0, total = 0;
    for (const char *p = text; *p != '\0'; n++) {
        const char *bar = strchr(p, '|'), *end = bar != NULL ? bar : p + strlen(p), *colon = NULL;
        for (const char *q = p; q < end; q++)
            if (*q == ':')
                colon = q;
        if (n == FM_ACT_PIECES)
            return fm_fail(err, FM_ERR_LIMIT, "activation of layer %d ('%s') has more than %d column pieces", l,
                           quoted, FM_ACT_PIECES);
        char *stop = NULL;
        long cols = colon != NULL ? strtol(colon + 1, &stop, 10) : 0;
        while (stop != NULL && stop < end && isspace((unsigned char)*stop))
            stop++;
        if (colon == NULL || stop == colon + 1 || stop != end || cols < 1 || cols > outputs)
            return fm_fail(err, FM_ERR_VALUE, "activation of layer %d ('%s'): piece %d is not 'expression:columns' "
                           "with a column count from 1 to %d", l, quoted, n, outputs);
        char *piece = malloc((size_t)(colon - p) + 1);
        if (piece == NULL)
            return fm_fail(err, FM_ERR_NOMEM, "out of memory");
        memcpy(piece, p, (size_t)(colon - p));
        piece[colon - p] = '\0';
        fm_status st = fm_spec_parse_labelled("activation", l, piece, &spec->act_piece[l][n], err);
        free(piece);
        if (st != FM_OK)
            return st;
        spec->act_cols[l][n] = (int)cols;
        total += (int)cols;
        p = bar != NULL ? bar + 1 : end;
    }
    spec->act[l] = spec->act_piece[l][0];
    spec->act_pieces[l] = n;
    if (total != outputs)
        return fm_fail(err, FM_ERR_VALUE, "activation of layer %d ('%s'): its pieces cover %d columns; the layer "
                       "has %d outputs", l, quoted, total, outputs);
    return FM_OK;
}

const char *fm_spec_act_unary(const fm_spec *spec, int l) {
    return spec->act_pieces[l] ? NULL : fm_expr_unary(spec->act[l]);
}

void fm_spec_act_string(const fm_spec *spec, int l, fm_str *out) {
    if (!spec->act_pieces[l]) {
        fm_expr_to_string(spec->act[l], out);
        return;
    }
    for (int i = 0; i < spec->act_pieces[l]; i++) {
        fm_str_append(out, i ? " | " : "");
        fm_expr_to_string(spec->act_piece[l][i], out);
        fm_str_printf(out, ":%d", spec->act_cols[l][i]);
    }
}

fm_status fm_spec_act_eval(const fm_spec *spec, int l, double *v, size_t rows, fm_error *err) {
    const size_t n = (size_t)spec->width[l + 1];
    if (!spec->act_pieces[l])
        return fm_expr_eval(spec->act[l], v, v, rows * n, err);
    for (size_t r = 0; r < rows; r++)
        for (int i = 0, c = 0; i < spec->act_pieces[l]; c += spec->act_cols[l][i++]) {
            fm_status st = fm_expr_eval(spec->act_piece[l][i], v + r * n + c, v + r * n + c,
                                        (size_t)spec->act_cols[l][i], err);
            if (st != FM_OK)
                return st;
        }
    return FM_OK;
}

fm_status fm_spec_act_emit(const fm_spec *spec, int l, const char *var, fm_str *out, fm_error *err) {
    if (!spec->act_pieces[l])
        return fm_expr_emit_cuda(spec->act[l], var, out, err);
    for (int i = 0, c = 0; i < spec->act_pieces[l]; c += spec->act_cols[l][i++]) {
        if (i + 1 < spec->act_pieces[l])
            fm_str_printf(out, "col < %d ? (", c + spec->act_cols[l][i]);
        else
            fm_str_append(out, "(");
        fm_status st = fm_expr_emit_cuda(spec->act_piece[l][i], var, out, err);
        if (st != FM_OK)
            return st;
        fm_str_append(out, i + 1 < spec->act_pieces[l] ? ") : " : ")");
    }
    return FM_OK;
}

fm_status fm_spec_init(fm_spec *spec, int num_layers, const int64_t *shapes, const int64_t *bias_len,
                       const char *const *activations, const int *concat, fm_error *err) {
    if (spec == NULL)
        return fm_fail(err, FM_ERR_INTERNAL, "fm_spec_init: spec is NULL");
    memset(spec, 0, sizeof *spec);
    fm_status st = FM_OK;
    if (num_layers < 1) {
        st = fm_fail(err, FM_ERR_VALUE, "the network has %d layers; it needs at least 1", num_layers);
        goto cleanup;
    }
    if (num_layers > FM_MAX_LAYERS) {
        st = fm_fail(err, FM_ERR_LIMIT, "the network has %d layers; at most %d fit one fused kernel", num_layers,
                     FM_MAX_LAYERS);
        goto cleanup;
    }
    if (shapes == NULL) {
        st = fm_fail(err, FM_ERR_INTERNAL, "fm_spec_init: shapes is NULL");
        goto cleanup;
    }
    for (int l = 0; l < num_layers; l++)
        if ((st = fm_spec_check_layer(l, shapes, bias_len, concat ? concat[l] : FM_CAT_NONE, err)) != FM_OK)
            goto cleanup;
    for (int l = 0; l < num_layers; l++) {
        if ((st = fm_spec_parse_act(spec, l, l == num_layers - 1, (int)shapes[2 * l],
                                    activations != NULL ? activations[l] : NULL, err)) != FM_OK)
            goto cleanup;
        spec->width[l] = l == 0 ? (int)shapes[1] : (int)shapes[2 * (l - 1)];
        spec->cat[l] = concat ? concat[l] : FM_CAT_NONE;
        spec->has_bias[l] = bias_len != NULL && bias_len[l] != -1;
        spec->z_bound[l] = INFINITY; /* until fm_spec_bound_preacts sees the weights */
        spec->blocks[l] = 1;         /* until fm_spec_find_blocks does */
    }
    spec->width[num_layers] = (int)shapes[2 * (num_layers - 1)];
    spec->num_layers = num_layers;
    spec->x_features = spec->width[0];
    return FM_OK;
cleanup:
    fm_spec_free(spec);
    return st;
}

void fm_spec_free(fm_spec *spec) {
    if (spec == NULL)
        return;
    for (int l = 0; l < FM_MAX_LAYERS; l++) {
        for (int i = 0; i < FM_ACT_PIECES; i++)
            fm_expr_free(spec->act_piece[l][i]);
        if (!spec->act_pieces[l]) /* (with pieces, act[l] is piece 0) */
            fm_expr_free(spec->act[l]);
        fm_expr_free(spec->res_post[l]);
        free(spec->norm_w[l]);
        free(spec->norm_b[l]);
        free(spec->w_scale[l]);
    }
    free(spec->enc_src);
    free(spec->enc_sin);
    free(spec->enc_scale);
    free(spec->enc_phase);
    memset(spec, 0, sizeof *spec);
}

int fm_spec_in_features(const fm_spec *spec, int l) {
    return spec->width[l] + (spec->cat[l] != FM_CAT_NONE ? spec->width[0] : 0);
}

int fm_spec_z16(const fm_spec *spec) {
    for (int v = 0; fm_prec_is_8bit(spec->quant) && v <= spec->num_layers; ++v)
        if (spec->width[v] > FM_MAX_ONCHIP_WIDTH)
            return 1;
    return 0;
}

fm_status fm_spec_set_residual(fm_spec *spec, int layer, int op, const char *post, int src, fm_error *err) {
    if (layer < 0 || layer >= spec->num_layers)
        return fm_fail(err, FM_ERR_VALUE, "residual layer %d does not exist; the network has layers 0..%d", layer,
                       spec->num_layers - 1);
    if (op != FM_RES_ADD && op != FM_RES_MUL)
        return fm_fail(err, FM_ERR_VALUE, "residual op %d of layer %d is not add (%d) or mul (%d)", op, layer,
                       FM_RES_ADD, FM_RES_MUL);
    if (src < -1 || src >= layer)
        return fm_fail(err, FM_ERR_VALUE,
                       "residual of layer %d reads value %d; it must be -1 (the network input) or an earlier layer's "
                       "output, 0..%d (%d: the layer's own input)",
                       layer, src, layer - 1, layer - 1);
    if (spec->width[src + 1] != spec->width[layer + 1]) {
        char what[64];
        if (src == -1)
            snprintf(what, sizeof what, "the network input");
        else
            snprintf(what, sizeof what, "layer %d's output%s", src, src == layer - 1 ? " (its own input)" : "");
        return fm_fail(err, FM_ERR_SHAPE,
                       "layer %d has %d output features but its residual operand, %s, has %d; a residual needs equal "
                       "widths",
                       layer, spec->width[layer + 1], what, spec->width[src + 1]);
    }
    fm_expr *e = NULL;
    fm_status st = fm_spec_parse_labelled("residual activation", layer, post, &e, err);
    if (st != FM_OK)
        return st;
    fm_expr_free(spec->res_post[layer]);
    spec->res_post[layer] = e;
    spec->res_op[layer] = op;
    spec->res_src[layer] = src;
    return FM_OK;
}

const char *fm_norm_name(int kind) {
    return kind == FM_NORM_LAYER         ? "layernorm"
           : kind == FM_NORM_RMS         ? "rmsnorm"
           : kind == FM_NORM_SOFTMAX     ? "softmax"
           : kind == FM_NORM_LOG_SOFTMAX ? "log_softmax"
           : kind == FM_NORM_NONE        ? "none"
                                         : "?";
}

/* A copy of n floats (n >= 1), or NULL when malloc fails. */
static float *fm_spec_copy_floats(const float *src, int64_t n) {
    float *dst = malloc(sizeof(float) * (size_t)n);
    if (dst != NULL)
        memcpy(dst, src, sizeof(float) * (size_t)n);
    return dst;
}

fm_status fm_spec_set_norm(fm_spec *spec, int layer, int kind, double eps, const float *gamma, int64_t weight_len,
                           const float *beta, int64_t bias_len, fm_error *err) {
    if (layer < 0 || layer >= spec->num_layers)
        return fm_fail(err, FM_ERR_VALUE, "norm layer %d does not exist; the network has layers 0..%d", layer,
                       spec->num_layers - 1);
    if (kind < FM_NORM_LAYER || kind > FM_NORM_LOG_SOFTMAX)
        return fm_fail(err, FM_ERR_VALUE, "norm kind %d of layer %d is not layernorm (%d), rmsnorm (%d), softmax (%d) or "
                       "log_softmax (%d)", kind, layer, FM_NORM_LAYER, FM_NORM_RMS, FM_NORM_SOFTMAX,
                       FM_NORM_LOG_SOFTMAX);
    if (!(eps >= 0.0) || !isfinite(eps))
        return fm_fail(err, FM_ERR_VALUE, "norm eps of layer %d is %g; it must be a finite number >= 0", layer, eps);
    if (FM_NORM_IS_SOFT(kind) && (gamma != NULL || beta != NULL || eps != 0.0))
        return fm_fail(err, FM_ERR_VALUE, "the %s of layer %d takes no %s; it has no eps, weight or bias",
                       fm_norm_name(kind), layer, gamma != NULL ? "weight" : beta != NULL ? "bias" : "eps");
    const int n = spec->width[layer + 1];
    if ((gamma != NULL && weight_len != n) || (beta != NULL && bias_len != n))
        return fm_fail(err, FM_ERR_SHAPE, "norm %s of layer %d has %lld elements; the layer has %d outputs",
                       gamma != NULL && weight_len != n ? "weight" : "bias", layer,
                       (long long)(gamma != NULL && weight_len != n ? weight_len : bias_len), n);
    float *w = gamma != NULL ? fm_spec_copy_floats(gamma, n) : NULL;
    float *b = beta != NULL ? fm_spec_copy_floats(beta, n) : NULL;
    if ((gamma != NULL && w == NULL) || (beta != NULL && b == NULL)) {
        free(w);
        free(b);
        return fm_fail(err, FM_ERR_NOMEM, "out of memory copying layer %d's norm weights (%d floats)", layer, n);
    }
    free(spec->norm_w[layer]);
    free(spec->norm_b[layer]);
    spec->norm[layer] = kind;
    spec->norm_eps[layer] = eps;
    spec->norm_w[layer] = w;
    spec->norm_b[layer] = b;
    spec->z_bound[layer] = INFINITY;
    return FM_OK;
}

fm_status fm_spec_set_encoding(fm_spec *spec, int x_features, int cols, const int *src, const int *sin,
                               const float *scale, const float *phase, fm_error *err) {
    if (cols != spec->width[0])
        return fm_fail(err, FM_ERR_SHAPE, "the input encoding makes %d columns; layer 0 takes %d inputs", cols,
                       spec->width[0]);
    if (x_features < 1)
        return fm_fail(err, FM_ERR_VALUE, "the input encoding reads x of %d features; x needs at least 1", x_features);
    for (int j = 0; j < cols; ++j) {
        if (src[j] < 0 || src[j] >= x_features)
            return fm_fail(err, FM_ERR_VALUE, "input encoding column %d reads feature %d of x; x has features 0..%d", j,
                           src[j], x_features - 1);
        if (sin[j] != 0 && sin[j] != 1)
            return fm_fail(err, FM_ERR_VALUE, "input encoding column %d has kind %d; 0 (x) or 1 (sin)", j, sin[j]);
        if (!isfinite(scale[j]) || !isfinite(phase[j]))
            return fm_fail(err, FM_ERR_VALUE, "input encoding column %d has scale %g and phase %g; both must be finite",
                           j, (double)scale[j], (double)phase[j]);
    }
    int *s = malloc(sizeof(int) * (size_t)cols), *k = malloc(sizeof(int) * (size_t)cols);
    float *c = fm_spec_copy_floats(scale, cols), *p = fm_spec_copy_floats(phase, cols);
    if (s == NULL || k == NULL || c == NULL || p == NULL) {
        free(s);
        free(k);
        free(c);
        free(p);
        return fm_fail(err, FM_ERR_NOMEM, "out of memory copying the input encoding (%d columns)", cols);
    }
    memcpy(s, src, sizeof(int) * (size_t)cols);
    memcpy(k, sin, sizeof(int) * (size_t)cols);
    free(spec->enc_src);
    free(spec->enc_sin);
    free(spec->enc_scale);
    free(spec->enc_phase);
    spec->enc_src = s;
    spec->enc_sin = k;
    spec->enc_scale = c;
    spec->enc_phase = p;
    spec->enc_cols = cols;
    spec->x_features = x_features;
    return FM_OK;
}

void fm_spec_bound_preacts(fm_spec *spec, const float *const *w, const float *const *b) {
    for (int l = 0; l < spec->num_layers; l++) {
        spec->z_bound[l] = INFINITY;
        /* a norm layer's activation reads gamma * z' + beta, not z: no bound from the weights (INFINITY) */
        if (l == 0 || spec->cat[l] != FM_CAT_NONE || spec->res_op[l - 1] != FM_RES_NONE || spec->norm[l] != FM_NORM_NONE)
            continue;
        double lo, hi;
        fm_expr_range(spec->act[l - 1], -INFINITY, INFINITY, &lo, &hi);
        const double m = fmax(fabs(lo), fabs(hi)); /* |h_k| <= m */
        if (!isfinite(m))
            continue;
        const int n = spec->width[l + 1], k = spec->width[l];
        double bound = 0.0;
        for (int j = 0; j < n; j++) {
            double row = b != NULL && b[l] != NULL ? fabs((double)b[l][j]) : 0.0;
            for (int i = 0; i < k; i++)
                row += fabs((double)w[l][(size_t)j * (size_t)k + i]) * m;
            if (isnan(row)) {
                bound = INFINITY;
                break;
            }
            bound = fmax(bound, row);
        }
        spec->z_bound[l] = isfinite(bound) ? bound * 1.01 : INFINITY;
    }
}

/* Whether layer l's weights (n x k, row-major) are zero outside the b diagonal blocks of n / b rows by k / b columns. */
static int fm_spec_block_diagonal(const float *w, int n, int k, int b) {
    if (n % b != 0 || k % b != 0)
        return 0;
    const int nb = n / b, kb = k / b;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < k; i++)
            if (i / kb != j / nb && w[(size_t)j * (size_t)k + i] != 0.0f)
                return 0;
    return 1;
}

void fm_spec_find_blocks(fm_spec *spec, const float *const *w) {
    for (int l = 0; l < spec->num_layers; l++) {
        spec->blocks[l] = 1;
        if (spec->cat[l] != FM_CAT_NONE) /* (its weights' columns are two parts) */
            continue;
        for (int b = FM_MAX_BLOCKS; b >= 2 && spec->blocks[l] == 1; b--)
            if (fm_spec_block_diagonal(w[l], spec->width[l + 1], spec->width[l], b))
                spec->blocks[l] = b;
    }
}
