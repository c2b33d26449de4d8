/* render.c - fill a kernel template's {{NAME}} placeholders from the spec and plan.
 *
 * The renderer knows a fixed set of names; the template must use exactly that set. An unknown placeholder (a typo,
 * or a template newer than this core) and an unused one (a value the kernel silently ignores) are both errors, so
 * template and plan cannot drift apart unnoticed. */
#include "fm.h"

#include <math.h>
#include <string.h>

typedef struct fm_subst {
    const char *name;
    fm_str value;
    int used;
} fm_subst;

enum { FM_MAX_SUBST = 32 };

typedef struct fm_substs {
    fm_subst item[FM_MAX_SUBST];
    int count;
    fm_subst spill; /* takes values past FM_MAX_SUBST, so adding a placeholder cannot write out of bounds */
    int overflow;   /* set when the table was too small: fm_render reports it */
} fm_substs;

static fm_str *fm_subst_add(fm_substs *t, const char *name) {
    if (t->count == FM_MAX_SUBST) {
        t->overflow = 1;
        return &t->spill.value;
    }
    fm_subst *s = &t->item[t->count++];
    s->name = name;
    fm_str_append(&s->value, ""); /* an empty value is still a value */
    return &s->value;
}

/* Layer l's two-column activation (fm_common.cuh, "pair activations"): the device helper computing act of two
 * columns straight into the stored 16-bit pair, or NULL when the layer has none. *type: the stored type
 * (fm_plan_result_type). */
static const char *fm_render_pair(const fm_spec *spec, const fm_plan *p, int l, int *type) {
    *type = fm_plan_result_type(p, l);
    return *type == 0 || spec->act_pieces[l] ? NULL : fm_expr_pair_fn(spec->act[l]);
}

/* Appends act with every from[i] replaced by to[i]; returns 1 when anything was. */
static int fm_render_replace(const char *act, const char *const *from, const char *const *to, int n, fm_str *out) {
    int replaced = 0;
    const char *p = act;
    while (*p) {
        int hit = -1;
        for (int i = 0; i < n && hit < 0; ++i)
            if (strncmp(p, from[i], strlen(from[i])) == 0)
                hit = i;
        if (hit >= 0) {
            fm_str_append(out, to[hit]);
            p += strlen(from[hit]);
            replaced = 1;
        } else {
            fm_str_appendn(out, p++, 1);
        }
    }
    return replaced;
}

static const char *const fm_trig[] = {"fm_sin(", "fm_cos("};

/* The activation's fast form for the warpgroup kernels: `act`'s text with each fm_sin( / fm_cos( (which branch to an
 * out-of-line sinf for |x| >= 2^17, a call that split siren256's epilogue into one basic block per element: 3.41
 * against 2.02 ms without it, H100) as fm_sin_t(far, / fm_cos_t(far, , branch-free, noting far arguments in `far`
 * so the epilogue can redo its columns with `act`. Returns 1 when anything was replaced. */
static int fm_render_tracked(const char *act, fm_str *out) {
    static const char *const to[] = {"fm_sin_t(far, ", "fm_cos_t(far, "};
    return fm_render_replace(act, fm_trig, to, 2, out);
}

/* Layer l's bound class for its sin/cos forms (below): 0 where the weights' bound on its pre-activations
 * (fm_spec_bound_preacts) and its activation's interval arithmetic keep the arguments below 400, 1 below 1000, 2 for
 * no such bound (and for a layer with column pieces). */
static int fm_render_trig_class(const fm_spec *spec, int l) {
    double lo, hi;
    if (!isfinite(spec->z_bound[l]) || spec->act_pieces[l])
        return 2;
    const double bound = fm_expr_range(spec->act[l], -spec->z_bound[l], spec->z_bound[l], &lo, &hi);
    return bound < 400.0 ? 0 : bound < 1000.0 ? 1 : 2;
}

/* The form of layer l's sin/cos when its arguments stay small for every input (fm_render_trig_class), and its result
 * is stored in 16 bits (the forms' errors are under fp16's rounding, not under float32's): below 400, fm_sin_d (the
 * hardware unit on x itself, 4e-5 off); below 1000, fm_sin_b (one part of 2 pi first, 2.9e-5 off; 1000: margin for
 * the float32 rounding of the argument). Such a layer takes it in act itself: no far branch, no redo (a SIREN's
 * hidden layers: their input is a sine, in [-1, 1]). NULL: the layer keeps fm_sin, and the far check where it is
 * tracked. */
static const char *const *fm_render_trig_bounded(const fm_spec *spec, const fm_plan *p, int l) {
    static const char *const direct[] = {"fm_sin_d(", "fm_cos_d("};
    static const char *const reduced[] = {"fm_sin_b(", "fm_cos_b("};
    if (fm_plan_result_type(p, l) == 0)
        return NULL;
    const int c = fm_render_trig_class(spec, l);
    return c == 0 ? direct : c == 1 ? reduced : NULL;
}

int fm_render_weight_key(const fm_spec *spec, int l) {
    fm_str emitted = {0};
    fm_error err = {0};
    int trig = 1; /* (an activation that does not emit: assume it has a sine) */
    if (fm_spec_act_emit(spec, l, "x", &emitted, &err) == FM_OK)
        trig = emitted.data != NULL &&
               (strstr(emitted.data, fm_trig[0]) != NULL || strstr(emitted.data, fm_trig[1]) != NULL);
    fm_error_clear(&err);
    fm_str_free(&emitted);
    return spec->blocks[l] * 4 + (trig ? fm_render_trig_class(spec, l) : 3);
}

/* Layer l's diagonal blocks (fm_spec.blocks) where they fall on its padded widths (no padding: the blocks' edges are
 * the real widths'), else 1. The streamed kernel's looped wide layers skip the K pieces outside a column group's block
 * (fm_stream.cuh, fm_blocks); other forms multiply the zeros. */
static int fm_render_blocks(const fm_spec *spec, const fm_plan *p, int l) {
    return p->k_pad[l] == spec->width[l] && p->n_pad[l] == spec->width[l + 1] ? spec->blocks[l] : 1;
}

/* Layer l's description but for its name and offsets (what the template's code for it depends on): its
 * activation's forms, shapes, buffers and residual. Two layers whose bodies are equal compile to the same code. */
static fm_status fm_render_layer_body(const fm_spec *spec, const fm_plan *p, int l, fm_str *out, fm_error *err) {
    fm_str act = {0}, post = {0}, pair = {0}, tracked = {0}, emitted = {0};
    fm_status st = fm_spec_act_emit(spec, l, "x", &emitted, err);
    if (st == FM_OK && p->norm_half[l]) { /* the norm hands act h = x / 2 (fm_plan.norm_half) */
        fm_str_append(&act, strcmp(fm_expr_unary(spec->act[l]), "silu") == 0 ? "fm_silu_h(x)" : "fm_sigmoid_h(x)");
    } else if (st == FM_OK) {
        const char *const *bounded = fm_render_trig_bounded(spec, p, l);
        fm_render_replace(emitted.data ? emitted.data : "x", fm_trig, bounded ? bounded : fm_trig, 2, &act);
    }
    if (st == FM_OK && spec->res_post[l] != NULL)
        st = fm_expr_emit_cuda(spec->res_post[l], "x", &post, err);
    if (st == FM_OK) {
        const char *col = spec->act_pieces[l] ? " col" : ""; /* (the column: pieces' activations read it) */
        int far = fm_render_tracked(act.data ? act.data : "x", &tracked);
        int pair_type = 0;
        const char *pair_fn = fm_render_pair(spec, p, l, &pair_type);
        if (pair_fn != NULL)
            fm_str_printf(&pair,
                          "    static constexpr int PAIR = %d;  // act2: two columns as the stored 16-bit pair\n"
                          "    static __device__ __forceinline__ fm_u32 act2(float x0, float x1) "
                          "{ return %s<%d>(x0, x1); }\n",
                          pair_type, pair_fn, pair_type);
        else
            fm_str_append(&pair, "    static constexpr int PAIR = 0;\n");
        fm_str_printf(out,
                      "    static constexpr int K = %d, K0 = %d, KR = %d, N = %d, NR = %d, NC = %d;\n"
                      "    static constexpr int KC = %d;  // K columns per weight slot fill (streamed weights)\n"
                      "    static constexpr bool WIDE = %s;  // output to the warp's wide buffer, not registers\n"
                      "    static constexpr int BLOCKS = %d;  // block-diagonal weights: this many blocks (render.c)\n"
                      "    static constexpr int CAT = %d;  // x joins the input: 0 no, 1 after h, 2 before h\n"
                      "    static constexpr bool BIAS = %s;\n"
                      "    static constexpr bool PIPE = %s;  // its epilogue under the next layer's MMAs (plan.c)\n"
                      "    static constexpr int A0_BUF = %d, A1_BUF = %d, OUT_BUF = %d;\n"
                      "    static constexpr int RES = %d, RES_BUF = %d;  // residual: 0 none, 1 add, 2 mul\n"
                      "    static constexpr int NORM = %d;  // of W h + b before act: 0 none, 1 layernorm, 2 rmsnorm\n"
                      "    static constexpr bool CENTRED = %s;  // layernorm of centred weights: no mean (plan.c)\n"
                      "    static constexpr float EPS = %.9ef;\n"
                      "%s"
                      "%s"
                      "    static __device__ __forceinline__ float act(float x, int%s) { return %s; }\n"
                      "    static constexpr bool FAR = %s;  // act_t: act without sin/cos's far branch (render.c)\n"
                      "    static __device__ __forceinline__ float act_t(float x, int%s, bool &far) { (void)far; return %s; }\n"
                      "    static __device__ __forceinline__ float post(float x) { return %s; }\n",
                      p->k_pad[l], p->k0_pad[l], p->k_real[l], p->n_pad[l], p->n_real[l], p->n_chunk[l],
                      fm_plan_k_chunk(p, l), p->wide_out[l] ? "true" : "false", fm_render_blocks(spec, p, l), p->cat[l],
                      p->has_bias[l] ? "true" : "false", p->pipe[l] ? "true" : "false", p->a0_buf[l], p->a1_buf[l],
                      p->out_buf[l], spec->res_op[l],
                      p->res_buf[l], spec->norm[l], p->centred[l] ? "true" : "false",
                      spec->norm[l] ? spec->norm_eps[l] : 0.0,
                      fm_plan_result_type(p, l) != 0 ? "    FM_FAST_HELPERS  // the result is rounded to 16 bits next\n" : "",
                      pair.data, col, act.data, far ? "true" : "false", col, tracked.data ? tracked.data : "x",
                      post.data ? post.data : "x");
    }
    fm_str_free(&act);
    fm_str_free(&post);
    fm_str_free(&pair);
    fm_str_free(&tracked);
    fm_str_free(&emitted);
    return st;
}

/* An 8-bit plan's scales of layer l (fm_plan.act_scale; nothing for other plans): where its dequantisation factors
 * are, and the inverse scales and the residual operand's scale as exact float32 hex literals. They are outside the
 * layer's body, like the offsets, so equal layers keep one REPEAT stretch; being in the source, they are in the kernel
 * cache's key, and two models with other scales never share a kernel. The inverses are the float32 quotients
 * 1.0f / scale that csrc/ref.c's emulation multiplies by. */
static void fm_render_quant(const fm_plan *p, int l, fm_str *out) {
    if (!fm_prec_is_8bit(p->prec))
        return;
    /* a GEMM's result is the next layer's codes where its output is (the network's last layer's is y) */
    const int last = p->gemm ? p->out_dtype != FM_CODES : l == p->num_layers - 1, res = p->res_op[l] != FM_RES_NONE;
    const float qin = 1.0f / p->act_scale[l], qout = last ? 0.0f : 1.0f / p->act_scale[l + 1];
    const float rscale = res ? p->act_scale[p->res_src[l] + 1] : 0.0f;
    fm_str_printf(out,
                  "    static constexpr int DQ_OFF = %zu;  // act_scale * w_scale[n] per column (float blob)\n"
                  "    static constexpr float QIN = %af, QOUT = %af, RSCALE = %af;  // 1/in scale, 1/out, r's scale\n"
                  "    static constexpr bool KPERM = %s;  // its input codes arrive permuted (fm_plan.k_perm)\n"
                  "    static constexpr int QFOLD = %d;  // DQ and bias times QOUT: 1 identity, 2 relu (fm_plan.q_fold)\n",
                  p->dq_offset[l], (double)qin, (double)qout, (double)rscale, p->k_perm[l] ? "true" : "false",
                  p->q_fold[l]);
}

/* Layer<l> for every layer. REPEAT: how many layers from l on have l's body (l's included; 1 where the next
 * differs), so the template may run such a stretch as one loop over its layers' weights and biases instead of
 * compiling the same code once per layer (fused_mlp_sm90.cu, fm_network). */
static fm_status fm_render_layers(const fm_spec *spec, const fm_plan *p, fm_str *out, fm_error *err) {
    fm_str body[FM_MAX_LAYERS];
    int repeat[FM_MAX_LAYERS];
    memset(body, 0, sizeof body);
    fm_status st = FM_OK;
    for (int l = 0; l < p->num_layers && st == FM_OK; ++l)
        st = fm_render_layer_body(spec, p, l, &body[l], err);
    for (int l = p->num_layers - 1; l >= 0 && st == FM_OK; --l)
        repeat[l] = l + 1 < p->num_layers && body[l].data && body[l + 1].data &&
                            strcmp(body[l].data, body[l + 1].data) == 0
                        ? repeat[l + 1] + 1
                        : 1;
    for (int l = 0; l < p->num_layers && st == FM_OK; ++l) {
        fm_str expr_text = {0};
        fm_spec_act_string(spec, l, &expr_text);
        fm_str quant = {0};
        fm_render_quant(p, l, &quant);
        fm_str_printf(out,
                      "template <> struct Layer<%d> {  // %d -> %d, %s%sactivation %s\n"
                      "    static constexpr int W_OFF = %zu, B_OFF = %zu;\n"
                      "    static constexpr int REPEAT = %d;  // layers from this one on with its code (render.c)\n"
                      "    static constexpr int RES_FROM = %d;  // the residual's value: layers back (1: own input)\n"
                      "%s%s"
                      "};\n",
                      l, p->k_real[l], p->n_real[l], spec->norm[l] ? fm_norm_name(spec->norm[l]) : "",
                      spec->norm[l] ? ", " : "", expr_text.data ? expr_text.data : "?", p->w_offset[l],
                      p->b_offset[l], repeat[l], p->res_op[l] != FM_RES_NONE ? l - p->res_src[l] : 0,
                      quant.data ? quant.data : "", body[l].data ? body[l].data : "");
        fm_str_free(&quant);
        fm_str_free(&expr_text);
    }
    for (int l = 0; l < p->num_layers; ++l)
        fm_str_free(&body[l]);
    return st;
}

/* Layer<0> of a GEMM plan: the spec's layer p->gemm_layer, with its activation's forms and shapes as the fused kernels
 * render them (its buffer numbers mean nothing there). The source does not say which layer it is: equal layers (an
 * SDF decoder's six 512 x 512 relu layers) are one source, so one compile and one cache entry serve them all. */
static fm_status fm_render_gemm_layer(const fm_spec *spec, const fm_plan *p, fm_str *out, fm_error *err) {
    const int l = p->gemm_layer;
    fm_str body = {0}, expr_text = {0}, quant = {0};
    fm_status st = fm_render_layer_body(spec, p, l, &body, err);
    fm_spec_act_string(spec, l, &expr_text);
    fm_render_quant(p, l, &quant);
    if (st == FM_OK)
        fm_str_printf(out,
                      "template <> struct Layer<0> {  // %d -> %d, activation %s\n"
                      "    static constexpr int W_OFF = 0, B_OFF = 0, REPEAT = 1;\n"
                      "%s%s"
                      "};\n",
                      p->k_real[l], p->n_real[l], expr_text.data ? expr_text.data : "?",
                      quant.data ? quant.data : "", body.data);
    fm_str_free(&quant);
    fm_str_free(&body);
    fm_str_free(&expr_text);
    return st;
}

/* One wgmma per column-group width the plan uses (a layer's n_chunk, and what is left of the layer after its whole
 * groups: the whole layer unless split): m64n<N>k16 with A (this warp's 16 rows x 16) from registers and B (the
 * layer's weights, K-major) from the shared-memory descriptor; scale-d from a predicate (0: the first k step ignores
 * the accumulators). The operand lists are spelled out because the instruction names its N/2 accumulators one by
 * one. */
static void fm_render_wgmma(const fm_plan *p, fm_str *out) {
    int done[257] = {0};
    const int int8 = p->prec == FM_PREC_INT8, k = fm_prec_is_8bit(p->prec) ? 32 : 16;
    const char *ty = p->prec == FM_PREC_BF16 ? "bf16" : p->prec == FM_PREC_E4M3 ? "e4m3" : int8 ? "s8" : "f16";
    /* The operands after scale-d: imm-scale-a and -b (1), then 16-bit operands' B transpose (0). 8-bit: k32 steps
     * (32 bytes, as 16 halves), and no transpose operand (8-bit B is K-major only; PTX ISA, wgmma). int8: s32
     * accumulators (the float registers' bits, "r" constraints) and no scale immediates either. */
    const char *imm = int8 ? "" : fm_prec_is_8bit(p->prec) ? ", 1, 1" : ", 1, 1, 0";
    const char *dty = int8 ? "s32" : "f32";
    const char *cons = int8 ? "\"+r\"(*reinterpret_cast<int *>(&d[%d]))" : "\"+f\"(d[%d])";
    for (int g = 0; g < 4 * p->num_layers; ++g) {
        /* per layer: its column groups' width and the last, narrower group's; with streamed weights also the width
         * of the slot-sized pieces a norm layer's whole-row group is read in, and the last piece's (the template's
         * fm_chunk_cols) */
        int l = g / 4, nc = p->n_chunk[l];
        if (g % 4 >= 2) {
            int fit = p->stream_slots ? (int)(p->w_slot_elems / (size_t)fm_plan_k_chunk(p, l)) / 16 * 16 : 0;
            nc = fit > 0 && fit < nc ? fit : 0;
        }
        if (g % 2 == 1)
            nc = nc > 0 ? (g % 4 == 1 ? p->n_pad[l] : p->n_chunk[l]) % nc : 0; /* the last, narrower one */
        if (nc <= 0 || nc > 256 || done[nc])
            continue;
        done[nc] = 1;
        int nd = nc / 2;
        fm_str_printf(out,
                      "template <> struct fm_wgmma<%d> {\n"
                      "    static __device__ __forceinline__ void run(float (&d)[%d], const fm_u32 (&a)[4], "
                      "unsigned long long desc, int scale_d) {\n"
                      "        asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, %%%d, 0;\\n\"\n"
                      "                     \"wgmma.mma_async.sync.aligned.m64n%dk%d.%s.%s.%s {",
                      nc, nd, nd + 5, nc, k, dty, ty, ty);
        for (int r = 0; r < nd; ++r)
            fm_str_printf(out, "%s%%%d", r ? ", " : "", r);
        fm_str_printf(out, "}, {%%%d, %%%d, %%%d, %%%d}, %%%d, p%s;\\n}\\n\"\n                     : ",
                      nd, nd + 1, nd + 2, nd + 3, nd + 4, imm);
        for (int r = 0; r < nd; ++r) {
            fm_str_append(out, r ? ", " : "");
            fm_str_printf(out, cons, r);
        }
        fm_str_printf(out, "\n                     : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(desc), "
                           "\"r\"(scale_d));\n    }\n");
        if (p->cluster || p->gemm) { /* and with A (64 x k of a shared-memory buffer) from a descriptor too: the
                                        * same operand tail, plus 16-bit operands' A transpose (0) */
            fm_str_printf(out,
                          "    static __device__ __forceinline__ void run_ss(float (&d)[%d], unsigned long long adesc, "
                          "unsigned long long desc, int scale_d) {\n"
                          "        asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, %%%d, 0;\\n\"\n"
                          "                     \"wgmma.mma_async.sync.aligned.m64n%dk%d.%s.%s.%s {",
                          nd, nd + 2, nc, k, dty, ty, ty);
            for (int r = 0; r < nd; ++r)
                fm_str_printf(out, "%s%%%d", r ? ", " : "", r);
            fm_str_printf(out, "}, %%%d, %%%d, p%s%s;\\n}\\n\"\n                     : ", nd, nd + 1, imm,
                          fm_prec_is_8bit(p->prec) ? "" : ", 0");
            for (int r = 0; r < nd; ++r) {
                fm_str_append(out, r ? ", " : "");
                fm_str_printf(out, cons, r);
            }
            fm_str_printf(out, "\n                     : \"l\"(adesc), \"l\"(desc), \"r\"(scale_d));\n    }\n");
        }
        fm_str_printf(out, "};\n");
    }
}

/* The GEMM template's own values (gemm_layer.cu): its tile, the dtypes of its global operands and its comment. */
static void fm_render_gemm_substs(const fm_plan *p, fm_substs *t) {
    const int l = p->gemm_layer;
    fm_str_printf(fm_subst_add(t, "BM"), "%d", p->gemm_bm);
    fm_str_printf(fm_subst_add(t, "BN"), "%d", p->gemm_bn);
    fm_str_printf(fm_subst_add(t, "WARPS_M"), "%d", p->gemm_warps_m);
    fm_str_printf(fm_subst_add(t, "STAGES"), "%d", p->gemm_stages);
    fm_str_printf(fm_subst_add(t, "GEMM_WGMMA"), "%d", p->wgmma);
    fm_str_printf(fm_subst_add(t, "GEMM_CLUSTER"), "%d", p->gemm_cluster);
    fm_str_printf(fm_subst_add(t, "GEMM_WS"), "%d", p->gemm_ws);
    fm_str_printf(fm_subst_add(t, "GEMM_TMA"), "%d", p->gemm_tma);
    fm_str_printf(fm_subst_add(t, "GEMM_TMA_STORE"), "%d", p->gemm_tma_store);
    fm_str_append(fm_subst_add(t, "CLUSTER_DIMS"),
                  p->gemm_cluster > 1 ? "__cluster_dims__(FM_GEMM_CLUSTER, 1, 1)" : "");
    if (p->wgmma)
        fm_render_wgmma(p, fm_subst_add(t, "WGMMA"));
    else
        fm_subst_add(t, "WGMMA"); /* the shared helpers' placeholder: no instruction forms */
    fm_str_printf(fm_subst_add(t, "A1_TYPE"), "%d", p->a1_dtype);
    fm_str_printf(fm_subst_add(t, "RES_TYPE"), "%d", p->res_dtype);
    /* a part's row in memory: its width, or the padded copy's (fm_plan.gemm_a_row; zeros past the width) */
    fm_str_printf(fm_subst_add(t, "A0_REAL"), "%d", fm_gemm_part_row(p, l, 0));
    fm_str_printf(fm_subst_add(t, "A1_REAL"), "%d", fm_gemm_part_row(p, l, 1));
    fm_str *c = fm_subst_add(t, "PLAN_COMMENT");
    fm_str_printf(c, "one layer, %d -> %d; sm_%d; %s %s GEMM; %dx%d tiles of %d warps, %d stages of %d B of "
                  "K, %d CTAs/SM; %zu B shared memory; input %s", p->k_real[l], p->n_real[l], p->arch,
                  fm_prec_name(p->prec), p->wgmma ? "wgmma" : "mma.sync", p->gemm_bm, p->gemm_bn, p->warps,
                  p->gemm_stages, p->wgmma ? 128 : 64, p->blocks_per_sm, p->smem_bytes, fm_dtype_name(p->in_dtype));
    if (p->gemm_cluster > 1)
        fm_str_printf(c, "; clusters of %d sharing the weight tile (TMA multicast)", p->gemm_cluster);
    if (p->gemm_ws)
        fm_str_append(c, "; warp-specialised (the last warpgroup loads)");
    if (p->gemm_ws == 2)
        fm_str_append(c, ", its two consumer warpgroups in turn on tiles of their own, a persistent grid");
    if (p->gemm_ws == 3)
        fm_str_append(c, ", a persistent grid");
    if (p->gemm_tma)
        fm_str_append(c, "; A by tensor maps");
    if (p->gemm_tma_store)
        fm_str_append(c, "; y by TMA stores");
    if (p->gemm_a_row[0])
        fm_str_printf(c, " (x's padded copy, rows of %d)", p->gemm_a_row[0]);
    if (p->a1_dtype >= 0)
        fm_str_printf(c, " + %s (concat%s)", fm_dtype_name((fm_dtype)p->a1_dtype),
                      p->gemm_a_row[1] ? ", x's padded copy" : "");
    if (p->res_dtype >= 0)
        fm_str_printf(c, ", residual %s", fm_dtype_name((fm_dtype)p->res_dtype));
    fm_str_printf(c, ", y %s", fm_dtype_name(p->out_dtype));
}

/* fm_common.cuh's x: its features in memory (IN_REAL) and a fused or pad plan's input encoding (fm_spec.enc_*), one
 * Enc<C> per column, scales and phases as exact float literals. A GEMM or norm plan's x is its layer's input as it is. */
static void fm_render_encoding(const fm_spec *spec, const fm_plan *p, fm_substs *t) {
    const int enc = p->gemm && !p->gemm_pad ? 0 : spec->enc_cols; /* (the pad pass encodes x's copy) */
    if (enc)
        fm_str_printf(fm_subst_add(t, "X_FEATURES"), "%d", spec->x_features);
    else
        fm_str_append(fm_subst_add(t, "X_FEATURES"), "Layer<0>::KR");
    fm_str_printf(fm_subst_add(t, "ENC_COLS"), "%d", enc);
    fm_str *e = fm_subst_add(t, "ENCODING");
    for (int c = 0; c < enc; ++c)
        fm_str_printf(e, "template <> struct Enc<%d> { static constexpr int SRC = %d; static constexpr bool SIN = %s; "
                      "static constexpr float SCALE = %af, PHASE = %af; };\n", c, spec->enc_src[c],
                      spec->enc_sin[c] ? "true" : "false", (double)spec->enc_scale[c], (double)spec->enc_phase[c]);
}

static fm_status fm_render_substs(const fm_spec *spec, const fm_plan *p, const char *kernel_name, fm_substs *t,
                                  fm_error *err) {
    fm_str_append(fm_subst_add(t, "KERNEL_NAME"), kernel_name);
    fm_str_printf(fm_subst_add(t, "NUM_LAYERS"), "%d", p->gemm ? 1 : p->num_layers);
    fm_str_printf(fm_subst_add(t, "WARPS"), "%d", p->warps);
    fm_str_printf(fm_subst_add(t, "PREC"), "%d", (int)p->prec);
    fm_str_printf(fm_subst_add(t, "X_PARTS"), "%d", p->x_split ? 3 : 1);
    fm_render_encoding(spec, p, t);
    fm_str_printf(fm_subst_add(t, "IN_TYPE"), "%d", (int)p->in_dtype);
    fm_str_printf(fm_subst_add(t, "OUT_TYPE"), "%d", (int)p->out_dtype);
    fm_str_printf(fm_subst_add(t, "ACT_STRIDE"), "%d", p->act_stride);
    fm_str_printf(fm_subst_add(t, "BLOCKS_PER_SM"), "%d", p->blocks_per_sm);
    fm_str_printf(fm_subst_add(t, "B_FLOATS"), "%zu", p->b_floats);
    fm_str_printf(fm_subst_add(t, "SMEM_BYTES"), "%zu", p->smem_bytes);
    if (p->gemm_norm) { /* a norm layer's second kernel (row_norm.cu): no weights, no tile */
        const int l = p->gemm_layer;
        fm_str_append(fm_subst_add(t, "W_SMEM_ELEMS"), "0");
        fm_str_printf(fm_subst_add(t, "RES_TYPE"), "%d", p->res_dtype);
        fm_str_printf(fm_subst_add(t, "PLAN_COMMENT"), "a %s layer's second kernel, %d features; sm_%d; %s; a warp a "
                      "row, %d rows a CTA; z %s%s%s, y %s", fm_norm_name(spec->norm[l]), p->n_real[l], p->arch,
                      fm_prec_name(p->prec), p->rows_per_cta, fm_dtype_name(p->in_dtype),
                      p->res_dtype >= 0 ? ", residual " : "", p->res_dtype >= 0 ? fm_dtype_name((fm_dtype)p->res_dtype) : "",
                      fm_dtype_name(p->out_dtype));
        return fm_render_gemm_layer(spec, p, fm_subst_add(t, "LAYERS"), err);
    }
    if (p->gemm_pad) { /* the pad pass of x (pad_rows.cu): no weights, no tile */
        fm_str_append(fm_subst_add(t, "W_SMEM_ELEMS"), "0");
        fm_str_printf(fm_subst_add(t, "ROWS_CTA"), "%d", p->rows_per_cta);
        fm_str_printf(fm_subst_add(t, "X_COLS"), "%d", spec->x_features);
        fm_str_printf(fm_subst_add(t, "X_ROW"), "%d", p->gemm_a_row[0]);
        fm_str_printf(fm_subst_add(t, "PLAN_COMMENT"), "x (%d features, %s)%s copied to rows of %d %s for layer %d's "
                      "GEMM; sm_%d; %d rows a CTA through %zu B of shared memory", spec->x_features,
                      fm_dtype_name(p->in_dtype), spec->enc_cols ? " encoded" : "", p->gemm_a_row[0],
                      fm_dtype_name(p->out_dtype), p->gemm_layer, p->arch, p->rows_per_cta, p->smem_bytes);
        return fm_render_gemm_layer(spec, p, fm_subst_add(t, "LAYERS"), err);
    }
    if (p->gemm) {
        fm_str_append(fm_subst_add(t, "W_SMEM_ELEMS"), "0");
        fm_render_gemm_substs(p, t);
        return fm_render_gemm_layer(spec, p, fm_subst_add(t, "LAYERS"), err);
    }
    fm_str_printf(fm_subst_add(t, "M_TILES"), "%d", p->m_tiles);
    fm_str_printf(fm_subst_add(t, "RESIDENT"), "%d", p->resident);
    fm_str_printf(fm_subst_add(t, "BUFFERS"), "%d", p->buffers);
    fm_str_printf(fm_subst_add(t, "W_SMEM_ELEMS"), "%zu",
                  p->cluster ? p->w_rank_elems
                  : p->resident ? p->w_elems
                  : (size_t)(p->stream_slots ? p->stream_slots : 2) * p->w_slot_elems);
    fm_str_printf(fm_subst_add(t, "W_SLOT_ELEMS"), "%zu", p->w_slot_elems);
    if (p->wgmma) {
        fm_render_wgmma(p, fm_subst_add(t, "WGMMA"));
        fm_str_printf(fm_subst_add(t, "CLUSTER"), "%d", p->cluster);
        fm_str_printf(fm_subst_add(t, "KPIPE"), "%d", p->kpipe);
        fm_str_printf(fm_subst_add(t, "STREAM_SLOTS"), "%d", p->stream_slots);
        fm_str_printf(fm_subst_add(t, "WIDE_LOOP"), "%d", p->wide_loop);
        fm_str_printf(fm_subst_add(t, "SPLIT"), "%d", p->split > 1 ? p->split : 1);
        fm_str_printf(fm_subst_add(t, "IN_SHARED"), "%d", p->in_shared);
        fm_str_append(fm_subst_add(t, "CLUSTER_DIMS"), p->cluster > 1 ? "__cluster_dims__(FM_CLUSTER, 1, 1)"
                                                       : p->split > 1 ? "__cluster_dims__(FM_SPLIT, 1, 1)" : "");
    }

    fm_str *c = fm_subst_add(t, "PLAN_COMMENT");
    fm_str_printf(c, "widths %d", p->k_real[0]);
    for (int l = 0; l < p->num_layers; ++l)
        fm_str_printf(c, "-%d", p->n_real[l]);
    fm_str_printf(c, "; sm_%d%s; %s %s; %d warps x %d rows, %d CTAs/SM; %s weights", p->arch, p->wgmma ? "a" : "",
                  fm_prec_name(p->prec), p->wgmma ? "wgmma" : "mma.sync", p->warps, p->m_tiles * 16,
                  p->blocks_per_sm, p->resident ? "resident" : "streamed");
    if (p->stream_slots) {
        int pieces = 0, wide = 0, rows = 0; /* rows: a layer's one group (a norm's, an 8-bit layer's) over slots */
        for (int l = 0; l < p->num_layers; ++l) {
            pieces |= fm_plan_k_chunk(p, l) < p->k_pad[l];
            wide |= p->wide_out[l];
            rows |= (size_t)p->n_chunk[l] * (size_t)fm_plan_k_chunk(p, l) > p->w_slot_elems;
        }
        fm_str_printf(c, " (%d slots of %zu B, one layer's column group%s each%s)%s", p->stream_slots,
                      p->w_slot_elems * (size_t)p->elem_bytes, pieces ? " or K piece of one" : "",
                      rows ? ", or part of a whole row's group" : "",
                      wide ? ", wide layers' outputs in shared memory" : "");
        if (p->wide_loop)
            fm_str_append(c, ", their column groups looped");
        if (p->split > 1)
            fm_str_printf(c, ", split over clusters of %d", p->split);
        if (p->in_shared)
            fm_str_append(c, ", x landing in the wide buffers");
    }
    if (p->cluster)
        fm_str_printf(c, " (1/%d per CTA of a cluster of %d), activations in shared memory", p->cluster, p->cluster);
    if (p->kpipe)
        fm_str_append(c, ", K-pipelined layers");
    fm_str_printf(c, "; %d activation buffer(s); %zu B shared memory; x %s, y %s", p->buffers, p->smem_bytes,
                  fm_dtype_name(p->in_dtype), fm_dtype_name(p->out_dtype));
    return fm_render_layers(spec, p, fm_subst_add(t, "LAYERS"), err);
}

static int fm_is_name_char(char ch) { return (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_'; }

fm_status fm_render(const fm_spec *spec, const fm_plan *plan, const char *prelude, const char *tmpl,
                    const char *kernel_name, fm_str *out, fm_error *err) {
    fm_substs t;
    memset(&t, 0, sizeof t);
    fm_status st = fm_render_substs(spec, plan, kernel_name, &t, err);
    if (st == FM_OK && t.overflow)
        st = fm_fail(err, FM_ERR_INTERNAL, "render.c: more placeholders than FM_MAX_SUBST (%d); raise it",
                     FM_MAX_SUBST);
    if (st != FM_OK)
        goto cleanup;

    if (prelude != NULL) {
        fm_str_append(out, prelude);
        fm_str_append(out, "\n");
    }
    const char *p = tmpl;
    int line = 1;
    for (;;) {
        const char *open = strstr(p, "{{");
        if (open == NULL) {
            fm_str_append(out, p);
            break;
        }
        for (const char *q = p; q < open; ++q)
            line += *q == '\n';
        fm_str_appendn(out, p, (size_t)(open - p));
        const char *name = open + 2, *end = name;
        while (fm_is_name_char(*end))
            ++end;
        if (end == name || end[0] != '}' || end[1] != '}') {
            st = fm_fail(err, FM_ERR_TEMPLATE, "kernel template line %d: '{{' not followed by NAME}}", line);
            goto cleanup;
        }
        fm_subst *hit = NULL;
        for (int i = 0; i < t.count; ++i)
            if (strlen(t.item[i].name) == (size_t)(end - name) && memcmp(t.item[i].name, name, end - name) == 0)
                hit = &t.item[i];
        if (hit == NULL) {
            st = fm_fail(err, FM_ERR_TEMPLATE, "kernel template line %d: unknown placeholder {{%.*s}}", line,
                         (int)(end - name), name);
            goto cleanup;
        }
        hit->used = 1;
        fm_str_append(out, hit->value.data);
        p = end + 2;
    }
    for (int i = 0; i < t.count; ++i) {
        if (!t.item[i].used) {
            st = fm_fail(err, FM_ERR_TEMPLATE, "kernel template never uses placeholder {{%s}}", t.item[i].name);
            goto cleanup;
        }
    }
    if (out->oom)
        st = fm_fail(err, FM_ERR_NOMEM, "out of memory rendering the kernel source");

cleanup:
    for (int i = 0; i < t.count; ++i)
        fm_str_free(&t.item[i].value);
    fm_str_free(&t.spill.value);
    return st;
}
