/*
 * expr_emit.c - the readers of an expression tree that write or compute its value: the CUDA emitter, the canonical
 * text (one walker for both), and the vectorised float64 evaluator (the CPU forward's and the tests' oracle).
 */
#include "expr_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------------ numbers */

/* Formats |v| with prec significant digits into buf, replacing the locale's decimal point (whatever its bytes)
 * with '.': %g prints only digits, 'e', signs and that point. */
static void fm_format_abs(double v, int prec, char *buf, size_t size) {
    char tmp[64];
    snprintf(tmp, sizeof tmp, "%.*g", prec, fabs(v));
    size_t j = 0;
    for (size_t i = 0; tmp[i] != '\0' && j + 1 < size; i++) {
        char c = tmp[i];
        if (fm_is_digit(c) || c == 'e' || c == '+' || c == '-')
            buf[j++] = c;
        else if (j == 0 || buf[j - 1] != '.')
            buf[j++] = '.';
    }
    buf[j] = '\0';
}

/* The shortest text that reads back as exactly |v| (for canonical text and cache keys), written without an
 * exponent up to 1e17: "20", not the "2e+01" that %.1g gives. */
static void fm_format_shortest(double v, char *buf, size_t size) {
    int prec = 1;
    for (; prec < 17; prec++) {
        double back = 0.0;
        fm_format_abs(v, prec, buf, size);
        if (fm_scan_number(buf, &back) == strlen(buf) && back == fabs(v))
            break;
    }
    char tmp[64];
    snprintf(tmp, sizeof tmp, "%.*e", prec - 1, fabs(v));
    const char *ex = strchr(tmp, 'e');
    int x10 = ex != NULL ? atoi(ex + 1) : 0; /* %g prints fixed-point when -4 <= x10 < precision */
    if (x10 >= prec && x10 < 17)
        prec = x10 + 1;
    fm_format_abs(v, prec, buf, size);
}

/* A float literal that rounds back to the same float: 9 significant digits suffice for binary32 (IEEE 754-2008,
 * 5.12.2). "1" gets ".0" because "1f" is not a C literal; negatives are parenthesised so that "-" never meets
 * another operator. */
static void fm_emit_float(fm_str *out, double v) {
    char buf[64];
    float f = (float)v;
    fm_format_abs((double)f, 9, buf, sizeof buf);
    if (strchr(buf, '.') == NULL && strchr(buf, 'e') == NULL)
        strcat(buf, ".0");
    fm_str_printf(out, signbit(f) ? "(-%sf)" : "%sf", buf);
}

/* ------------------------------------------------------------------------------------------------ emit, text */

/* One walker writes both texts: CUDA when var is set (float literals, CUDA spellings, x^n unrolled), canonical when
 * var is NULL (shortest exact numbers, whitelist names, pi and e by name). Both are fully parenthesised. */
static void fm_write_node(const fm_node *n, const char *var, fm_str *out);

static void fm_write_number(double v, const char *var, fm_str *out) {
    char buf[64];
    if (var != NULL) {
        fm_emit_float(out, v);
        return;
    }
    fm_format_shortest(v, buf, sizeof buf);
    fm_str_printf(out, signbit(v) ? "(-%s)" : "%s", buf);
}

/* x^n with a small integer n: multiplications in the order fm_powi (activations.cuh) and the CPU use, inline for a
 * leaf base, through fm_powi otherwise so a subexpression is neither copied nor computed twice. */
static void fm_emit_powi(const fm_node *base, int k, const char *var, fm_str *out) {
    if (k == 0) {
        fm_str_append(out, "1.0f");
        return;
    }
    if (base->nargs > 0) {
        fm_str_append(out, "fm_powi(");
        fm_write_node(base, var, out);
        fm_str_printf(out, ", %d)", k);
        return;
    }
    fm_str_append(out, k < 0 ? "(1.0f / (" : "(");
    for (int i = 0; i < (k < 0 ? -k : k); i++) {
        fm_str_append(out, i > 0 ? " * " : "");
        fm_write_node(base, var, out);
    }
    fm_str_append(out, k < 0 ? "))" : ")");
}

static void fm_write_node(const fm_node *n, const char *var, fm_str *out) {
    static const char *const ops[] = {
        [FM_NODE_ADD] = " + ", [FM_NODE_SUB] = " - ", [FM_NODE_MUL] = " * ", [FM_NODE_DIV] = " / ", [FM_NODE_POW] = " ^ "};
    int ok = 0, k = n->kind == FM_NODE_POW ? fm_powi_exponent(n, &ok) : 0;
    switch (n->kind) {
    case FM_NODE_NUM: fm_write_number(n->value, var, out); return;
    case FM_NODE_VAR: fm_str_append(out, var != NULL ? var : "x"); return;
    case FM_NODE_PI: var != NULL ? fm_emit_float(out, fm_pi) : fm_str_append(out, "pi"); return;
    case FM_NODE_E: var != NULL ? fm_emit_float(out, fm_e) : fm_str_append(out, "e"); return;
    case FM_NODE_NEG: fm_str_append(out, "(-"); break;
    case FM_NODE_POW:
        if (var != NULL && ok) {
            fm_emit_powi(n->arg[0], k, var, out);
            return;
        }
        fm_str_append(out, var != NULL ? "powf(" : "(");
        break;
    case FM_NODE_ADD:
    case FM_NODE_SUB:
    case FM_NODE_MUL:
    case FM_NODE_DIV: fm_str_append(out, "("); break;
    case FM_NODE_CALL:
        fm_str_append(out, var != NULL ? fm_funcs[n->func].cuda : fm_funcs[n->func].name);
        fm_str_append(out, "(");
        break;
    }
    const char *sep = n->kind == FM_NODE_CALL || (n->kind == FM_NODE_POW && var != NULL) ? ", " : ops[n->kind];
    for (int i = 0; i < n->nargs; i++) {
        if (i > 0)
            fm_str_append(out, sep);
        fm_write_node(n->arg[i], var, out);
    }
    fm_str_append(out, ")");
}

fm_status fm_expr_emit_cuda(const fm_expr *e, const char *var, fm_str *out, fm_error *err) {
    if (e == NULL || var == NULL || out == NULL)
        return fm_fail(err, FM_ERR_INTERNAL, "fm_expr_emit_cuda: NULL argument");
    /* var comes from the renderer, but it lands in source too: only an identifier may */
    int ok = fm_is_alpha(var[0]);
    for (size_t i = 1; ok && var[i] != '\0'; i++)
        ok = fm_is_alnum(var[i]) && i < 64;
    if (!ok)
        return fm_fail(err, FM_ERR_INTERNAL, "fm_expr_emit_cuda: variable name is not a C identifier");
    fm_write_node(e->root, var, out);
    if (out->oom)
        return fm_fail(err, FM_ERR_NOMEM, "out of memory emitting an activation expression");
    return FM_OK;
}

void fm_expr_to_string(const fm_expr *e, fm_str *out) {
    if (e != NULL && out != NULL)
        fm_write_node(e->root, NULL, out);
}

const char *fm_expr_unary(const fm_expr *e) {
    const fm_node *n = e != NULL ? e->root : NULL;
    while (n != NULL && n->kind == FM_NODE_CALL && fm_funcs[n->func].cuda[0] == '\0') /* none(.), identity(.) */
        n = n->arg[0];
    if (n == NULL)
        return NULL;
    if (n->kind == FM_NODE_VAR)
        return "";
    if (n->kind == FM_NODE_CALL && n->nargs == 1 && n->arg[0]->kind == FM_NODE_VAR)
        return fm_funcs[n->func].name;
    return NULL;
}

const char *fm_expr_pair_fn(const fm_expr *e) {
    const char *name = fm_expr_unary(e);
    if (name == NULL)
        return NULL;
    if (strcmp(name, "") == 0)
        return "fm_pack2";
    return strcmp(name, "relu") == 0 ? "fm_relu2" : NULL;
}

/* ------------------------------------------------------------------------------------------------ eval */

static void fm_fill(double *d, double v, size_t n) {
    for (size_t i = 0; i < n; i++)
        d[i] = v;
}

/* Evaluates n (<= FM_EXPR_CHUNK) values of node into dst. The first operand is computed in dst itself, the others
 * in scratch buffers of FM_EXPR_CHUNK doubles; each level uses at most two, so 2 * height buffers suffice. */
static void fm_eval_node(const fm_node *nd, const double *x, double *dst, double *scratch, size_t n) {
    double *t = scratch, *more = scratch + (size_t)(nd->nargs > 1 ? nd->nargs - 1 : 0) * FM_EXPR_CHUNK;
    switch (nd->kind) {
    case FM_NODE_NUM: fm_fill(dst, nd->value, n); return;
    case FM_NODE_PI: fm_fill(dst, fm_pi, n); return;
    case FM_NODE_E: fm_fill(dst, fm_e, n); return;
    case FM_NODE_VAR: memcpy(dst, x, n * sizeof *dst); return;
    default: break;
    }
    fm_eval_node(nd->arg[0], x, dst, more, n);
    int ok = 0, k = nd->kind == FM_NODE_POW ? fm_powi_exponent(nd, &ok) : 0;
    if (nd->kind == FM_NODE_POW && ok) {
        int m = k < 0 ? -k : k;
        for (size_t i = 0; i < n; i++) {
            double b = dst[i], r = m > 0 ? b : 1.0;
            for (int j = 1; j < m; j++)
                r *= b;
            dst[i] = k < 0 ? 1.0 / r : r;
        }
        return;
    }
    for (int a = 1; a < nd->nargs; a++)
        fm_eval_node(nd->arg[a], x, t + (size_t)(a - 1) * FM_EXPR_CHUNK, more, n);
#define FM_EACH(stmt)                                                                                               \
    for (size_t i = 0; i < n; i++)                                                                                  \
        stmt;                                                                                                       \
    return
    switch (nd->kind) {
    case FM_NODE_NEG: FM_EACH(dst[i] = -dst[i]);
    case FM_NODE_ADD: FM_EACH(dst[i] += t[i]);
    case FM_NODE_SUB: FM_EACH(dst[i] -= t[i]);
    case FM_NODE_MUL: FM_EACH(dst[i] *= t[i]);
    case FM_NODE_DIV: FM_EACH(dst[i] /= t[i]);
    case FM_NODE_POW: FM_EACH(dst[i] = pow(dst[i], t[i]));
    case FM_NODE_CALL: {
        const double *args[FM_EXPR_MAX_ARGS] = {dst, nd->nargs > 1 ? t : dst, nd->nargs > 2 ? t + FM_EXPR_CHUNK : dst};
        fm_funcs[nd->func].cpu(dst, args, n);
        return;
    }
    default: return;
    }
#undef FM_EACH
}

fm_status fm_expr_eval(const fm_expr *e, const double *in, double *out, size_t n, fm_error *err) {
    if (e == NULL || n == 0)
        return FM_OK;
    /* buffer 0 holds a copy of the input chunk, so out may alias in; then 2 per tree level */
    size_t buffers = 1 + 2 * (size_t)e->root->height;
    double *pool = malloc(buffers * FM_EXPR_CHUNK * sizeof *pool);
    if (pool == NULL)
        return fm_fail(err, FM_ERR_NOMEM, "out of memory evaluating an activation expression (%zu bytes)",
                       buffers * FM_EXPR_CHUNK * sizeof *pool);
    for (size_t off = 0; off < n; off += FM_EXPR_CHUNK) {
        size_t m = n - off < FM_EXPR_CHUNK ? n - off : FM_EXPR_CHUNK;
        memcpy(pool, in + off, m * sizeof *pool);
        fm_eval_node(e->root, pool, out + off, pool + FM_EXPR_CHUNK, m);
    }
    free(pool);
    return FM_OK;
}
