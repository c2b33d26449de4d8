/*
 * test_plan.c - pins down the plan (padding, tiles, shared-memory budget, forced options, limits), fm_plan_pack's
 * blob layout, the renderer (placeholders in, placeholders out, template errors) and the CPU forward (against a
 * naive float64 forward written here). No NVRTC, no GPU.
 *
 *   gcc -std=c11 -Wall -Wextra -Werror -fsanitize=address,undefined -g -Icsrc csrc/util.c csrc/expr_*.c csrc/spec.c \
 *       csrc/plan.c csrc/render.c csrc/ref.c tests/c/test_plan.c -lm -o /tmp/test_plan && /tmp/test_plan .
 *
 * argv[1] is the repository root (for kernel_templates/). An optional "--quick" after it shrinks the CPU-forward
 * batches (1000 rows -> 200), for runs under valgrind.
 */
#include "fm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static int g_quick;

/* ------------------------------------------------------------------------------------------------ helpers */

static const int g_archs[] = {75, 80, 86, 89, 90};
enum { NUM_ARCHS = sizeof g_archs / sizeof g_archs[0] };

/* A network: widths[0..num_layers]. */
typedef struct net {
    const char *name;
    int num_layers;
    int widths[FM_MAX_LAYERS + 1];
} net;

static const net g_nets[] = {
    {"32-64-64-64-64-16", 5, {32, 64, 64, 64, 64, 16}},
    {"3-64-128-96-64-32-16-4", 7, {3, 64, 128, 96, 64, 32, 16, 4}},
    {"2-50-50-50-50-50-1", 6, {2, 50, 50, 50, 50, 50, 1}},
    {"2-256-256-256-3", 4, {2, 256, 256, 256, 3}},
    {"256x8", 8, {256, 256, 256, 256, 256, 256, 256, 256, 256}},
    {"1-1", 1, {1, 1}},
    {"17-33-129-255-7", 4, {17, 33, 129, 255, 7}},
    {"100-200-31", 2, {100, 200, 31}},
    {"1-256-1-256-1", 4, {1, 256, 1, 256, 1}},
    {"255-255", 1, {255, 255}},
    {"16-16", 1, {16, 16}},
    {"5-97-113-3-241-64-2-9-1", 8, {5, 97, 113, 3, 241, 64, 2, 9, 1}},
};
enum { NUM_NETS = sizeof g_nets / sizeof g_nets[0] };

static const char *const g_acts[] = {"relu", "tanh", "x * sigmoid(x)", "none"};

/* Builds a spec from widths; layer l has a bias when (l + bias_phase) is even; activations cycle through g_acts. */
static int make_spec(fm_spec *spec, const int *widths, int num_layers, int bias_phase) {
    int64_t shapes[2 * FM_MAX_LAYERS], bias[FM_MAX_LAYERS];
    const char *acts[FM_MAX_LAYERS];
    for (int l = 0; l < num_layers; ++l) {
        shapes[2 * l] = widths[l + 1];
        shapes[2 * l + 1] = widths[l];
        bias[l] = (l + bias_phase) % 2 == 0 ? widths[l + 1] : -1;
        acts[l] = g_acts[l % 4];
    }
    fm_error err = {0};
    fm_status st = fm_spec_init(spec, num_layers, shapes, bias, acts, NULL, &err);
    CHECK(st == FM_OK, "fm_spec_init failed: %s", err.message);
    fm_error_clear(&err);
    return st == FM_OK;
}

static int is_mult16(int v) { return v > 0 && v % 16 == 0; }

/* xorshift64*: deterministic, identical everywhere. */
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static double uniform(void) { /* [0, 1) */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return (double)((g_rng * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}
static float sym(double scale) { return (float)((2.0 * uniform() - 1.0) * scale); }

static char *read_text(const char *root, const char *rel) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)size + 1);
    size_t got = size > 0 ? fread(buf, 1, (size_t)size, f) : 0;
    buf[got] = '\0';
    fclose(f);
    return buf;
}

/* Copy of text with the first occurrence of `find` replaced by `with` (caller frees). */
static char *replace_first(const char *text, const char *find, const char *with) {
    const char *at = strstr(text, find);
    size_t n = strlen(text), nf = strlen(find), nw = strlen(with);
    char *out = malloc(n + nw + 1);
    if (at == NULL) {
        memcpy(out, text, n + 1);
        return out;
    }
    size_t pre = (size_t)(at - text);
    memcpy(out, text, pre);
    memcpy(out + pre, with, nw);
    memcpy(out + pre + nw, at + nf, n - pre - nf + 1);
    return out;
}

static int count_occurrences(const char *text, const char *needle) {
    int n = 0;
    for (const char *p = strstr(text, needle); p != NULL; p = strstr(p + 1, needle))
        ++n;
    return n;
}

/* ------------------------------------------------------------------------------------------------ plan */

/* The buffer assignment, replayed: every value a layer reads is still in the buffer it was written to (no later
 * write clobbered it while it was live), x starts in buffer 0, and a layer writes over its input only when it is
 * one chunk, nothing later reads that input, and (last layer) it is not the residual operand. */
static void check_buffers(const fm_plan *p, const fm_spec *spec, const char *what) {
    const int L = p->num_layers;
    int holds[FM_MAX_LAYERS + 2]; /* value index + 1 held by each buffer, -1: none */
    int where[FM_MAX_LAYERS + 1];
    for (int i = 0; i < FM_MAX_LAYERS + 2; ++i)
        holds[i] = -1;
    CHECK(p->buffers >= 1 && p->buffers <= L + 1, "%s: buffers %d", what, p->buffers);
    holds[0] = 0;
    where[0] = 0;
    for (int l = 0; l < L; ++l) {
        int h = where[l], x = where[0];
        int want_a0 = spec->cat[l] == FM_CAT_BEFORE ? x : h;
        int want_a1 = spec->cat[l] == FM_CAT_NONE ? -1 : (spec->cat[l] == FM_CAT_AFTER ? x : h);
        CHECK(p->a0_buf[l] == want_a0 && p->a1_buf[l] == want_a1, "%s: layer %d reads buffers %d, %d; want %d, %d",
              what, l, p->a0_buf[l], p->a1_buf[l], want_a0, want_a1);
        CHECK(holds[h] == l && (spec->cat[l] == FM_CAT_NONE || holds[x] == 0), "%s: layer %d input clobbered", what, l);
        if (spec->res_op[l] != FM_RES_NONE) {
            int r = where[spec->res_src[l] + 1];
            CHECK(p->res_buf[l] == r && holds[r] == spec->res_src[l] + 1, "%s: layer %d residual buffer %d (value %d)",
                  what, l, p->res_buf[l], spec->res_src[l]);
        } else {
            CHECK(p->res_buf[l] == -1, "%s: layer %d res_buf %d without a residual", what, l, p->res_buf[l]);
        }
        int out = p->out_buf[l];
        CHECK(out >= 0 && out < p->buffers, "%s: layer %d out_buf %d", what, l, out);
        if (out < 0 || out >= p->buffers)
            return;
        if (holds[out] >= 0) { /* overwriting value holds[out] - 1: nobody may read it after this layer */
            int v = holds[out] - 1, read_later = 0, read_here = out == p->a0_buf[l] || out == p->a1_buf[l];
            for (int k = l + 1; k < L; ++k)
                read_later |= k == v + 1 || (spec->cat[k] != FM_CAT_NONE && v == -1) ||
                              (spec->res_op[k] != FM_RES_NONE && spec->res_src[k] == v);
            CHECK(!read_later, "%s: layer %d overwrites value %d, read later", what, l, v);
            if (read_here) {
                CHECK(p->n_chunk[l] >= p->n_pad[l], "%s: layer %d in place with several chunks", what, l);
                CHECK(!(l == L - 1 && p->res_buf[l] == out), "%s: last layer staged over its residual", what);
            }
            int res_here = p->res_buf[l] == out;
            CHECK(!res_here || read_here, "%s: layer %d writes its residual operand's buffer", what, l);
        }
        holds[out] = l + 1;
        where[l + 1] = out;
    }
}

/* The sm_90a plan's invariants: whole warpgroups of 16-row warps, resident weights in the core-matrix layout (n_pad
 * x k_pad per layer, no row pad), chunks of at most 128 columns, per warp an input buffer wide enough for x and an
 * output stage as wide as the staged output, and only networks the kernel takes (no concat, residuals from the own
 * input). */
static void check_wgmma_plan(const fm_plan *p, const fm_spec *spec, const fm_target *t, const char *what) {
    const int L = spec->num_layers;
    CHECK(t->arch == 90 && p->prec != FM_PREC_TF32, "%s: wgmma on sm_%d %s", what, t->arch, fm_prec_name(p->prec));
    CHECK(p->warps % 4 == 0 && p->warps >= 4 && p->warps <= 16 && p->m_tiles == 1 && p->rows_per_cta == 16 * p->warps,
          "%s: wgmma warps %d m_tiles %d rows %d", what, p->warps, p->m_tiles, p->rows_per_cta);
    CHECK(p->resident == 1 && p->buffers == 1 && p->w_slot_elems == 0, "%s: wgmma resident/buffers", what);
    size_t w = 0, b = 0;
    for (int l = 0; l < L; ++l) {
        CHECK(spec->cat[l] == FM_CAT_NONE && (spec->res_op[l] == FM_RES_NONE || spec->res_src[l] == l - 1),
              "%s: layer %d concat/residual source in a wgmma plan", what, l);
        CHECK(p->k_pad[l] == (l ? p->n_pad[l - 1] : (spec->width[0] + 15) / 16 * 16) && is_mult16(p->n_pad[l]) &&
                  p->n_pad[l] >= spec->width[l + 1] && p->n_pad[l] < spec->width[l + 1] + 16,
              "%s: layer %d pads %d x %d", what, l, p->k_pad[l], p->n_pad[l]);
        /* one wgmma group per layer, or groups of n_chunk columns and a last one of the rest, all multiples of 16 */
        CHECK(p->n_pad[l] <= 256 && is_mult16(p->n_chunk[l]) && p->n_chunk[l] <= p->n_pad[l] &&
                  (p->n_pad[l] % p->n_chunk[l]) % 16 == 0,
              "%s: layer %d n_chunk %d", what, l, p->n_chunk[l]);
        int regs = p->n_pad[l] / 2 + p->k_pad[l] / 4 + (l < L - 1 ? p->n_pad[l] / 4 : 0);
        CHECK(regs + 40 <= 255 && regs + 40 <= fm_plan_wgmma_regs(p), "%s: layer %d needs %d registers", what, l,
              regs);
        /* a K-pipelined layer: before the last, no residual in the network, both it and the next unsplit, an
         * activation without the one-cvt pair form, both layers' accumulators in the estimate */
        int residual = 0;
        for (int m = 0; m < L; ++m)
            residual |= spec->res_op[m] != FM_RES_NONE;
        if (p->pipe[l])
            CHECK(!p->cluster && l < L - 1 && !residual && p->n_chunk[l] == p->n_pad[l] &&
                      p->n_chunk[l + 1] == p->n_pad[l + 1] && fm_expr_pair_fn(spec->act[l]) == NULL &&
                      fm_plan_wgmma_regs(p) >= p->n_pad[l] / 2 + p->n_pad[l + 1] / 2 + p->n_pad[l] / 4,
                  "%s: layer %d pipelined", what, l);
        CHECK(!p->pipe[l] || p->kpipe, "%s: layer %d pipelined, kpipe 0", what, l);
        CHECK(p->w_offset[l] == w && p->b_offset[l] == b && w * (size_t)p->elem_bytes % 128 == 0,
              "%s: layer %d offsets %zu %zu", what, l, p->w_offset[l], p->b_offset[l]);
        w += (size_t)p->n_pad[l] * (size_t)p->k_pad[l];
        b += (size_t)p->n_pad[l];
    }
    CHECK(p->w_elems == w && p->b_floats >= b && p->b_floats < b + 4 && p->b_floats % 4 == 0, "%s: blob sizes", what);
    /* The input buffer's rows: x's padded width and a 16-byte pad, an odd number of 16-byte units (no wider: the
     * output stage has rows of its own, STAGE_STRIDE out_t, an odd number of units by construction). */
    int row_bytes = p->act_stride * p->elem_bytes, in_row = p->k_pad[0] * p->elem_bytes + 16;
    CHECK(row_bytes % 16 == 0 && (row_bytes / 16) % 2 == 1 && row_bytes >= in_row && row_bytes <= in_row + 16,
          "%s: input buffer stride %d", what, p->act_stride);
    int stage_row = p->n_pad[L - 1] * (int)fm_dtype_size(p->out_dtype) + 16;
    CHECK((stage_row / 16) % 2 == 1, "%s: stage row %d bytes", what, stage_row);
    if (p->out_dtype == FM_F32) /* stored from the registers: no stage */
        stage_row = 0;
    CHECK(fm_plan_wgmma_stage_bytes(p) == 16 * (size_t)stage_row, "%s: stage %zu bytes, want %d", what,
          fm_plan_wgmma_stage_bytes(p), 16 * stage_row);
    /* Per warp: input buffer and output stage of 16 rows each, and a landing buffer for x's 16 rows as they are in
     * global memory unless they are copied verbatim (x in the compute dtype, rows of whole 16-byte pieces). */
    int in_bytes = spec->width[0] * (int)fm_dtype_size(p->in_dtype);
    int verbatim = (int)p->in_dtype == (int)p->prec + 1 && in_bytes % 16 == 0;
    size_t raw = verbatim ? 0 : (size_t)(16 * in_bytes + 15) / 16 * 16;
    CHECK(fm_plan_wgmma_raw_bytes(p) == raw, "%s: raw x buffer %zu, want %zu", what, fm_plan_wgmma_raw_bytes(p), raw);
    size_t want = (size_t)p->elem_bytes * w + 4 * p->b_floats +
                  (size_t)p->warps * (16 * (size_t)(row_bytes + stage_row) + raw);
    CHECK(p->smem_bytes == want && p->smem_bytes <= t->smem_per_block, "%s: smem %zu, want %zu", what, p->smem_bytes,
          want);
    CHECK(p->blocks_per_sm == 1 || p->blocks_per_sm * p->warps * 32 * fm_plan_wgmma_regs(p) <= 65536,
          "%s: %d blocks of %d warps at %d registers", what, p->blocks_per_sm, p->warps, fm_plan_wgmma_regs(p));
}

/* The shared-memory-A (cluster) plan's invariants: whole warpgroups, a cluster of 1, 2 or 4 CTAs, hidden widths
 * padded to 16 x cluster and split into equal shares of whole 16-column groups, the last layer too where it is wider
 * than 16 columns on a cluster of more than one CTA (else whole); residuals from a layer's own input only; each
 * CTA's share of the blob holds n_chunk rows of each layer; shared memory is that share, the biases, the per-warp
 * buffers of the register-A kernel and per warpgroup an A buffer of 64 rows x the widest input of layers 1.. plus
 * two mbarriers. */
static void check_cluster_plan(const fm_plan *p, const fm_spec *spec, const fm_target *t, const char *what) {
    const int L = spec->num_layers, c = p->cluster, split_last = c > 1 && spec->width[L] > 16;
    CHECK(t->arch == 90 && p->prec != FM_PREC_TF32 && p->wgmma == 1 && (c == 1 || c == 2 || c == 4) && L >= 2,
          "%s: cluster %d on sm_%d %s, %d layers", what, c, t->arch, fm_prec_name(p->prec), L);
    CHECK(p->warps % 4 == 0 && p->warps >= 4 && p->warps <= 16 && p->m_tiles == 1 && p->rows_per_cta == 16 * p->warps,
          "%s: cluster warps %d m_tiles %d rows %d", what, p->warps, p->m_tiles, p->rows_per_cta);
    CHECK(p->resident == 1 && p->buffers == 1 && p->w_slot_elems == 0, "%s: cluster resident/buffers", what);
    size_t w = 0, b = 0;
    int kmax = 16, regs = 0;
    for (int l = 0; l < L; ++l) {
        const int split = l < L - 1 || split_last, unit = split ? 16 * c : 16, nr = spec->width[l + 1];
        CHECK(spec->cat[l] == FM_CAT_NONE && (spec->res_op[l] == FM_RES_NONE || spec->res_src[l] == l - 1),
              "%s: layer %d concat/residual", what, l);
        /* a residual reads the columns its output overwrites: a hidden layer's input split as its output */
        CHECK(spec->res_op[l] == FM_RES_NONE || l == 0 ||
                  (l == L - 1 ? p->k_pad[l] >= p->n_pad[l] : p->k_pad[l] == p->n_pad[l]),
              "%s: residual layer %d pads %d x %d", what, l, p->k_pad[l], p->n_pad[l]);
        CHECK(p->k_pad[l] == (l ? p->n_pad[l - 1] : (spec->width[0] + 15) / 16 * 16) && p->n_pad[l] % unit == 0 &&
                  p->n_pad[l] >= nr && p->n_pad[l] < nr + unit && p->n_pad[l] <= 256,
              "%s: layer %d pads %d x %d", what, l, p->k_pad[l], p->n_pad[l]);
        CHECK(p->n_chunk[l] == (split ? p->n_pad[l] / c : p->n_pad[l]) && is_mult16(p->n_chunk[l]),
              "%s: layer %d share %d of %d", what, l, p->n_chunk[l], p->n_pad[l]);
        CHECK(p->w_offset[l] == w && p->b_offset[l] == b, "%s: layer %d offsets %zu %zu", what, l, p->w_offset[l],
              p->b_offset[l]);
        w += (size_t)p->n_chunk[l] * (size_t)p->k_pad[l];
        b += (size_t)p->n_pad[l];
        if (l > 0 && p->k_pad[l] > kmax)
            kmax = p->k_pad[l];
        int r = p->n_chunk[l] / 2 + (l == 0 ? p->k_pad[0] / 4 : 0) + 48 + 96;
        CHECK(r <= 255 || !split, "%s: layer %d estimated at %d registers", what, l, r);
        regs = r > regs ? r : regs;
    }
    CHECK(p->w_rank_elems == w && p->w_elems == (size_t)c * w && p->b_floats >= b && p->b_floats < b + 4,
          "%s: blob sizes %zu %zu", what, p->w_rank_elems, p->w_elems);
    regs = regs > 255 ? 255 : regs;
    CHECK(fm_plan_wgmma_regs(p) == regs && 65536 / (p->warps * 32) >= regs,
          "%s: %d registers estimated, %d expected, %d warps", what, fm_plan_wgmma_regs(p), regs, p->warps);
    /* a CTA stages the last layer's columns it computes */
    int stage_row = p->out_dtype == FM_F32 ? 0 : p->n_chunk[L - 1] * (int)fm_dtype_size(p->out_dtype) + 16;
    size_t warp_bytes = 16 * ((size_t)p->act_stride * (size_t)p->elem_bytes + (size_t)stage_row) +
                        fm_plan_wgmma_raw_bytes(p);
    size_t want = (size_t)p->elem_bytes * w + 4 * p->b_floats + (size_t)p->warps * warp_bytes +
                  (size_t)(p->warps / 4) * ((size_t)kmax * 64 * (size_t)p->elem_bytes + 16);
    CHECK(p->smem_bytes == want && p->smem_bytes <= t->smem_per_block, "%s: smem %zu, want %zu", what, p->smem_bytes,
          want);
}

/* The streamed register-A plan's invariants (fused_mlp_sm90.cu, FM_STREAM): whole warpgroups, weights not resident
 * but in the resident form's blob (the core-matrix layout, so a column group of n_chunk rows is contiguous), 2..8
 * slots each holding the largest group (a norm layer is one group, the whole row, read in slot-sized pieces of at
 * least 16 columns), residuals from the own input (none on a concat layer), an input concat's width x's padded width
 * plus the previous layer's, one group's accumulators in the register estimate, and shared memory of the slots, the
 * biases, the per-warp buffers and the slots' barriers. */
static void check_stream_plan(const fm_plan *p, const fm_spec *spec, const fm_target *t, const char *what) {
    const int L = spec->num_layers;
    CHECK(t->arch == 90 && (p->prec == FM_PREC_F16 || p->prec == FM_PREC_BF16), "%s: stream on sm_%d %s", what,
          t->arch, fm_prec_name(p->prec));
    CHECK(p->warps % 4 == 0 && p->warps >= 4 && p->m_tiles == 1 && p->rows_per_cta == 16 * p->warps,
          "%s: stream warps %d", what, p->warps);
    CHECK(p->resident == 0 && p->buffers == 1 && p->stream_slots >= 2 && p->stream_slots <= 8 && !p->kpipe,
          "%s: stream resident %d slots %d", what, p->resident, p->stream_slots);
    size_t w = 0, b = 0, slot = 0;
    for (int l = 0; l < L; ++l) {
        int x_pad = (spec->width[0] + 15) / 16 * 16, h_pad = l ? p->n_pad[l - 1] : x_pad;
        CHECK(spec->res_op[l] == FM_RES_NONE || (spec->res_src[l] == l - 1 && spec->cat[l] == FM_CAT_NONE),
              "%s: layer %d residual in a stream plan", what, l);
        int norm = spec->norm[l] != FM_NORM_NONE;
        CHECK(!norm || p->n_chunk[l] == p->n_pad[l], "%s: norm layer %d in groups of %d", what, l, p->n_chunk[l]);
        CHECK(p->k_pad[l] == h_pad + (spec->cat[l] != FM_CAT_NONE ? x_pad : 0) && is_mult16(p->n_pad[l]) &&
                  p->n_pad[l] >= spec->width[l + 1] && p->n_pad[l] < spec->width[l + 1] + 16,
              "%s: layer %d pads %d x %d", what, l, p->k_pad[l], p->n_pad[l]);
        CHECK(p->n_pad[l] <= 256 && is_mult16(p->n_chunk[l]) && p->n_chunk[l] <= p->n_pad[l],
              "%s: layer %d n_chunk %d", what, l, p->n_chunk[l]);
        int out = l < L - 1 ? p->n_pad[l] / 4 : 0, in = p->k_pad[l] / 4;
        int regs = p->n_chunk[l] / 2 + (norm && spec->res_op[l] == FM_RES_NONE ? (in > out ? in : out) : in + out);
        CHECK(regs + 40 <= fm_plan_wgmma_regs(p) && fm_plan_wgmma_regs(p) * 32 * p->warps <= 65536,
              "%s: layer %d needs %d registers", what, l, regs);
        CHECK(p->w_offset[l] == w && p->b_offset[l] == b, "%s: layer %d offsets", what, l);
        size_t group = (size_t)(norm ? 16 : p->n_chunk[l]) * (size_t)p->k_pad[l];
        CHECK(p->w_slot_elems >= group, "%s: layer %d's group of %d does not fit a slot", what, l, p->n_chunk[l]);
        slot = group > slot ? group : slot;
        w += (size_t)p->n_pad[l] * (size_t)p->k_pad[l];
        b += (size_t)p->n_pad[l];
    }
    CHECK(p->w_elems == w && p->w_slot_elems >= slot && p->w_slot_elems <= w, "%s: blob %zu slot %zu", what,
          p->w_elems, p->w_slot_elems);
    slot = p->w_slot_elems;
    int stage_row = p->out_dtype == FM_F32 ? 0 : p->n_pad[L - 1] * (int)fm_dtype_size(p->out_dtype) + 16;
    size_t warp_bytes = 16 * ((size_t)p->act_stride * (size_t)p->elem_bytes + (size_t)stage_row) +
                        fm_plan_wgmma_raw_bytes(p);
    size_t want = (size_t)p->elem_bytes * slot * (size_t)p->stream_slots + 4 * p->b_floats +
                  (size_t)p->warps * warp_bytes + (size_t)(12 * p->stream_slots + 15) / 16 * 16;
    CHECK(p->smem_bytes == want && p->smem_bytes <= t->smem_per_block, "%s: smem %zu, want %zu", what, p->smem_bytes,
          want);
}

/* Every invariant the kernel relies on. `auto_opts`: the plan chose everything, so its register rules apply too. */
static void check_plan(const fm_plan *p, const fm_spec *spec, const fm_target *t, int auto_opts, const char *what) {
    if (p->cluster) {
        check_cluster_plan(p, spec, t, what);
        return;
    }
    if (p->stream_slots) {
        check_stream_plan(p, spec, t, what);
        return;
    }
    if (p->wgmma) {
        check_wgmma_plan(p, spec, t, what);
        return;
    }
    int L = spec->num_layers, widest = 0;
    CHECK(p->num_layers == L, "%s: num_layers %d", what, p->num_layers);
    CHECK(p->arch == t->arch, "%s: arch %d", what, p->arch);
    size_t w_expect = 0, b_expect = 0;
    int multi_chunk = 0;
    for (int l = 0; l < L; ++l) {
        int kr = fm_spec_in_features(spec, l), nr = spec->width[l + 1], two = spec->cat[l] != FM_CAT_NONE;
        widest = spec->width[l] > widest ? spec->width[l] : widest;
        widest = nr > widest ? nr : widest;
        CHECK(p->k_real[l] == kr && p->n_real[l] == nr, "%s: layer %d real %dx%d", what, l, p->k_real[l],
              p->n_real[l]);
        CHECK(is_mult16(p->k_pad[l]) && p->k_pad[l] >= kr && p->k_pad[l] < kr + (two ? 32 : 16),
              "%s: layer %d k_pad %d (k %d)", what, l, p->k_pad[l], kr);
        int first = spec->cat[l] == FM_CAT_BEFORE ? spec->width[0] : spec->width[l];
        CHECK(p->k0_real[l] == (two ? first : kr) && is_mult16(p->k0_pad[l]) && p->k0_pad[l] >= p->k0_real[l] &&
                  p->k0_pad[l] < p->k0_real[l] + 16 && (two || p->k0_pad[l] == p->k_pad[l]),
              "%s: layer %d first part %d padded %d", what, l, p->k0_real[l], p->k0_pad[l]);
        CHECK(is_mult16(p->n_pad[l]) && p->n_pad[l] >= nr && p->n_pad[l] < nr + 16, "%s: layer %d n_pad %d (n %d)",
              what, l, p->n_pad[l], nr);
        if (l > 0 && spec->cat[l] == FM_CAT_NONE)
            CHECK(p->k_pad[l] == p->n_pad[l - 1], "%s: layer %d k_pad %d != previous n_pad %d", what, l, p->k_pad[l],
                  p->n_pad[l - 1]);
        int nc = p->n_chunk[l];
        CHECK(is_mult16(nc) && nc <= p->n_pad[l] && nc <= 128, "%s: layer %d n_chunk %d (n_pad %d)", what, l, nc,
              p->n_pad[l]);
        if (is_mult16(nc)) {
            int chunks = (p->n_pad[l] + nc - 1) / nc;
            CHECK(chunks * nc >= p->n_pad[l] && (chunks - 1) * nc < p->n_pad[l], "%s: layer %d chunks", what, l);
            multi_chunk |= chunks > 1;
        }
        CHECK(p->has_bias[l] == spec->has_bias[l], "%s: layer %d has_bias", what, l);
        CHECK(p->w_offset[l] == w_expect, "%s: layer %d w_offset %zu, want %zu", what, l, p->w_offset[l], w_expect);
        CHECK(p->b_offset[l] == b_expect, "%s: layer %d b_offset %zu, want %zu", what, l, p->b_offset[l], b_expect);
        CHECK(p->w_offset[l] * (size_t)p->elem_bytes % 16 == 0, "%s: layer %d w_offset %zu not 16-byte aligned", what,
              l, p->w_offset[l]);
        CHECK(p->b_offset[l] % 4 == 0, "%s: layer %d b_offset %zu not 16-byte aligned", what, l, p->b_offset[l]);
        CHECK(fm_plan_w_stride(p, l) * p->elem_bytes == p->k_pad[l] * p->elem_bytes + 16, "%s: layer %d weight row",
              what, l);
        w_expect += (size_t)p->n_pad[l] * (size_t)fm_plan_w_stride(p, l);
        b_expect += (size_t)p->n_pad[l];
    }
    if (auto_opts) {
        for (int l = 0; l < L; ++l)
            CHECK(p->m_tiles * p->n_chunk[l] <= (widest > 128 ? 64 : 128),
                  "%s: layer %d m_tiles %d x n_chunk %d over the accumulator budget", what, l, p->m_tiles,
                  p->n_chunk[l]);
        CHECK(widest <= 128 || p->m_tiles == 1, "%s: m_tiles %d with a %d-wide layer", what, p->m_tiles,
              widest);
    }
    CHECK(p->w_elems == w_expect, "%s: w_elems %zu, want %zu", what, p->w_elems, w_expect);
    CHECK(p->b_floats >= b_expect && p->b_floats < b_expect + 4 && p->b_floats % 4 == 0, "%s: b_floats %zu (sum %zu)",
          what, p->b_floats, b_expect);
    CHECK(p->warps == 1 || p->warps == 2 || p->warps == 4 || p->warps == 8, "%s: warps %d", what, p->warps);
    CHECK(p->m_tiles == 1 || p->m_tiles == 2, "%s: m_tiles %d", what, p->m_tiles);
    CHECK(p->rows_per_cta == p->warps * p->m_tiles * 16, "%s: rows_per_cta %d", what, p->rows_per_cta);
    CHECK(p->resident == 0 || p->resident == 1, "%s: resident %d", what, p->resident);
    CHECK(p->smem_bytes <= t->smem_per_block, "%s: smem %zu > %zu", what, p->smem_bytes, t->smem_per_block);

    /* activation rows: 16-byte units, an odd count of them, wide enough for every value and the staged output */
    CHECK(p->elem_bytes == (int)fm_prec_size(p->prec), "%s: elem_bytes %d", what, p->elem_bytes);
    int row_bytes = p->act_stride * p->elem_bytes;
    CHECK(row_bytes % 16 == 0 && (row_bytes / 16) % 2 == 1, "%s: act_stride %d", what, p->act_stride);
    for (int v = 0; v <= L; ++v)
        CHECK(row_bytes >= (spec->width[v] + 15) / 16 * 16 * p->elem_bytes + 16, "%s: act_stride %d < value %d",
              what, p->act_stride, v - 1);
    int n_out = p->n_pad[L - 1];
    CHECK(row_bytes >= n_out * (int)fm_dtype_size(p->out_dtype) + 16, "%s: act_stride %d too narrow for the staged "
          "output (%d columns)", what, p->act_stride, n_out);

    check_buffers(p, spec, what);
    CHECK(!multi_chunk || p->buffers >= 2, "%s: buffers %d with a multi-chunk layer", what, p->buffers);

    /* streamed slots hold the largest (layer, chunk) stage */
    size_t slot = 0;
    for (int l = 0; l < L; ++l) {
        size_t s = (size_t)p->n_chunk[l] * (size_t)fm_plan_w_stride(p, l);
        slot = s > slot ? s : slot;
    }
    CHECK(p->resident ? p->w_slot_elems == 0 : p->w_slot_elems == slot, "%s: w_slot_elems %zu (resident %d, "
          "largest stage %zu)", what, p->w_slot_elems, p->resident, slot);
    size_t w_region = p->resident ? p->w_elems : 2 * p->w_slot_elems;
    size_t act = (size_t)p->warps * (size_t)p->buffers * (size_t)(p->m_tiles * 16) * (size_t)p->act_stride;
    size_t want = (size_t)p->elem_bytes * (w_region + act) + 4 * p->b_floats;
    CHECK(p->smem_bytes == want, "%s: smem_bytes %zu != %zu", what, p->smem_bytes, want);

    CHECK(p->blocks_per_sm >= 1 && p->blocks_per_sm * p->warps <= 16, "%s: blocks_per_sm %d with %d warps", what,
          p->blocks_per_sm, p->warps);
    size_t per_sm = t->smem_per_sm ? t->smem_per_sm : t->smem_per_block;
    CHECK(p->blocks_per_sm == 1 || (size_t)p->blocks_per_sm * (p->smem_bytes + 1024) <= per_sm,
          "%s: %d blocks of %zu bytes overflow %zu per SM", what, p->blocks_per_sm, p->smem_bytes, per_sm);
}

static void test_targets(void) {
    fm_error err = {0};
    fm_target t;
    for (int i = 0; i < NUM_ARCHS; ++i) {
        CHECK(fm_target_for_arch(g_archs[i], &t, &err) == FM_OK, "arch %d: %s", g_archs[i], err.message);
        CHECK(t.arch == g_archs[i] && t.sm_count == 0 && t.smem_per_block >= 64 * 1024 &&
                  t.smem_per_sm >= t.smem_per_block,
              "arch %d: target %d %zu %zu", g_archs[i], t.arch, t.smem_per_block, t.smem_per_sm);
        fm_error_clear(&err);
    }
    CHECK(fm_target_for_arch(90, &t, &err) == FM_OK && t.smem_per_block == 227 * 1024, "sm_90 opt-in limit");
    fm_error_clear(&err);
    static const int bad[] = {61, 70, 0, -1, 91};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
        char want[32];
        snprintf(want, sizeof want, "sm_%d", bad[i]);
        fm_status st = fm_target_for_arch(bad[i], &t, &err);
        CHECK(st == FM_ERR_VALUE && err.status == FM_ERR_VALUE && strstr(err.message, want) != NULL &&
                  strstr(err.message, "sm_75") != NULL,
              "arch %d: status %d message \"%s\"", bad[i], (int)st, err.message);
        fm_error_clear(&err);
    }
}

static int g_plans_made;

static void test_plan_networks(void) {
    static const fm_dtype dtypes[][2] = {{FM_F32, FM_F32}, {FM_F16, FM_F16}, {FM_F32, FM_F16}, {FM_F16, FM_F32}};
    for (int a = 0; a < NUM_ARCHS; ++a) {
        fm_target t;
        fm_error err = {0};
        CHECK(fm_target_for_arch(g_archs[a], &t, &err) == FM_OK, "target %d", g_archs[a]);
        for (int n = 0; n < NUM_NETS; ++n) {
            fm_spec spec;
            if (!make_spec(&spec, g_nets[n].widths, g_nets[n].num_layers, n % 2))
                continue;
            for (size_t d = 0; d < 3 * sizeof dtypes / sizeof dtypes[0]; ++d) {
                const fm_prec prec = (fm_prec)(d / 4); /* every precision with every dtype pair */
                if (g_archs[a] < fm_prec_min_arch(prec))
                    continue;
                char what[160];
                snprintf(what, sizeof what, "%s sm_%d %s %s->%s", g_nets[n].name, g_archs[a], fm_prec_name(prec),
                         fm_dtype_name(dtypes[d % 4][0]), fm_dtype_name(dtypes[d % 4][1]));
                fm_plan plan;
                fm_status st = fm_plan_make(&spec, &t, NULL, prec, dtypes[d % 4][0], dtypes[d % 4][1], &plan, &err);
                CHECK(st == FM_OK && err.status == FM_OK, "%s: fm_plan_make: %s", what, err.message);
                fm_error_clear(&err);
                if (st != FM_OK)
                    continue;
                ++g_plans_made;
                CHECK(plan.in_dtype == dtypes[d % 4][0] && plan.out_dtype == dtypes[d % 4][1] && plan.prec == prec, "%s: dtypes", what);
                check_plan(&plan, &spec, &t, 1, what);

                /* Forced tile shape: honoured, or a limit error that names the options. */
                fm_plan_opts opts = {4, 1, 0, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0};
                fm_plan forced;
                st = fm_plan_make(&spec, &t, &opts, prec, dtypes[d % 4][0], dtypes[d % 4][1], &forced, &err);
                if (st == FM_OK) {
                    CHECK(forced.warps == 4 && forced.m_tiles == 1, "%s: forced warps=4 m_tiles=1 gave %d, %d", what,
                          forced.warps, forced.m_tiles);
                    check_plan(&forced, &spec, &t, 0, what);
                } else {
                    CHECK(st == FM_ERR_LIMIT && strstr(err.message, "warps=4, m_tiles=1") != NULL,
                          "%s: forced warps=4: status %d \"%s\"", what, (int)st, err.message);
                }
                fm_error_clear(&err);

                /* Forced streaming. */
                fm_plan_opts stream = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
                st = fm_plan_make(&spec, &t, &stream, prec, dtypes[d % 4][0], dtypes[d % 4][1], &forced, &err);
                if (st == FM_OK) {
                    CHECK(forced.resident == 0 && forced.w_slot_elems > 0, "%s: resident=0 gave resident %d", what,
                          forced.resident);
                    check_plan(&forced, &spec, &t, 1, what);
                } else {
                    CHECK(st == FM_ERR_LIMIT && strstr(err.message, "resident=0") != NULL,
                          "%s: forced resident=0: status %d \"%s\"", what, (int)st, err.message);
                }
                fm_error_clear(&err);

                /* Forced residency and chunk width. */
                fm_plan_opts res = {0, 0, 32, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0};
                st = fm_plan_make(&spec, &t, &res, prec, dtypes[d % 4][0], dtypes[d % 4][1], &forced, &err);
                if (st == FM_OK) {
                    CHECK(forced.resident == 1, "%s: resident=1 gave %d", what, forced.resident);
                    for (int l = 0; l < forced.num_layers; ++l)
                        CHECK(forced.n_chunk[l] <= 32, "%s: n_chunk=32 gave layer %d chunk %d", what, l,
                              forced.n_chunk[l]);
                    check_plan(&forced, &spec, &t, 0, what);
                } else {
                    CHECK(st == FM_ERR_LIMIT && strstr(err.message, "n_chunk=32, resident=1") != NULL,
                          "%s: forced resident=1: status %d \"%s\"", what, (int)st, err.message);
                }
                fm_error_clear(&err);
            }
            fm_spec_free(&spec);
        }
    }
}

/* Random graphs: residuals from any earlier value, input concats before and after; every buffer assignment is
 * replayed by check_buffers under each precision and forced option set. */
static void test_plan_graphs(void) {
    static const int arch_list[] = {80, 90};
    int planned = 0;
    for (int trial = 0; trial < 400; ++trial) {
        int L = 1 + (int)(uniform() * 7), widths[FM_MAX_LAYERS + 1], cat[FM_MAX_LAYERS] = {0};
        int64_t shapes[2 * FM_MAX_LAYERS], bias[FM_MAX_LAYERS];
        const char *acts[FM_MAX_LAYERS];
        int common = 8 + 8 * (int)(uniform() * 20);
        for (int v = 0; v <= L; ++v) /* mostly one width, so residual operands exist */
            widths[v] = uniform() < 0.7 ? common : 1 + (int)(uniform() * 200);
        for (int l = 0; l < L; ++l) {
            cat[l] = l > 0 && uniform() < 0.25 ? 1 + (int)(uniform() * 2) : FM_CAT_NONE;
            shapes[2 * l] = widths[l + 1];
            shapes[2 * l + 1] = widths[l] + (cat[l] ? widths[0] : 0);
            bias[l] = l % 2 ? widths[l + 1] : -1;
            acts[l] = g_acts[l % 4];
        }
        fm_spec spec;
        fm_error err = {0};
        if (fm_spec_init(&spec, L, shapes, bias, acts, cat, &err) != FM_OK) {
            CHECK(0, "graph %d: spec: %s", trial, err.message);
            fm_error_clear(&err);
            continue;
        }
        for (int l = 0; l < L; ++l) {
            if (uniform() < 0.5)
                continue;
            int src = -1 + (int)(uniform() * (l + 1)); /* -1..l-1 */
            if (spec.width[src + 1] != spec.width[l + 1])
                continue;
            CHECK(fm_spec_set_residual(&spec, l, 1 + (int)(uniform() * 2), "relu", src, &err) == FM_OK,
                  "graph %d: residual %d from %d: %s", trial, l, src, err.message);
            fm_error_clear(&err);
        }
        for (int a = 0; a < 2; ++a) {
            fm_target t;
            fm_target_for_arch(arch_list[a], &t, &err);
            for (int prec = 0; prec < 3; ++prec) {
                fm_plan_opts opts[] = {{0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0}, {0, 0, 32, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0},
                                       {4, 1, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}};
                for (int o = 0; o < 3; ++o) {
                    char what[96];
                    snprintf(what, sizeof what, "graph %d sm_%d %s opts %d", trial, arch_list[a],
                             fm_prec_name((fm_prec)prec), o);
                    fm_plan p;
                    fm_status st = fm_plan_make(&spec, &t, &opts[o], (fm_prec)prec, FM_F32, FM_F16, &p, &err);
                    if (st == FM_OK) {
                        ++planned;
                        check_plan(&p, &spec, &t, o == 0, what);
                    } else {
                        CHECK(st == FM_ERR_LIMIT, "%s: status %d \"%s\"", what, (int)st, err.message);
                    }
                    fm_error_clear(&err);
                }
            }
        }
        fm_spec_free(&spec);
    }
    CHECK(planned > 4000, "only %d graph plans made", planned);
}

static void test_plan_choices(void) {
    fm_error err = {0};
    fm_target t90, t75;
    fm_target_for_arch(90, &t90, &err);
    fm_target_for_arch(75, &t75, &err);
    fm_plan p;

    /* 1-1: a single 16x16 tile, one chunk, in place, everything resident. */
    fm_spec spec;
    int w11[] = {1, 1};
    if (make_spec(&spec, w11, 1, 0)) {
        CHECK(fm_plan_make(&spec, &t90, NULL, FM_PREC_F16, FM_F32, FM_F32, &p, &err) == FM_OK, "1-1: %s", err.message);
        CHECK(p.wgmma && p.w_elems == 16 * 16, "1-1 on sm_90: wgmma %d, %zu weight elements", p.wgmma, p.w_elems);
        CHECK(fm_plan_make(&spec, &t75, NULL, FM_PREC_F16, FM_F32, FM_F32, &p, &err) == FM_OK, "1-1: %s", err.message);
        CHECK(p.k_pad[0] == 16 && p.n_pad[0] == 16 && p.n_chunk[0] == 16 && p.w_elems == 16 * 24 &&
                  p.b_floats == 16 && p.buffers == 1 && p.resident == 1 && p.w_offset[0] == 0 && p.b_offset[0] == 0,
              "1-1: k_pad %d n_pad %d nc %d w %zu b %zu buffers %d resident %d", p.k_pad[0], p.n_pad[0], p.n_chunk[0],
              p.w_elems, p.b_floats, p.buffers, p.resident);
        fm_spec_free(&spec);
    }
    fm_error_clear(&err);

    /* 256x8 on sm_75 (64 KiB): 8 * 256 * 264 halves cannot stay resident; streaming must fit. */
    if (make_spec(&spec, g_nets[4].widths, 8, 0)) {
        CHECK(fm_plan_make(&spec, &t75, NULL, FM_PREC_F16, FM_F32, FM_F32, &p, &err) == FM_OK, "256x8 sm_75: %s", err.message);
        CHECK(p.resident == 0 && p.buffers == 2, "256x8 sm_75: resident %d buffers %d", p.resident, p.buffers);
        fm_error_clear(&err);

        fm_plan_opts res = {0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0};
        fm_status st = fm_plan_make(&spec, &t75, &res, FM_PREC_F16, FM_F32, FM_F32, &p, &err);
        CHECK(st == FM_ERR_LIMIT && strstr(err.message, "resident=1") != NULL && strstr(err.message, "65536") != NULL &&
                  strstr(err.message, "sm_75") != NULL,
              "256x8 sm_75 resident=1: status %d \"%s\"", (int)st, err.message);
        fm_error_clear(&err);

        fm_plan_opts big = {8, 2, 128, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0};
        st = fm_plan_make(&spec, &t75, &big, FM_PREC_F16, FM_F32, FM_F32, &p, &err);
        CHECK(st == FM_ERR_LIMIT && strstr(err.message, "warps=8, m_tiles=2, n_chunk=128") != NULL,
              "256x8 sm_75 8x2x128: status %d \"%s\"", (int)st, err.message);
        fm_error_clear(&err);
        fm_spec_free(&spec);
    }

    /* bfloat16 I/O and bf16/tf32 compute need sm_80: refused on sm_75 by name, planned on sm_90. */
    if (make_spec(&spec, w11, 1, 0)) {
        fm_status st = fm_plan_make(&spec, &t75, NULL, FM_PREC_F16, FM_BF16, FM_F32, &p, &err);
        CHECK(st == FM_ERR_LIMIT && strstr(err.message, "bfloat16") != NULL && strstr(err.message, "sm_75") != NULL,
              "bf16 in on sm_75: %d \"%s\"", (int)st, err.message);
        fm_error_clear(&err);
        st = fm_plan_make(&spec, &t75, NULL, FM_PREC_TF32, FM_F32, FM_F32, &p, &err);
        CHECK(st == FM_ERR_LIMIT && strstr(err.message, "tf32") != NULL && strstr(err.message, "sm_80") != NULL,
              "tf32 on sm_75: %d \"%s\"", (int)st, err.message);
        fm_error_clear(&err);
        st = fm_plan_make(&spec, &t90, NULL, FM_PREC_BF16, FM_BF16, FM_BF16, &p, &err);
        CHECK(st == FM_OK && p.in_dtype == FM_BF16 && p.prec == FM_PREC_BF16 && p.elem_bytes == 2,
              "bf16 on sm_90: %d \"%s\"", (int)st, err.message);
        fm_error_clear(&err);
        st = fm_plan_make(&spec, &t90, NULL, FM_PREC_TF32, FM_F32, FM_F32, &p, &err);
        CHECK(st == FM_OK && p.elem_bytes == 4 && p.w_elems == 16 * 20 && p.act_stride % 4 == 0,
              "tf32 on sm_90: %d w_elems %zu \"%s\"", (int)st, p.w_elems, err.message);
        fm_error_clear(&err);
        fm_spec_free(&spec);
    }

    /* Width 257 anywhere: a limit error naming 257 and the 256 maximum, with a hint; but on sm_90, whose streamed
     * warpgroup kernel holds up to 512 features a layer, a plan of that kernel. Width 1000: the 512 maximum. */
    static const struct {
        int num_layers;
        int widths[4];
    } wide[] = {{2, {8, 257, 4}}, {1, {257, 4}}, {1, {4, 257}}, {3, {16, 256, 257, 1}}, {1, {1000, 1}}};
    for (size_t i = 0; i < sizeof wide / sizeof wide[0]; ++i) {
        if (!make_spec(&spec, wide[i].widths, wide[i].num_layers, 0))
            continue;
        int w = 0;
        for (int l = 0; l <= wide[i].num_layers; ++l)
            w = wide[i].widths[l] > 256 ? wide[i].widths[l] : w;
        char num[16];
        snprintf(num, sizeof num, "%d", w);
        for (int a = 0; a < NUM_ARCHS; ++a) {
            fm_target t;
            fm_target_for_arch(g_archs[a], &t, &err);
            fm_status st = fm_plan_make(&spec, &t, NULL, FM_PREC_F16, FM_F32, FM_F32, &p, &err);
            if (g_archs[a] == 90 && w <= 512) {
                CHECK(st == FM_OK && p.wgmma && p.stream_slots >= 2, "width %d on sm_90: status %d \"%s\"", w,
                      (int)st, err.message);
            } else {
                CHECK(st == FM_ERR_LIMIT && err.status == FM_ERR_LIMIT && strstr(err.message, num) != NULL &&
                          strstr(err.message, w > 512 ? "512" : "256") != NULL && err.hint[0] != '\0',
                      "width %d on sm_%d: status %d \"%s\"", w, g_archs[a], (int)st, err.message);
            }
            fm_error_clear(&err);
        }
        fm_spec_free(&spec);
    }
}

/* ------------------------------------------------------------------------------------------------ pack */

static void test_pack(void) {
    fm_error err = {0};
    fm_target t;
    fm_target_for_arch(80, &t, &err);
    for (int n = 0; n < NUM_NETS; ++n) {
        const net *nt = &g_nets[n];
        for (int bias_mode = 0; bias_mode < 3; ++bias_mode) { /* 0, 1: alternating biases; 2: b == NULL */
            fm_spec spec;
            if (!make_spec(&spec, nt->widths, nt->num_layers, bias_mode & 1))
                continue;
            fm_plan p;
            /* x whole: the layout of every weight as given (x_split's three parts: tests/test_x_split.py) */
            fm_plan_opts whole = {0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, -1};
            if (fm_plan_make(&spec, &t, &whole, FM_PREC_F16, FM_F32, FM_F32, &p, &err) != FM_OK) {
                CHECK(0, "%s: plan: %s", nt->name, err.message);
                fm_error_clear(&err);
                fm_spec_free(&spec);
                continue;
            }
            float *w[FM_MAX_LAYERS], *b[FM_MAX_LAYERS];
            for (int l = 0; l < p.num_layers; ++l) {
                size_t nw = (size_t)p.n_real[l] * (size_t)p.k_real[l];
                w[l] = malloc(nw * sizeof(float));
                b[l] = malloc((size_t)p.n_real[l] * sizeof(float));
                for (size_t i = 0; i < nw; ++i) /* wide range: subnormal halves, overflow to inf, exact zeros */
                    w[l][i] = i % 97 == 0 ? 0.0f : sym(1.0) * (float)pow(2.0, 40.0 * uniform() - 28.0);
                for (int i = 0; i < p.n_real[l]; ++i)
                    b[l][i] = sym(3.0) + 0.5f; /* never 0: padding shows */
            }
            uint16_t *wb = malloc(p.w_elems * sizeof *wb);
            float *bb = malloc(p.b_floats * sizeof *bb);
            memset(wb, 0xab, p.w_elems * sizeof *wb); /* garbage the pack must overwrite */
            memset(bb, 0xab, p.b_floats * sizeof *bb);
            char *real = calloc(p.w_elems, 1);
            char *breal = calloc(p.b_floats, 1);
            fm_plan_pack(&p, (const float *const *)w, bias_mode == 2 ? NULL : (const float *const *)b, wb, bb);

            int bad_w = 0, bad_pad = 0, bad_b = 0, bad_bpad = 0;
            for (int l = 0; l < p.num_layers; ++l) {
                int stride = fm_plan_w_stride(&p, l);
                for (int r = 0; r < p.n_real[l]; ++r)
                    for (int k = 0; k < p.k_real[l]; ++k) {
                        size_t at = p.w_offset[l] + (size_t)r * (size_t)stride + (size_t)k;
                        if (at >= p.w_elems) {
                            bad_w++;
                            continue;
                        }
                        real[at] = 1;
                        bad_w += wb[at] != fm_float_to_half(w[l][(size_t)r * (size_t)p.k_real[l] + (size_t)k]);
                    }
                int has = bias_mode != 2 && p.has_bias[l];
                for (int r = 0; r < p.n_real[l] && has; ++r) {
                    size_t at = p.b_offset[l] + (size_t)r;
                    breal[at] = 1;
                    bad_b += memcmp(&bb[at], &b[l][r], sizeof(float)) != 0;
                }
            }
            for (size_t i = 0; i < p.w_elems; ++i)
                bad_pad += !real[i] && wb[i] != 0;
            for (size_t i = 0; i < p.b_floats; ++i)
                bad_bpad += !breal[i] && bb[i] != 0.0f;
            CHECK(bad_w == 0, "%s bias mode %d: %d packed weights differ", nt->name, bias_mode, bad_w);
            CHECK(bad_pad == 0, "%s bias mode %d: %d padding halves not zero", nt->name, bias_mode, bad_pad);
            CHECK(bad_b == 0, "%s bias mode %d: %d biases differ", nt->name, bias_mode, bad_b);
            CHECK(bad_bpad == 0, "%s bias mode %d: %d bias padding floats not zero", nt->name, bias_mode, bad_bpad);

            free(real);
            free(breal);
            free(wb);
            free(bb);
            for (int l = 0; l < p.num_layers; ++l) {
                free(w[l]);
                free(b[l]);
            }
            fm_spec_free(&spec);
        }
    }
    /* The packer's conversion itself, on values whose rounding is known. */
    CHECK(fm_float_to_half(1.0f) == 0x3c00 && fm_float_to_half(-2.0f) == 0xc000 && fm_float_to_half(65504.0f) == 0x7bff &&
              fm_float_to_half(65520.0f) == 0x7c00 && fm_float_to_half(5.9604645e-8f) == 0x0001 &&
              fm_float_to_half(1.0f + 1.0f / 2048.0f) == 0x3c00 && fm_float_to_half(1.0f + 3.0f / 2048.0f) == 0x3c02,
          "fm_float_to_half on known values");
}

/* K-pipelined layers (fm_plan_pipe) on chosen networks, auto at 4 warps: a tanh chain pipelines every layer but the
 * last; relu layers, residual networks and a stretch the kernel loops over (four equal 128-wide tanh layers) do not,
 * and forcing kpipe=1 there is a limit naming kpipe; three equal 128-wide layers (256 columns looped: under 384) do. */
static void test_kpipe_plans(void) {
    static const struct {
        int num_layers, widths[8];
        const char *act;
        int residual, pipelined; /* residual: layers 1.. add their input; pipelined: auto's kpipe */
    } cases[] = {
        {4, {2, 50, 50, 50, 1}, "tanh", 0, 1},         {4, {2, 128, 128, 128, 3}, "tanh", 0, 1},
        {6, {2, 128, 128, 128, 128, 128, 3}, "tanh", 0, 0}, {4, {32, 64, 64, 64, 16}, "relu", 0, 0},
        {4, {64, 128, 128, 128, 64}, "gelu", 1, 0},    {3, {3, 64, 96, 4}, "x * sigmoid(x)", 0, 1},
    };
    fm_error err = {0};
    fm_target t90;
    fm_target_for_arch(90, &t90, &err);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        const int L = cases[i].num_layers;
        int64_t shapes[2 * FM_MAX_LAYERS], bias[FM_MAX_LAYERS];
        const char *acts[FM_MAX_LAYERS];
        for (int l = 0; l < L; ++l) {
            shapes[2 * l] = cases[i].widths[l + 1];
            shapes[2 * l + 1] = cases[i].widths[l];
            bias[l] = cases[i].widths[l + 1];
            acts[l] = l < L - 1 ? cases[i].act : "none";
        }
        fm_spec spec;
        if (fm_spec_init(&spec, L, shapes, bias, acts, NULL, &err) != FM_OK) {
            CHECK(0, "kpipe case %zu: %s", i, err.message);
            fm_error_clear(&err);
            continue;
        }
        for (int l = 1; l < L - 1 && cases[i].residual; ++l)
            CHECK(fm_spec_set_residual(&spec, l, FM_RES_ADD, NULL, l - 1, &err) == FM_OK, "kpipe case %zu: residual "
                  "on layer %d: %s", i, l, err.message);
        fm_plan p;
        fm_plan_opts autop = {4, 0, 0, -1, 1, 0, 0, 0, 0, 0, 0, 0, 0}, on = {4, 0, 0, -1, 1, 0, 1, 0, 0, 0, 0, 0, 0};
        CHECK(fm_plan_make(&spec, &t90, &autop, FM_PREC_F16, FM_F16, FM_F16, &p, &err) == FM_OK &&
                  p.wgmma == 1 && p.cluster == 0 && p.kpipe == cases[i].pipelined,
              "kpipe case %zu (%s): auto kpipe %d, want %d %s", i, cases[i].act, p.kpipe, cases[i].pipelined,
              err.message);
        for (int l = 0; l < L && p.kpipe; ++l)
            CHECK(p.pipe[l] == (l < L - 1), "kpipe case %zu: layer %d pipe %d", i, l, p.pipe[l]);
        fm_error_clear(&err);
        fm_status st = fm_plan_make(&spec, &t90, &on, FM_PREC_F16, FM_F16, FM_F16, &p, &err);
        CHECK(cases[i].pipelined ? st == FM_OK && p.kpipe == 1
                                 : st == FM_ERR_LIMIT && strstr(err.message, "kpipe=1") != NULL,
              "kpipe case %zu forced: status %d, %s", i, (int)st, err.message);
        fm_error_clear(&err);
        fm_spec_free(&spec);
    }
}

/* The sm_90a plan: chosen for the networks it takes (fp16/bf16 chains, own-input residuals, resident weights), never
 * elsewhere; forced shapes honoured or refused by name; the packed blob in wgmma's core-matrix layout (checked
 * against the layout written out here, element by element, padding zero). */
static void test_wgmma_plans(void) {
    fm_error err = {0};
    fm_target t90, t80;
    fm_target_for_arch(90, &t90, &err);
    fm_target_for_arch(80, &t80, &err);
    int chosen = 0, pipelined = 0;
    for (int n = 0; n < NUM_NETS; ++n) {
        fm_spec spec;
        if (!make_spec(&spec, g_nets[n].widths, g_nets[n].num_layers, n % 2))
            continue;
        int widest = 0;
        for (int v = 0; v <= spec.num_layers; ++v)
            widest = spec.width[v] > widest ? spec.width[v] : widest;
        for (int prec = 0; prec < 3; ++prec) {
            fm_plan p;
            if (fm_plan_make(&spec, &t90, NULL, (fm_prec)prec, FM_F32, FM_F16, &p, &err) != FM_OK) {
                fm_error_clear(&err);
                continue;
            }
            CHECK(p.wgmma == 0 || (prec != FM_PREC_TF32 && widest <= 256), "%s %s: wgmma %d", g_nets[n].name,
                  fm_prec_name((fm_prec)prec), p.wgmma);
            chosen += p.wgmma;
            if (prec == FM_PREC_TF32 || widest > 256)
                continue;
            fm_plan_opts any = {0, 0, 0, -1, 1, 0, 0, 0, 0, 0, 0, 0, 0};
            if (fm_plan_make(&spec, &t90, &any, (fm_prec)prec, FM_F32, FM_F16, &p, &err) != FM_OK) {
                CHECK(strstr(err.message, "registers") || strstr(err.message, "do not fit"), "%s: %s", g_nets[n].name,
                      err.message);
                fm_error_clear(&err);
                continue;
            }
            /* The default plan: each layer one group, its accumulators, input and output fragments within 255
             * registers (64 x n fp32 over 128 threads, 64 x k halves, 64 x n halves but for the last layer, 40 more);
             * a network over that, or over one CTA's shared memory, takes the cluster form or the streamed one
             * (column groups, one at a time in the registers) instead. */
            int over = 0;
            for (int l = 0; l < p.num_layers; ++l) {
                int regs = p.n_pad[l] / 2 + p.k_pad[l] / 4 + (l == p.num_layers - 1 ? 0 : p.n_pad[l] / 4) + 40;
                over |= regs > 255;
                CHECK(p.cluster || p.stream_slots || (p.n_chunk[l] == p.n_pad[l] && regs <= 255),
                      "%s: layer %d (%d -> %d) in groups of %d", g_nets[n].name, l, p.k_pad[l], p.n_pad[l],
                      p.n_chunk[l]);
            }
            check_plan(&p, &spec, &t90, 0, g_nets[n].name);
            if ((p.cluster || p.stream_slots) && !over) { /* then the register-A kernel's weights and stages do not fit
                                                             one CTA */
                /* resident weights: no streamed form either */
                fm_plan_opts regs_a = {0, 0, 0, 1, 1, -1, 0, 0, 0, 0, 0, 0, 0};
                CHECK(fm_plan_make(&spec, &t90, &regs_a, (fm_prec)prec, FM_F32, FM_F16, &p, &err) == FM_ERR_LIMIT &&
                          strstr(err.message, "do not fit"),
                      "%s: cluster chosen, but the register-A kernel fits: %s", g_nets[n].name, err.message);
                fm_error_clear(&err);
            }
            /* n_chunk forced: every layer wider than 64 becomes 64-column groups (the last takes the rest) */
            fm_plan_opts split = {4, 0, 64, -1, 1, 0, 0, 0, 0, 0, 0, 0, 0};
            if (fm_plan_make(&spec, &t90, &split, (fm_prec)prec, FM_F16, FM_F16, &p, &err) == FM_OK) {
                char what[96];
                snprintf(what, sizeof what, "%s %s wgmma n_chunk=64", g_nets[n].name, fm_prec_name((fm_prec)prec));
                ++g_plans_made;
                for (int l = 0; l < p.num_layers; ++l)
                    CHECK(p.n_chunk[l] == (p.n_pad[l] > 64 ? 64 : p.n_pad[l]),
                          "%s: layer %d of %d columns in groups of %d", what, l, p.n_pad[l], p.n_chunk[l]);
                check_plan(&p, &spec, &t90, 0, what);
            } else {
                fm_error_clear(&err);
            }
            for (int warps = 4; warps <= 16; warps += 4) {
                fm_plan_opts o = {warps, 0, 0, -1, 1, 0, 0, 0, 0, 0, 0, 0, -1}; /* (x whole: the pack's layout) */
                char what[96];
                snprintf(what, sizeof what, "%s %s wgmma warps=%d", g_nets[n].name, fm_prec_name((fm_prec)prec),
                         warps);
                fm_status st = fm_plan_make(&spec, &t90, &o, (fm_prec)prec, FM_F16, FM_F32, &p, &err);
                if (st != FM_OK) {
                    CHECK(st == FM_ERR_LIMIT && (strstr(err.message, "do not fit") || strstr(err.message, "registers")),
                          "%s: %s", what, err.message);
                    fm_error_clear(&err);
                    continue;
                }
                ++g_plans_made;
                CHECK(p.wgmma == 1 && p.warps == warps, "%s: got wgmma %d warps %d", what, p.wgmma, p.warps);
                CHECK(65536 / (warps * 32) >= fm_plan_wgmma_regs(&p), "%s: %d registers per thread, needs %d", what,
                      65536 / (warps * 32), fm_plan_wgmma_regs(&p));
                check_plan(&p, &spec, &t90, 0, what);
                if (warps != 8)
                    continue;
                /* pack: element (n, k) at core matrix (n / 8, k / 8) of 128 bytes, row n % 8, half k % 8 */
                float *w[FM_MAX_LAYERS];
                for (int l = 0; l < p.num_layers; ++l) {
                    size_t nw = (size_t)p.n_real[l] * (size_t)p.k_real[l];
                    w[l] = malloc(nw * sizeof(float));
                    for (size_t i = 0; i < nw; ++i)
                        w[l][i] = sym(2.0) + (i % 7 == 0 ? 3.0f : 0.0f);
                }
                uint16_t *wb = malloc(p.w_elems * sizeof *wb);
                float *bb = malloc(p.b_floats * sizeof *bb);
                char *real = calloc(p.w_elems, 1);
                fm_plan_pack(&p, (const float *const *)w, NULL, wb, bb);
                int bad = 0, twice = 0, pad = 0;
                for (int l = 0; l < p.num_layers; ++l)
                    for (int r = 0; r < p.n_real[l]; ++r)
                        for (int k = 0; k < p.k_real[l]; ++k) {
                            /* a cluster plan: row r in CTA r / n_chunk's share (a last layer not split: n_chunk is
                             * n_pad, so all of it in CTA 0's) */
                            int share = p.cluster ? r / p.n_chunk[l] : 0;
                            int rr = p.cluster ? r % p.n_chunk[l] : r;
                            size_t core = (size_t)(rr / 8) * (size_t)(p.k_pad[l] / 8) + (size_t)(k / 8);
                            size_t at = (size_t)share * p.w_rank_elems + p.w_offset[l] + core * 64 +
                                        (size_t)(rr % 8) * 8 + (size_t)(k % 8);
                            twice += real[at]++;
                            uint16_t want = (uint16_t)fm_round_bits(w[l][(size_t)r * p.k_real[l] + k], p.prec);
                            bad += wb[at] != want;
                        }
                for (size_t i = 0; i < p.w_elems; ++i)
                    pad += !real[i] && wb[i] != 0;
                CHECK(bad == 0 && twice == 0 && pad == 0, "%s: pack: %d wrong, %d aliased, %d padding not zero", what,
                      bad, twice, pad);
                free(real);
                free(wb);
                free(bb);
                for (int l = 0; l < p.num_layers; ++l)
                    free(w[l]);
            }
            /* K-pipelined layers (fm_plan_pipe): auto takes them only at the warps and CTAs per SM of the plan without
             * them; kpipe=-1 never; kpipe=1 where the network has a layer for them, else a limit naming kpipe */
            fm_plan_opts off = {0, 0, 0, -1, 1, 0, -1, 0, 0, 0, 0, 0, 0}, on = {0, 0, 0, -1, 1, 0, 1, 0, 0, 0, 0, 0, 0};
            fm_plan base, piped;
            if (fm_plan_make(&spec, &t90, &off, (fm_prec)prec, FM_F16, FM_F16, &base, &err) == FM_OK &&
                fm_plan_make(&spec, &t90, &any, (fm_prec)prec, FM_F16, FM_F16, &p, &err) == FM_OK) {
                char what[96];
                snprintf(what, sizeof what, "%s %s kpipe", g_nets[n].name, fm_prec_name((fm_prec)prec));
                CHECK(base.kpipe == 0 && p.warps == base.warps && p.blocks_per_sm == base.blocks_per_sm &&
                          p.cluster == base.cluster,
                      "%s: auto %d warps x %d CTAs (kpipe %d), off %d x %d (kpipe %d)", what, p.warps, p.blocks_per_sm,
                      p.kpipe, base.warps, base.blocks_per_sm, base.kpipe);
                check_plan(&p, &spec, &t90, 0, what);
                fm_status st = fm_plan_make(&spec, &t90, &on, (fm_prec)prec, FM_F16, FM_F16, &piped, &err);
                CHECK(st == FM_OK ? piped.kpipe == 1 : st == FM_ERR_LIMIT && strstr(err.message, "kpipe=1"),
                      "%s=1: %s", what, err.message);
                CHECK(!p.kpipe || st == FM_OK, "%s: auto pipelined, kpipe=1 refused", what);
                if (st == FM_OK)
                    check_plan(&piped, &spec, &t90, 0, what);
                pipelined += p.kpipe;
            }
            fm_error_clear(&err);
        }
        /* never on sm_80, never for tf32; forcing it there names why */
        fm_plan p;
        fm_plan_opts force = {0, 0, 0, -1, 1, 0, 0, 0, 0, 0, 0, 0, 0};
        if (fm_plan_make(&spec, &t80, NULL, FM_PREC_F16, FM_F32, FM_F32, &p, &err) == FM_OK)
            CHECK(p.wgmma == 0, "%s: wgmma on sm_80", g_nets[n].name);
        fm_error_clear(&err);
        CHECK(fm_plan_make(&spec, &t80, &force, FM_PREC_F16, FM_F32, FM_F32, &p, &err) == FM_ERR_LIMIT &&
                  strstr(err.message, "wgmma=1 was asked for, but wgmma needs sm_90") != NULL,
              "%s: forced wgmma on sm_80: %s", g_nets[n].name, err.message);
        fm_error_clear(&err);
        CHECK(fm_plan_make(&spec, &t90, &force, FM_PREC_TF32, FM_F32, FM_F32, &p, &err) == FM_ERR_LIMIT &&
                  strstr(err.message, "float16 or bfloat16") != NULL,
              "%s: forced wgmma with tf32: %s", g_nets[n].name, err.message);
        fm_error_clear(&err);
        fm_spec_free(&spec);
    }
    CHECK(chosen >= NUM_NETS / 2, "the sm_90 plan chose wgmma for only %d network/precision pairs", chosen);
    CHECK(pipelined >= 4, "K-pipelined layers in only %d auto plans", pipelined);

    /* a residual from an earlier layer's output: the register-A kernel keeps that value in registers (one at a time);
     * a second one read while the first is kept, or an 8-bit network's, stays on mma.sync, the forced form naming why */
    static const int widths[] = {16, 32, 32, 32, 32};
    fm_spec spec;
    if (make_spec(&spec, widths, 4, 0)) {
        fm_plan p;
        CHECK(fm_spec_set_residual(&spec, 2, FM_RES_ADD, NULL, 0, &err) == FM_OK, "residual: %s", err.message);
        CHECK(fm_plan_make(&spec, &t90, NULL, FM_PREC_F16, FM_F32, FM_F32, &p, &err) == FM_OK && p.wgmma == 1,
              "residual from layer 0 into layer 2: wgmma %d (%s)", p.wgmma, err.message);
        fm_error_clear(&err);
        CHECK(fm_spec_set_residual(&spec, 3, FM_RES_ADD, NULL, 1, &err) == FM_OK, "residual: %s", err.message);
        CHECK(fm_plan_make(&spec, &t90, NULL, FM_PREC_F16, FM_F32, FM_F32, &p, &err) == FM_OK && p.wgmma == 0,
              "residuals from layers 0 and 1 into 2 and 3: wgmma %d (%s)", p.wgmma, err.message);
        fm_error_clear(&err);
        fm_plan_opts force = {0, 0, 0, -1, 1, 0, 0, 0, 0, 0, 0, 0, 0};
        CHECK(fm_plan_make(&spec, &t90, &force, FM_PREC_F16, FM_F32, FM_F32, &p, &err) == FM_ERR_LIMIT &&
                  strstr(err.message, "keep one earlier value for later layers' residuals at a time") != NULL,
              "two kept values, forced wgmma: %s", err.message);
        fm_error_clear(&err);
        fm_spec_free(&spec);
    }
}

/* The cluster (shared-memory-A) plan: siren256, whose weights exceed one CTA, gets clusters of 2 CTAs of two
 * warpgroups each; a network of 224-wide hidden layers gets clusters of 2 (its fragments exceed the register-A
 * kernel's registers, and 224 columns per CTA the cluster kernel's); a network the register-A kernel takes keeps it; forced cluster sizes are honoured
 * or refused with the rule; residuals from the own input are taken; residuals from earlier values, concat and sm_80 are
 * refused by name. */
static void test_cluster_plans(void) {
    fm_error err = {0};
    fm_target t90, t80;
    fm_target_for_arch(90, &t90, &err);
    fm_target_for_arch(80, &t80, &err);
    static const int siren[] = {2, 256, 256, 256, 3}, wide[] = {16, 224, 224, 16}, narrow[] = {64, 128, 128, 64};
    static const struct { const int *widths; int layers, cluster, warps; } cases[] = {
        {siren, 4, 2, 8}, {wide, 3, 2, 8}, {narrow, 3, 0, 12},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        fm_spec spec;
        if (!make_spec(&spec, cases[i].widths, cases[i].layers, 0))
            continue;
        for (int prec = 0; prec < 2; ++prec) {
            char what[96];
            snprintf(what, sizeof what, "cluster case %zu %s", i, fm_prec_name((fm_prec)prec));
            fm_plan p;
            CHECK(fm_plan_make(&spec, &t90, NULL, (fm_prec)prec, FM_F16, FM_F16, &p, &err) == FM_OK, "%s: %s", what,
                  err.message);
            fm_error_clear(&err);
            CHECK(p.wgmma == 1 && p.cluster == cases[i].cluster && p.warps == cases[i].warps,
                  "%s: wgmma %d cluster %d warps %d, want cluster %d warps %d", what, p.wgmma, p.cluster, p.warps,
                  cases[i].cluster, cases[i].warps);
            check_plan(&p, &spec, &t90, 1, what);
            ++g_plans_made;
            for (int c = 1; c <= 4; c *= 2)
                for (int warps = 0; warps <= 16; warps += 4) {
                    fm_plan_opts o = {warps, 0, 0, -1, -1, c, 0, 0, 0, 0, 0, 0, 0};
                    fm_status st = fm_plan_make(&spec, &t90, &o, (fm_prec)prec, FM_F32, FM_F16, &p, &err);
                    if (st == FM_OK) {
                        CHECK(p.cluster == c && (warps == 0 || p.warps == warps), "%s: asked cluster %d warps %d, got "
                              "%d %d", what, c, warps, p.cluster, p.warps);
                        check_plan(&p, &spec, &t90, 0, what);
                        ++g_plans_made;
                    } else {
                        CHECK(st == FM_ERR_LIMIT && (strstr(err.message, "does not fit") != NULL ||
                                                     strstr(err.message, "would not fit the registers") != NULL),
                              "%s cluster=%d warps=%d: "
                              "%s", what, c, warps, err.message);
                    }
                    fm_error_clear(&err);
                }
        }
        fm_plan p;
        fm_plan_opts three = {0, 0, 0, -1, -1, 3, 0, 0, 0, 0, 0, 0, 0};
        CHECK(fm_plan_make(&spec, &t90, &three, FM_PREC_F16, FM_F16, FM_F16, &p, &err) == FM_ERR_VALUE &&
                  strstr(err.message, "cluster=3: a cluster is 1, 2 or 4 CTAs") != NULL, "cluster=3: %s", err.message);
        fm_error_clear(&err);
        fm_plan_opts two = {0, 0, 0, -1, -1, 2, 0, 0, 0, 0, 0, 0, 0};
        CHECK(fm_plan_make(&spec, &t80, &two, FM_PREC_F16, FM_F16, FM_F16, &p, &err) == FM_ERR_LIMIT &&
                  strstr(err.message, "cluster=2 was asked for, but wgmma needs sm_90") != NULL, "sm_80: %s",
              err.message);
        fm_error_clear(&err);
        CHECK(fm_plan_make(&spec, &t90, &two, FM_PREC_TF32, FM_F16, FM_F16, &p, &err) == FM_ERR_LIMIT &&
                  strstr(err.message, "float16 or bfloat16") != NULL, "tf32: %s", err.message);
        fm_error_clear(&err);
        CHECK(fm_spec_set_residual(&spec, 1, FM_RES_ADD, NULL, 0, &err) == FM_OK || cases[i].widths[1] !=
                  cases[i].widths[2], "residual: %s", err.message);
        fm_error_clear(&err);
        if (spec.res_op[1] != FM_RES_NONE) {
            /* a residual from the layer's own input: the cluster kernel takes it (or says what does not fit), and the
             * default plan of a residual network too wide for the register-A kernel is its cluster plan */
            fm_status st = fm_plan_make(&spec, &t90, &two, FM_PREC_F16, FM_F16, FM_F16, &p, &err);
            CHECK((st == FM_OK && p.cluster == 2) ||
                      (st == FM_ERR_LIMIT && strstr(err.message, "fit") != NULL), "residual: %s", err.message);
            if (st == FM_OK)
                check_plan(&p, &spec, &t90, 0, "residual cluster=2");
            fm_error_clear(&err);
            if (cases[i].cluster > 0) {
                CHECK(fm_plan_make(&spec, &t90, NULL, FM_PREC_F16, FM_F16, FM_F16, &p, &err) == FM_OK &&
                          p.cluster == cases[i].cluster && p.wgmma == 1, "residual default: cluster %d wgmma %d (%s)",
                      p.cluster, p.wgmma, err.message);
                fm_error_clear(&err);
            }
            /* from an earlier value (layer 0's output into layer 2): refused by name */
            if (fm_spec_set_residual(&spec, 2, FM_RES_ADD, NULL, 0, &err) == FM_OK) {
                CHECK(fm_plan_make(&spec, &t90, &two, FM_PREC_F16, FM_F16, FM_F16, &p, &err) == FM_ERR_LIMIT &&
                          strstr(err.message, "residuals from a layer's own input only") != NULL,
                      "residual from layer 0: %s", err.message);
            }
            fm_error_clear(&err);
        }
        fm_spec_free(&spec);
    }
}

/* ------------------------------------------------------------------------------------------------ render */

static void expect_render_error(int line, const fm_spec *spec, const fm_plan *p, const char *tmpl, const char *needle) {
    fm_error err = {0};
    fm_str out = {0};
    fm_status st = fm_render(spec, p, NULL, tmpl, "k", &out, &err);
    g_checks++;
    if (st != FM_ERR_TEMPLATE || err.status != FM_ERR_TEMPLATE || strstr(err.message, needle) == NULL) {
        g_failures++;
        printf("FAIL line %d: render gave status %d \"%s\"; wanted FM_ERR_TEMPLATE with \"%s\"\n", line, (int)st,
               err.message, needle);
    }
    fm_str_free(&out);
    fm_error_clear(&err);
}
#define EXPECT_RENDER_ERROR(spec, p, tmpl, needle) expect_render_error(__LINE__, spec, p, tmpl, needle)

/* A kernel template with each #include of a shared file pasted in, as python/fusedmlp/_api.py reads it. */
static char *read_template(const char *root, const char *rel) {
    static const char *const shared[] = {"fm_common.cuh", "fm_mma_sync.cuh", "fm_wgmma.cuh"};
    char *whole = read_text(root, rel);
    for (size_t i = 0; i < sizeof shared / sizeof *shared && whole != NULL; ++i) {
        char line[64], path[64];
        snprintf(line, sizeof line, "#include \"%s\"", shared[i]);
        snprintf(path, sizeof path, "kernel_templates/%s", shared[i]);
        if (strstr(whole, line) == NULL)
            continue;
        char *text = read_text(root, path);
        char *next = text ? replace_first(whole, line, text) : NULL;
        free(text);
        free(whole);
        whole = next;
    }
    return whole;
}

static void test_render(const char *root) {
    char *tmpl = read_template(root, "kernel_templates/fused_mlp.cu");
    char *tmpl90 = read_template(root, "kernel_templates/fused_mlp_sm90.cu");
    char *prelude = read_text(root, "kernel_templates/activations.cuh");
    CHECK(tmpl != NULL && tmpl90 != NULL && prelude != NULL, "cannot read kernel_templates/ under %s", root);
    if (tmpl == NULL || tmpl90 == NULL || prelude == NULL) {
        free(tmpl);
        free(tmpl90);
        free(prelude);
        return;
    }
    int rendered90 = 0;
    fm_error err = {0};
    int rendered = 0;
    for (int a = 0; a < NUM_ARCHS; ++a) {
        fm_target t;
        fm_target_for_arch(g_archs[a], &t, &err);
        for (int n = 0; n < NUM_NETS; ++n) {
            fm_spec spec;
            if (!make_spec(&spec, g_nets[n].widths, g_nets[n].num_layers, n % 2))
                continue;
            fm_plan p;
            fm_dtype out_dtype = (a + n) % 2 ? FM_F16 : FM_F32;
            if (fm_plan_make(&spec, &t, NULL, FM_PREC_F16, FM_F32, out_dtype, &p, &err) != FM_OK) {
                CHECK(0, "%s sm_%d: plan: %s", g_nets[n].name, g_archs[a], err.message);
                fm_error_clear(&err);
                fm_spec_free(&spec);
                continue;
            }
            char kname[64];
            snprintf(kname, sizeof kname, "fm_test_kernel_%d_%d", g_archs[a], n);
            fm_str out = {0};
            fm_status st = fm_render(&spec, &p, prelude, p.wgmma ? tmpl90 : tmpl, kname, &out, &err);
            CHECK(st == FM_OK && err.status == FM_OK && out.data != NULL && !out.oom, "%s sm_%d: render: %s",
                  g_nets[n].name, g_archs[a], err.message);
            CHECK((!p.wgmma || g_archs[a] == 90) &&
                      p.wgmma == (strstr(out.data ? out.data : "", "wgmma.mma_async") != NULL),
                  "%s sm_%d: wgmma %d", g_nets[n].name, g_archs[a], p.wgmma);
            rendered90 += p.wgmma;
            if (st == FM_OK && out.data != NULL) {
                ++rendered;
                const char *s = out.data;
                CHECK(strncmp(s, prelude, strlen(prelude)) == 0, "%s: output does not start with the prelude",
                      g_nets[n].name);
                CHECK(strstr(s, "{{") == NULL && strstr(s, "}}") == NULL, "%s: a placeholder survived",
                      g_nets[n].name);
                CHECK(strstr(s, kname) != NULL, "%s: kernel name missing", g_nets[n].name);
                CHECK(count_occurrences(s, "template <> struct Layer<") == p.num_layers, "%s: %d Layer<> "
                      "specialisations, want %d", g_nets[n].name, count_occurrences(s, "template <> struct Layer<"),
                      p.num_layers);
                for (int l = 0; l < p.num_layers; ++l) {
                    char want[256];
                    snprintf(want, sizeof want, "template <> struct Layer<%d> {  // %d -> %d, activation ", l,
                             p.k_real[l], p.n_real[l]);
                    CHECK(strstr(s, want) != NULL, "%s: missing \"%s\"", g_nets[n].name, want);
                    snprintf(want, sizeof want,
                             "static constexpr int K = %d, K0 = %d, KR = %d, N = %d, NR = %d, NC = %d;", p.k_pad[l],
                             p.k0_pad[l], p.k_real[l], p.n_pad[l], p.n_real[l], p.n_chunk[l]);
                    CHECK(strstr(s, want) != NULL, "%s: missing \"%s\"", g_nets[n].name, want);
                    snprintf(want, sizeof want, "static constexpr int A0_BUF = %d, A1_BUF = %d, OUT_BUF = %d;",
                             p.a0_buf[l], p.a1_buf[l], p.out_buf[l]);
                    CHECK(strstr(s, want) != NULL, "%s: missing \"%s\"", g_nets[n].name, want);
                    snprintf(want, sizeof want, "static constexpr int W_OFF = %zu, B_OFF = %zu;", p.w_offset[l],
                             p.b_offset[l]);
                    CHECK(strstr(s, want) != NULL, "%s: missing \"%s\"", g_nets[n].name, want);
                }
                char want[128];
                snprintf(want, sizeof want, "#define FM_WARPS %d\n", p.warps);
                CHECK(strstr(s, want) != NULL, "%s: missing \"%s\"", g_nets[n].name, want);
                snprintf(want, sizeof want, "constexpr int ACT_STRIDE = %d;", p.act_stride);
                CHECK(strstr(s, want) != NULL, "%s: missing \"%s\"", g_nets[n].name, want);
                snprintf(want, sizeof want, "#define FM_OUT_TYPE %d ", (int)out_dtype);
                CHECK(strstr(s, want) != NULL, "%s: missing \"%s\"", g_nets[n].name, want);
            }
            fm_str_free(&out);
            fm_error_clear(&err);

            /* Without a prelude the output starts with the template itself. */
            if (a == 0 && n == 0) {
                st = fm_render(&spec, &p, NULL, tmpl, "k0", &out, &err);
                CHECK(st == FM_OK && out.data != NULL && strncmp(out.data, tmpl, 20) == 0, "render without prelude");
                fm_str_free(&out);
                fm_error_clear(&err);
            }

            if (a == 0 && n == 1) { /* template errors, on one real spec and plan */
                char *bad = malloc(strlen(tmpl) + 64);
                sprintf(bad, "%s\n{{NOPE}}\n", tmpl);
                EXPECT_RENDER_ERROR(&spec, &p, bad, "unknown placeholder {{NOPE}}");
                free(bad);
                EXPECT_RENDER_ERROR(&spec, &p, "line one\nline two {{NOPE}}", "line 2: unknown placeholder {{NOPE}}");
                EXPECT_RENDER_ERROR(&spec, &p, "{{warps}}", "line 1: '{{' not followed by NAME}}");

                char *no_warps = replace_first(tmpl, "{{WARPS}}", "4");
                CHECK(strstr(no_warps, "{{WARPS}}") == NULL, "replace_first");
                EXPECT_RENDER_ERROR(&spec, &p, no_warps, "never uses placeholder {{WARPS}}");
                free(no_warps);
                char *no_layers = replace_first(tmpl, "{{LAYERS}}", "");
                EXPECT_RENDER_ERROR(&spec, &p, no_layers, "never uses placeholder {{LAYERS}}");
                free(no_layers);
                EXPECT_RENDER_ERROR(&spec, &p, "", "never uses placeholder {{KERNEL_NAME}}");

                static const char *const malformed[] = {"{{",          "x {{",       "{{}}",     "{{ WARPS}}",
                                                        "{{WARPS }}", "{{WARPS}",   "{{WARPS",  "{{WARPS}x}",
                                                        "{{WAR-PS}}", "{{{WARPS}}}"};
                for (size_t i = 0; i < sizeof malformed / sizeof malformed[0]; ++i) {
                    char *m = replace_first(tmpl, "{{WARPS}}", malformed[i]);
                    EXPECT_RENDER_ERROR(&spec, &p, m, "'{{' not followed by NAME}}");
                    free(m);
                }
                /* line numbers count the template's own lines: {{WARPS}} sits on a known line */
                const char *at = strstr(tmpl, "{{WARPS}}");
                int line = 1;
                for (const char *q = tmpl; q < at; ++q)
                    line += *q == '\n';
                char *m = replace_first(tmpl, "{{WARPS}}", "{{WARPZ}}");
                char needle[96];
                snprintf(needle, sizeof needle, "line %d: unknown placeholder {{WARPZ}}", line);
                EXPECT_RENDER_ERROR(&spec, &p, m, needle);
                free(m);
                /* a placeholder used twice is fine */
                char *twice = malloc(strlen(tmpl) + 32);
                sprintf(twice, "%s\n// {{WARPS}}\n", tmpl);
                st = fm_render(&spec, &p, NULL, twice, "k", &out, &err);
                CHECK(st == FM_OK, "placeholder used twice: %s", err.message);
                fm_str_free(&out);
                fm_error_clear(&err);
                free(twice);
            }
            fm_spec_free(&spec);
        }
    }
    CHECK(rendered == NUM_ARCHS * NUM_NETS, "rendered %d of %d", rendered, NUM_ARCHS * NUM_NETS);
    CHECK(rendered90 >= NUM_NETS / 2, "only %d networks rendered the sm_90a template", rendered90);
    free(tmpl);
    free(tmpl90);
    free(prelude);
}

/* ------------------------------------------------------------------------------------------------ ref */

/* The activations of g_acts, written out here (not through fm_expr_eval). */
static double oracle_act(int which, double x) {
    switch (which) {
    case 0: return x < 0.0 ? 0.0 : x;
    case 1: return tanh(x);
    case 2: return x * (1.0 / (1.0 + exp(-x)));
    default: return x;
    }
}

/* Naive forward: for each row, each layer, each output, a float64 dot product, then the activation, then rounding
 * to float32 (ref.c keeps float32 between layers). */
static void oracle_forward(const int *widths, int L, const int *acts, const int *has_bias, float *const *w,
                           float *const *b, const float *x, int64_t rows, int64_t x_row, int64_t x_col, double *y) {
    int widest = 0;
    for (int l = 0; l <= L; ++l)
        widest = widths[l] > widest ? widths[l] : widest;
    double *cur = malloc(sizeof(double) * (size_t)widest), *next = malloc(sizeof(double) * (size_t)widest);
    for (int64_t r = 0; r < rows; ++r) {
        for (int k = 0; k < widths[0]; ++k)
            cur[k] = x[r * x_row + k * x_col];
        for (int l = 0; l < L; ++l) {
            for (int n = 0; n < widths[l + 1]; ++n) {
                double s = 0.0;
                for (int k = 0; k < widths[l]; ++k)
                    s += cur[k] * (double)w[l][(size_t)n * (size_t)widths[l] + (size_t)k];
                if (has_bias[l])
                    s += (double)b[l][n];
                next[n] = (double)(float)oracle_act(acts[l], s);
            }
            double *tmp = cur;
            cur = next;
            next = tmp;
        }
        for (int n = 0; n < widths[L]; ++n)
            y[r * widths[L] + n] = cur[n];
    }
    free(cur);
    free(next);
}

static double g_ref_max_err;
static long g_ref_values;

static void test_ref_case(const int *widths, int L, int act_offset, int64_t rows, int layout) {
    int64_t shapes[2 * FM_MAX_LAYERS], bias_len[FM_MAX_LAYERS];
    const char *act_text[FM_MAX_LAYERS];
    int acts[FM_MAX_LAYERS], has_bias[FM_MAX_LAYERS];
    float *w[FM_MAX_LAYERS], *b[FM_MAX_LAYERS];
    for (int l = 0; l < L; ++l) {
        shapes[2 * l] = widths[l + 1];
        shapes[2 * l + 1] = widths[l];
        has_bias[l] = (l + act_offset) % 3 != 2;
        bias_len[l] = has_bias[l] ? widths[l + 1] : -1;
        acts[l] = (l + act_offset) % 4;
        act_text[l] = g_acts[acts[l]];
        size_t nw = (size_t)widths[l] * (size_t)widths[l + 1];
        w[l] = malloc(nw * sizeof(float));
        b[l] = has_bias[l] ? malloc((size_t)widths[l + 1] * sizeof(float)) : NULL;
        double scale = 1.7 / sqrt((double)widths[l]);
        for (size_t i = 0; i < nw; ++i)
            w[l][i] = sym(scale);
        for (int i = 0; i < widths[l + 1] && has_bias[l]; ++i)
            b[l][i] = sym(0.5);
    }
    fm_spec spec;
    fm_error err = {0};
    fm_status st = fm_spec_init(&spec, L, shapes, bias_len, act_text, NULL, &err);
    CHECK(st == FM_OK, "ref spec: %s", err.message);
    fm_error_clear(&err);

    /* x with strides: 0 C order, 1 Fortran order, 2 every other row of a C array, 3 Fortran with padded columns */
    int k0 = widths[0], nL = widths[L];
    int64_t x_row, x_col, x_size;
    switch (layout) {
    case 0: x_row = k0, x_col = 1, x_size = rows * k0; break;
    case 1: x_row = 1, x_col = rows, x_size = rows * k0; break;
    case 2: x_row = 2 * (int64_t)k0, x_col = 1, x_size = 2 * rows * k0; break;
    default: x_row = 1, x_col = rows + 3, x_size = (rows + 3) * k0; break;
    }
    float *x = malloc(sizeof(float) * (size_t)(x_size > 0 ? x_size : 1));
    for (int64_t i = 0; i < x_size; ++i)
        x[i] = sym(2.0);
    enum { CANARY = 16 };
    size_t ny = (size_t)rows * (size_t)nL;
    float *y = malloc(sizeof(float) * (ny + CANARY));
    for (size_t i = 0; i < ny + CANARY; ++i)
        y[i] = -12345.0f;
    double *want = malloc(sizeof(double) * (ny > 0 ? ny : 1));

    if (st == FM_OK) {
        st = fm_ref_forward(&spec, (const float *const *)w, (const float *const *)b, x, rows, x_row, x_col, y, &err);
        CHECK(st == FM_OK && err.status == FM_OK, "fm_ref_forward: %s", err.message);
        fm_error_clear(&err);
        oracle_forward(widths, L, acts, has_bias, w, b, x, rows, x_row, x_col, want);
        double max_err = 0.0;
        int nonfinite = 0;
        for (size_t i = 0; i < ny; ++i) {
            double got = y[i], ref = want[i];
            if (!isfinite(got) || !isfinite(ref)) {
                nonfinite++;
                continue;
            }
            double e = fabs(got - ref) / fmax(fabs(ref), 1e-30);
            if (got == ref)
                e = 0.0;
            max_err = e > max_err ? e : max_err;
        }
        int canary_ok = 1;
        for (size_t i = ny; i < ny + CANARY; ++i)
            canary_ok &= y[i] == -12345.0f;
        CHECK(nonfinite == 0, "%d-layer net, %lld rows, layout %d: %d non-finite outputs", L, (long long)rows, layout,
              nonfinite);
        CHECK(max_err < 1e-6, "%d-layer net (%d -> %d), %lld rows, layout %d: max relative error %.3g", L, k0, nL,
              (long long)rows, layout, max_err);
        CHECK(canary_ok, "%d-layer net, %lld rows: wrote past y", L, (long long)rows);
        g_ref_max_err = max_err > g_ref_max_err ? max_err : g_ref_max_err;
        g_ref_values += (long)ny;
    }
    fm_spec_free(&spec);
    free(x);
    free(y);
    free(want);
    for (int l = 0; l < L; ++l) {
        free(w[l]);
        free(b[l]);
    }
}

static void test_ref(void) {
    static const net nets[] = {
        {"7-33-1-17", 3, {7, 33, 1, 17}},
        {"32-64-64-16", 3, {32, 64, 64, 16}},
        {"1-1", 1, {1, 1}},
        {"3-64-128-96-4", 4, {3, 64, 128, 96, 4}},
        {"2-50-50-50-1", 4, {2, 50, 50, 50, 1}},
        {"65-256-3", 2, {65, 256, 3}},
        {"5x8", 8, {5, 9, 11, 13, 15, 17, 19, 21, 23}},
    };
    const int64_t rows_list[] = {0, 1, 63, 64, 65, g_quick ? 200 : 1000};
    for (size_t n = 0; n < sizeof nets / sizeof nets[0]; ++n)
        for (size_t r = 0; r < sizeof rows_list / sizeof rows_list[0]; ++r)
            for (int layout = 0; layout < 4; ++layout)
                test_ref_case(nets[n].widths, nets[n].num_layers, (int)(n + r + (size_t)layout), rows_list[r], layout);

    /* Hand-checked values on 1-1 (relu, no bias), and rows 0 with NULL x and y: a no-op. */
    fm_spec spec;
    int w11[] = {1, 1};
    if (make_spec(&spec, w11, 1, 1)) {
        float w0 = 2.0f;
        const float *wp[1] = {&w0};
        fm_error err = {0};
        CHECK(fm_ref_forward(&spec, wp, NULL, NULL, 0, 1, 1, NULL, &err) == FM_OK, "rows 0 with NULL buffers");
        float x = -3.0f, y = 0.0f;
        CHECK(fm_ref_forward(&spec, wp, NULL, &x, 1, 1, 1, &y, &err) == FM_OK && y == 0.0f, "relu(2 * -3) = %g", y);
        x = 3.0f;
        CHECK(fm_ref_forward(&spec, wp, NULL, &x, 1, 1, 1, &y, &err) == FM_OK && y == 6.0f, "relu(2 * 3) = %g", y);
        fm_error_clear(&err);
        fm_spec_free(&spec);
    }
}

/* 8-bit plans (issue 26): widths padded to 32, weight codes at fm_plan_w_index equal fm_quant8(w / w_scale[n]), the
 * dequantisation factors act_scale * w_scale[n] at dq_offset (after the bias), padded columns zero; the quantised CPU
 * forward with amax runs clean under the sanitizers; the scales' rules refuse what they should. */
static void test_lowbit(void) {
    static const int widths[] = {7, 40, 33, 5};
    static const fm_prec precs[] = {FM_PREC_INT8, FM_PREC_E4M3};
    for (int pi = 0; pi < 2; ++pi) {
        const fm_prec prec = precs[pi];
        fm_spec spec;
        if (!make_spec(&spec, widths, 3, 0))
            return;
        float *w[3], *b[3];
        for (int l = 0; l < 3; ++l) {
            w[l] = malloc(sizeof(float) * (size_t)widths[l] * (size_t)widths[l + 1]);
            b[l] = malloc(sizeof(float) * (size_t)widths[l + 1]);
            for (int i = 0; i < widths[l] * widths[l + 1]; ++i)
                w[l][i] = sym(0.5);
            for (int i = 0; i < widths[l + 1]; ++i)
                b[l][i] = sym(0.1);
        }
        for (int k = 0; k < widths[0]; ++k)
            w[0][2 * widths[0] + k] = 0.0f; /* an all-zero channel: scale 1 */
        fm_error err = {0};
        fm_target t;
        fm_target_for_arch(prec == FM_PREC_INT8 ? 80 : 89, &t, &err);
        fm_plan plan;
        CHECK(fm_spec_set_quant(&spec, prec, (const float *const *)w, NULL, &err) == FM_OK, "set_quant: %s",
              err.message);
        CHECK(fm_plan_make(&spec, &t, NULL, prec, FM_F32, FM_F32, &plan, &err) == FM_ERR_VALUE &&
                  strstr(err.message, "needs an activation scale") != NULL,
              "an uncalibrated 8-bit plan is refused: %s", err.message);
        fm_error_clear(&err);
        const float bad[3] = {0.01f, 0.0f, 0.02f}, good[3] = {0.02f, 0.05f, 0.03f};
        CHECK(fm_spec_set_quant(&spec, prec, (const float *const *)w, bad, &err) == FM_ERR_VALUE &&
                  strstr(err.message, "act_scale[1]") != NULL, "a zero scale is named: %s", err.message);
        fm_error_clear(&err);
        CHECK(spec.w_scale[0][2] == 1.0f, "all-zero channel scale %g", (double)spec.w_scale[0][2]);
        CHECK(fm_spec_set_quant(&spec, prec, (const float *const *)w, good, &err) == FM_OK, "set_quant: %s",
              err.message);
        fm_status st = fm_plan_make(&spec, &t, NULL, prec, FM_F32, FM_F32, &plan, &err);
        CHECK(st == FM_OK && plan.elem_bytes == 1 && plan.k_pad[0] == 32 && plan.n_pad[0] == 64 &&
                  plan.n_pad[1] == 64 && plan.n_pad[2] == 32 && !plan.wgmma,
              "8-bit plan: %s k %d n %d %d %d", err.message, plan.k_pad[0], plan.n_pad[0], plan.n_pad[1],
              plan.n_pad[2]);
        fm_error_clear(&err);
        if (st == FM_OK) {
            uint8_t *wb = malloc(plan.w_elems);
            float *bb = malloc(sizeof(float) * plan.b_floats);
            fm_plan_pack(&plan, (const float *const *)w, (const float *const *)b, wb, bb);
            int bad_codes = 0, bad_dq = 0;
            for (int l = 0; l < 3; ++l) {
                CHECK(plan.dq_offset[l] == plan.b_offset[l] + (size_t)plan.n_pad[l], "layer %d dq offset", l);
                /* hidden relu and identity layers fold the next input's inverse scale into both (fm_plan.q_fold):
                 * layer 0 is relu (g_acts) */
                CHECK(l != 0 || plan.q_fold[0] == 2, "layer 0 (relu) q_fold %d", plan.q_fold[0]);
                const double fold = plan.q_fold[l] ? (double)(1.0f / good[l + 1]) : 1.0;
                for (int n = 0; n < plan.n_pad[l]; ++n) {
                    const float want =
                        n < widths[l + 1] ? (float)((double)good[l] * (double)spec.w_scale[l][n] * fold) : 0.0f;
                    bad_dq += bb[plan.dq_offset[l] + (size_t)n] != want;
                    if (n < widths[l + 1] && plan.has_bias[l])
                        bad_dq += bb[plan.b_offset[l] + (size_t)n] != (float)((double)b[l][n] * fold);
                    for (int k = 0; k < widths[l] && n < widths[l + 1]; ++k) {
                        const float v = (float)((double)w[l][n * widths[l] + k] / (double)spec.w_scale[l][n]);
                        bad_codes += wb[fm_plan_w_index(&plan, l, n, k)] != fm_quant8(v, prec);
                    }
                }
            }
            CHECK(bad_codes == 0 && bad_dq == 0, "%s pack: %d codes, %d dequantisation factors differ",
                  fm_prec_name(prec), bad_codes, bad_dq);
            free(wb);
            free(bb);
        }
        float x[3 * 7], y[3 * 5];
        double amax[4];
        for (int i = 0; i < 21; ++i)
            x[i] = sym(2.0);
        st = fm_ref_forward_ex(&spec, (const float *const *)w, (const float *const *)b, x, 3, 7, 1, y, 1, amax, &err);
        CHECK(st == FM_OK && amax[0] > 0 && isfinite(amax[3]), "quantised forward: %s", err.message);
        for (int i = 0; i < 15; ++i)
            CHECK(isfinite(y[i]), "y[%d] = %g", i, (double)y[i]);
        fm_error_clear(&err);
        for (int l = 0; l < 3; ++l) {
            free(w[l]);
            free(b[l]);
        }
        fm_spec_free(&spec);
    }
    CHECK(fm_dequant8(fm_quant8(1000.0f, FM_PREC_E4M3), FM_PREC_E4M3) == 448.0f, "e4m3 saturates");
    CHECK(fm_dequant8(fm_quant8(-1000.0f, FM_PREC_INT8), FM_PREC_INT8) == -127.0f, "int8 clamps to -127");
    CHECK(fm_dequant8(fm_quant8(2.5f, FM_PREC_INT8), FM_PREC_INT8) == 2.0f, "int8 rounds half to even");
}

int main(int argc, char **argv) {
    const char *root = argc > 1 ? argv[1] : ".";
    g_quick = argc > 2 && strcmp(argv[2], "--quick") == 0;
    test_targets();
    test_plan_networks();
    test_plan_choices();
    test_plan_graphs();
    test_pack();
    test_wgmma_plans();
    test_kpipe_plans();
    test_cluster_plans();
    test_render(root);
    test_ref();
    test_lowbit();
    printf("plans: %d made and checked; ref: %ld values, max relative error %.3g\n", g_plans_made, g_ref_values,
           g_ref_max_err);
    printf("%s: %d checks, %d failed\n", g_failures ? "FAILED" : "ok", g_checks, g_failures);
    return g_failures != 0;
}
