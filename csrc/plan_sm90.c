/* plan_sm90.c - the sm_90a warpgroup kernel's plans (fused_mlp_sm90.cu): the register-A form with resident weights,
 * the cluster form (activations in shared memory, columns split over a cluster's CTAs) and the streamed form (weights
 * through shared-memory slots; layers up to 512 wide). fm_plan_make (plan.c) chooses among them. */
#include "fm.h"
#include "plan_internal.h"

#include <stdio.h>
#include <string.h>

/* The K-pipelined step's registers beyond its fragments (fm_wgmma_layer_regs): addresses and the activation's
 * temporaries. What ptxas (NVRTC 13) takes varies with the activation: pinn50 (tanh, 56 wide) and flex (silu) fit
 * this; a gelu or sin layer 128 wide did not (at 255 registers gelu spilled). The estimate is the optimistic end:
 * _api builds the plan again without the pipeline where ptxas spilled (_api.spilled). */
enum { PIPE_REGS = 24 };

/* The value the register-A kernels keep in registers entering layer l for a later layer's residual (fm_network's ka):
 * the value v <= l - 1 (-1: x) that a layer j >= l with v <= j - 2 adds or multiplies (not its own input, which is
 * in registers anyway); -2 none, -3 two at once (SimBa's blocks h + f(h) over two or three layers keep one value at a
 * time; a DenseNet-like graph would keep several). */
static int fm_plan_kept_at(const fm_plan *p, int l) {
    int kept = -2;
    for (int j = l; j < p->num_layers; ++j) {
        const int v = p->res_src[j];
        if (p->res_op[j] == FM_RES_NONE || v > l - 1 || v > j - 2)
            continue;
        if (kept != -2 && kept != v)
            return -3;
        kept = v;
    }
    return kept;
}

/* Why the register-A kernels cannot take this network's residuals (NULL: they can): one from further back than the
 * layer's own input is kept in registers from its value on (16-bit only: an 8-bit value's codes are packed for the
 * layer after it), one such value at a time. */
static const char *fm_plan_residuals_unfit(const fm_plan *p) {
    for (int l = 0; l < p->num_layers; ++l) {
        if (p->res_op[l] == FM_RES_NONE || p->res_src[l] == l - 1)
            continue;
        if (fm_prec_is_8bit(p->prec))
            return "the register-A warpgroup kernels take an 8-bit network's residuals from a layer's own input only";
        if (fm_plan_kept_at(p, l) == -3)
            return "the register-A warpgroup kernels keep one earlier value for later layers' residuals at a time, "
                   "and this network's residuals read two at once";
    }
    return NULL;
}

/* Registers of the value kept across layer l (fm_plan_kept_at; x for value -1). */
static int fm_plan_kept_regs(const fm_plan *p, int l, int per_reg) {
    const int v = fm_plan_kept_at(p, l);
    return v == -1 ? p->k_pad[0] / per_reg : v >= 0 ? p->n_pad[v] / per_reg : 0;
}

/* Registers layer l of the sm_90a kernel needs per thread: 64 x n fp32 accumulators over 128 threads, the input
 * fragments (64 x k halves, or float8 codes in half as many registers: so float8 takes 256-wide hidden layers) and,
 * but for the last layer (which stages its output), the output fragments; plus 40 for addresses, bias and the
 * activation's temporaries. All n accumulators also where a forced n_chunk splits the layer into column groups: ptxas
 * runs one group's epilogue under the next group's MMAs, so they are live together. */
static int fm_wgmma_layer_regs(const fm_plan *p, int l) {
    /* The streamed form's groups are apart: a wait for each group's slot sits between one group's epilogue and the
     * next group's MMAs, which ptxas does not move MMAs across, so one group's accumulators are live at a time. */
    int acc = p->stream_slots ? p->n_chunk[l] / 2 : p->n_pad[l] / 2;
    /* 64 rows of k elements over 128 threads' 4-byte registers: k / per_reg */
    const int per_reg = 8 / p->elem_bytes;
    int out = l == p->num_layers - 1 || p->wide_out[l] ? 0 : p->n_pad[l] / per_reg; /* wide_out: to shared memory */
    int regs = acc + p->k_pad[l] / per_reg + out + 40;
    /* A streamed norm layer (one group, the whole row) without a residual: its input fragments are dead once its
     * MMAs are done, before its output fragments are written, so they take the same registers. */
    if (p->stream_slots && p->norm[l] != FM_NORM_NONE && p->res_op[l] == FM_RES_NONE)
        regs = acc + (p->k_pad[l] / per_reg > out ? p->k_pad[l] / per_reg : out) + 40;
    regs += fm_plan_kept_regs(p, l, per_reg); /* a value kept for a later layer's residual */
    for (int j = l + 1; j < p->num_layers; ++j) /* x's fragments, kept for a later layer's concat */
        if (p->cat[j] != FM_CAT_NONE) {
            regs += p->k_pad[0] / per_reg;
            break;
        }
    if (p->pipe[l]) { /* both layers' accumulators, and this layer's input fragments as they become its output's */
        int k_or_n = p->k_pad[l] > p->n_pad[l] ? p->k_pad[l] : p->n_pad[l];
        int piped = p->n_pad[l] / 2 + p->n_pad[l + 1] / 2 + k_or_n / 4 + PIPE_REGS;
        regs = piped > regs ? piped : regs;
    }
    return regs;
}

/* The same for the shared-memory-A (cluster) kernel: a layer's accumulators for this CTA's columns, layer 0's input
 * fragments (its A comes from registers, the ldmatrix of x), no output fragments (each 16 columns are stored as
 * they are packed); 48 for addresses, bias, the barriers' phase and the activation's temporaries; and 96 because
 * ptxas hoists the k steps' 64-bit A and B descriptors out of the tile loop and keeps them in registers: capped at
 * 168 registers (12 warps) clusters of 4 spilled 16-20 bytes, at 128 (16 warps) 204 bytes (NVRTC 13, 256-wide
 * layers, 64 columns per CTA). So a cluster CTA has at most two warpgroups. */
static int fm_cluster_layer_regs(const fm_plan *p, int l) {
    return p->n_chunk[l] / 2 + (l == 0 ? p->k_pad[0] / 4 : 0) + 48 + 96;
}

int fm_plan_wgmma_regs(const fm_plan *plan) {
    int regs = 0;
    for (int l = 0; l < plan->num_layers; ++l) {
        int r = plan->cluster ? fm_cluster_layer_regs(plan, l) : fm_wgmma_layer_regs(plan, l);
        regs = r > regs ? r : regs;
    }
    return regs > 255 ? 255 : regs;
}

/* Why the sm_90a warpgroup kernel cannot run this network (NULL: it can). It keeps activations in registers as wgmma
 * A fragments, so every value but a layer's own input is gone once the next layer ran: no input concat and residual
 * operands only from the layer's own input. Weights stay resident; fp16/bf16 (a tf32 accumulator does not map onto
 * the next layer's A fragment). */
/* What both forms of the warpgroup kernel need: sm_90a, 16-bit operands, one wgmma's N (256) per layer. */
static const char *fm_plan_warpgroup_unfit(const fm_plan *p, int widest, int most) {
    if (p->arch != 90)
        return "wgmma needs sm_90 (sm_90a)";
    if (p->prec == FM_PREC_TF32)
        return "the wgmma kernel takes float16 or bfloat16";
    if (widest > most)
        return most > FM_MAX_ONCHIP_WIDTH ? "the streamed wgmma kernel takes layers up to 512 wide"
                                          : "the wgmma kernel takes layers up to 256 wide with resident weights or "
                                            "clusters";
    return NULL;
}

const char *fm_plan_wgmma_unfit(const fm_plan *p, int widest) {
    const char *why = fm_plan_warpgroup_unfit(p, widest, FM_MAX_ONCHIP_WIDTH);
    if (why != NULL)
        return why;
    for (int l = 0; l < p->num_layers; ++l) {
        /* A layer's accumulators, input and output fragments must fit the 255 registers together: a 224- or
         * 256-wide hidden layer takes another form (a cluster, or streamed weights). Column groups with resident
         * weights do not help: ptxas overlaps one group's epilogue with the next group's MMAs, so all groups'
         * accumulators are live at once (108-372 bytes of spills for 224-256-wide layers in halves;
         * docs/performance.md); the streamed form's wait for each group's slot keeps them apart. */
        if (fm_wgmma_layer_regs(p, l) > 255)
            return "a hidden layer this wide would not fit the wgmma kernel's registers";
        if (p->cat[l] != FM_CAT_NONE)
            return "the wgmma kernel has no input concat";
    }
    return fm_plan_residuals_unfit(p);
}

size_t fm_plan_wgmma_stage_bytes(const fm_plan *p) {
    return p->out_dtype == FM_F32 ? 0 : 16 * (size_t)fm_stage_row_bytes(p);
}

/* A warp's wide buffer (fm_plan.wide_out): 16 rows of the widest output kept there; 0 where no layer's is. */
static size_t fm_plan_wide_bytes(const fm_plan *p) {
    int widest = 0;
    for (int l = 0; l < p->num_layers; ++l)
        widest = p->wide_out[l] && p->n_pad[l] > widest ? p->n_pad[l] : widest;
    return 16 * (size_t)widest * (size_t)p->elem_bytes;
}

size_t fm_plan_wgmma_raw_bytes(const fm_plan *p) {
    int verbatim = (p->in_dtype == FM_F16 && p->prec == FM_PREC_F16) ||
                   (p->in_dtype == FM_BF16 && p->prec == FM_PREC_BF16);
    if (verbatim && p->x_features == p->k_real[0] && (p->k_real[0] * p->elem_bytes) % 16 == 0)
        return 0;  /* (an encoded x lands raw: the loader computes the layers' columns from it) */
    return (size_t)fm_round_up(16 * p->x_features * (int)fm_dtype_size(p->in_dtype), 16);
}

/* The sm_90a kernel's column groups: n_chunk[l] is the width of each of layer l's groups but the last, which takes
 * the rest. Each layer is one group unless a forced n_chunk (rounded up to 16) splits the layers wider than it. */
void fm_plan_wgmma_chunks(fm_plan *p, int forced) {
    int nc = forced > 0 ? fm_round_up(forced, 16) : 0;
    for (int l = 0; l < p->num_layers; ++l)
        p->n_chunk[l] = nc > 0 && p->n_pad[l] > nc && !p->norm[l] ? nc : p->n_pad[l]; /* a norm: the whole row */
}

/* Why the shared-memory-A (cluster) warpgroup kernel cannot run this network (NULL: it can). Its layer outputs live in
 * one shared buffer per warpgroup, overwritten layer by layer, so like the register-A kernel it has no input concat
 * and takes residual operands only from a layer's own input (read from the columns the output then overwrites). */
static const char *fm_plan_cluster_unfit(const fm_plan *p, int widest) {
    const char *why = fm_plan_warpgroup_unfit(p, widest, FM_MAX_ONCHIP_WIDTH);
    if (why != NULL)
        return why;
    if (fm_prec_is_8bit(p->prec))
        return "the cluster kernel has no 8-bit form";
    if (p->num_layers < 2)
        return "the cluster kernel splits hidden layers, and a one-layer network has none";
    for (int l = 0; l < p->num_layers; ++l) {
        if (p->cat[l] != FM_CAT_NONE)
            return "the cluster kernel has no input concat";
        if (p->res_op[l] != FM_RES_NONE && p->res_src[l] != l - 1)
            return "the cluster kernel takes residuals from a layer's own input only";
    }
    return NULL;
}

/* Columns of a cluster plan's A buffer: the widest input of layers 1.. (layer 0's A is x, from registers). */
static int fm_plan_cluster_kmax(const fm_plan *p) {
    int kmax = 16;
    for (int l = 1; l < p->num_layers; ++l)
        kmax = p->k_pad[l] > kmax ? p->k_pad[l] : kmax;
    return kmax;
}

/* Whether layers l and l + 1 may compile to the same code (render.c's REPEAT compares their rendered bodies; this
 * compares what those are made of but for details such as a sine's argument bound: it may say yes where the bodies
 * differ, never the reverse). */
static int fm_plan_same_layer(const fm_plan *p, const fm_spec *spec, int l) {
    if (p->k_pad[l] != p->k_pad[l + 1] || p->n_pad[l] != p->n_pad[l + 1] || p->k_real[l] != p->k_real[l + 1] ||
        p->n_real[l] != p->n_real[l + 1] || p->has_bias[l] != p->has_bias[l + 1] || p->res_op[l] != p->res_op[l + 1] ||
        p->norm[l] != p->norm[l + 1])
        return 0;
    fm_str a = {0}, b = {0};
    fm_spec_act_string(spec, l, &a);
    fm_spec_act_string(spec, l + 1, &b);
    int same = a.data != NULL && b.data != NULL && strcmp(a.data, b.data) == 0;
    fm_str_free(&a);
    fm_str_free(&b);
    return same;
}

/* Whether the register-A warpgroup kernel may run a stretch of this network's layers as a loop (fused_mlp_sm90.cu,
 * fm_loop_len: layers with the same code, not the last, >= 384 columns together). */
static int fm_plan_loops(const fm_plan *p, const fm_spec *spec) {
    for (int l = 0; l + 1 < p->num_layers; ++l) {
        int r = 1;
        while (l + r < p->num_layers - 1 && fm_plan_same_layer(p, spec, l + r - 1))
            ++r;
        if (r > 1 && r * p->n_pad[l] >= 384)
            return 1;
    }
    return 0;
}

/* fm_plan.pipe: on (and possible) or off, for a register-A warpgroup plan (its n_chunk set). Possible: an unsplit
 * network without residuals (a residual keeps the layer's input fragments live beside both layers' accumulators:
 * res128 then ran its MMAs one at a time, ptxas C7511 "insufficient register resources", 1.26x slower at 1024 rows)
 * nor a stretch of layers the kernel loops over (C7511 again: the pipelined MMAs' accumulators carried round a loop),
 * for each layer but the last whose activation has no one-cvt pair form (relu's and the identity's epilogue is a
 * few instructions: nothing to hide, and the per-step fences cost tcnn128 6% at 2^21 rows, H100). */
void fm_plan_pipe(fm_plan *p, const fm_spec *spec, int on) {
    int able = on && !fm_plan_loops(p, spec) && !fm_prec_is_8bit(p->prec); /* 8-bit: not written */
    for (int l = 0; l < p->num_layers; ++l)
        able = able && p->res_op[l] == FM_RES_NONE && p->n_chunk[l] == p->n_pad[l];
    p->kpipe = 0;
    for (int l = 0; l < p->num_layers; ++l) {
        p->pipe[l] = able && l + 1 < p->num_layers && fm_expr_pair_fn(spec->act[l]) == NULL;
        p->kpipe |= p->pipe[l];
    }
}

/* Per warpgroup of a cluster plan with norms: two rounds' slots of the CTAs' partial row statistics (64 rows of two
 * floats each) and their two mbarriers (fused_mlp_sm90.cu, fm_cl_norm and NSTAT_B). */
static size_t fm_plan_cluster_norm_bytes(const fm_plan *p) {
    int any = 0;
    for (int l = 0; l < p->num_layers; ++l)
        any |= p->norm[l] != FM_NORM_NONE;
    return p->cluster > 1 && any ? 2 * (size_t)p->cluster * 64 * 8 + 16 : 0;
}

/* The sm_90a layout: warps/4 warpgroups per CTA, each owning 64 rows (one 16-row strip per warp, with its own input
 * buffer, output stage and raw x buffer), all weights resident in the core-matrix layout, each layer in the column
 * groups of fm_plan_wgmma_chunks (set before). Returns the shared-memory bytes. */
size_t fm_plan_wgmma_layout(fm_plan *p, const fm_target *t, int warps, const int *value_pad) {
    p->warps = warps;
    p->m_tiles = 1;
    p->rows_per_cta = warps * 16;
    p->resident = p->stream_slots == 0;
    if (p->resident)
        p->w_slot_elems = 0;
    p->buffers = 1;
    for (int l = 0; l < p->num_layers; ++l) {
        p->a0_buf[l] = 0;
        p->a1_buf[l] = -1;
        p->out_buf[l] = 0;
        p->res_buf[l] = p->res_op[l] != FM_RES_NONE ? 0 : -1;
    }
    /* Per warp: an input buffer (x as act_t rows, ACT_STRIDE wide, the next tile's arriving by cp.async while this
     * one computes), an output stage of its own width for 16-bit y (float32 y is stored from the registers: sized as
     * the input buffer, its stage fitted tcnn128 with float32 x and y one warpgroup per CTA), and a raw landing
     * buffer for x unless x's rows are copied in verbatim. */
    int in_only = value_pad[0];
    p->act_stride = fm_act_stride(p, &in_only, 1, 0);
    size_t stage = fm_plan_wgmma_stage_bytes(p), wide = fm_plan_wide_bytes(p); /* one buffer serves both */
    size_t in = 16 * (size_t)p->act_stride * (size_t)p->elem_bytes, share = stage > wide ? stage : wide;
    size_t warp_bytes = (p->in_shared ? (in > share ? in : share) : in + share) + fm_plan_wgmma_raw_bytes(p);
    size_t w_bytes = (size_t)p->elem_bytes * (p->cluster ? p->w_rank_elems
                                              : p->stream_slots ? (size_t)p->stream_slots * p->w_slot_elems
                                              : p->w_elems);
    p->smem_bytes = w_bytes + 4 * p->b_floats + (size_t)warps * warp_bytes;
    if (p->stream_slots) /* per slot: its `full` mbarrier and its counter, in whole 16 bytes */
        p->smem_bytes += (size_t)(12 * p->stream_slots + 15) / 16 * 16;
    if (p->cluster) /* per warpgroup: its 64 rows of the widest layer input (A buffer), and two mbarriers */
        p->smem_bytes += (size_t)(warps / 4) * ((size_t)fm_plan_cluster_kmax(p) * 64 * (size_t)p->elem_bytes + 16 +
                                                fm_plan_cluster_norm_bytes(p));
    size_t per_sm = t->smem_per_sm ? t->smem_per_sm : t->smem_per_block;
    int by_smem = (int)(per_sm / (p->smem_bytes + 1024));
    int by_regs = 65536 / (fm_plan_wgmma_regs(p) * 32 * warps);
    int blocks = by_smem < by_regs ? by_smem : by_regs;
    if (blocks > 64 / warps) /* the SM's 64 warps */
        blocks = 64 / warps;
    p->blocks_per_sm = blocks < 1 ? 1 : blocks;
    return p->smem_bytes;
}

/* A cluster plan of `cluster` CTAs (1, 2 or 4) in *p, from a plan with the real widths filled: hidden widths padded
 * to 16 * cluster, each CTA's share of the columns, and the most warpgroups (up to 4, or opts->warps) that the
 * register estimate and shared memory allow. FM_ERR_LIMIT (naming the rule) when none fits. */
fm_status fm_plan_cluster(fm_plan *p, const fm_target *t, const fm_plan_opts *opts, int cluster, int widest,
                          const int *value_pad, fm_error *err) {
    const char *unfit = fm_plan_cluster_unfit(p, widest);
    if (unfit != NULL)
        return fm_fail(err, FM_ERR_LIMIT, "cluster=%d was asked for, but %s", cluster, unfit);
    if (cluster != 1 && cluster != 2 && cluster != 4)
        return fm_fail(err, FM_ERR_VALUE, "cluster=%d: a cluster is 1, 2 or 4 CTAs", cluster);
    const int L = p->num_layers;
    p->wgmma = 1;
    p->cluster = cluster;
    /* The last layer is split over the cluster like the hidden ones where it is wider than one 16-column group: whole
     * in CTA 0 it left the others idle for its MMAs (64-256-256-192 on clusters of 4 ran 1.9x mma.sync's time, H100)
     * and made CTA 0 hold all its weights and a stage of its width (2-256-256-256 with 16-bit y fitted no cluster). A
     * narrow one (siren256's 3 columns) stays in CTA 0: split, it would pad to 16 columns per CTA and send the last
     * exchange to every CTA for nothing. */
    const int split_last = cluster > 1 && p->n_real[L - 1] > 16;
    for (int l = 0; l < L; ++l) {
        const int split = l < L - 1 || split_last;
        if (split)
            p->n_pad[l] = fm_round_up(p->n_real[l], 16 * cluster);
        if (l > 0)
            p->k_pad[l] = p->k0_pad[l] = p->n_pad[l - 1];
        p->n_chunk[l] = split ? p->n_pad[l] / cluster : p->n_pad[l];
    }
    fm_plan_blobs(p);
    /* Over 255 (224 or more columns per CTA): with a sin activation, whose epilogue stores the columns a second time
     * through calls to sinf where an argument was far, 224 columns spilled 224 bytes (ptxas keeps the accumulators
     * around the calls); 112 and 128 columns did not. */
    for (int l = 0; l < (split_last ? L : L - 1); ++l)
        if (fm_cluster_layer_regs(p, l) > 255)
            return fm_fail(err, FM_ERR_LIMIT, "cluster=%d: layer %d's %d columns per CTA would not fit the registers",
                           cluster, l, p->n_chunk[l]);
    for (int warps = opts->warps ? opts->warps : 16; warps >= 4; warps -= 4) {
        size_t bytes = fm_plan_wgmma_layout(p, t, warps, value_pad);
        int regs_ok = 65536 / (warps * 32) >= fm_plan_wgmma_regs(p);
        if (bytes <= t->smem_per_block && regs_ok)
            return FM_OK;
        if (opts->warps)
            break;
    }
    if (opts->warps)
        return fm_fail(err, FM_ERR_LIMIT, "cluster=%d with warps=%d does not fit: its buffers and %zu weight bytes per "
                       "CTA exceed the %zu bytes of shared memory a block may use on sm_%d, or its threads the "
                       "registers", cluster, opts->warps, p->w_rank_elems * (size_t)p->elem_bytes, t->smem_per_block,
                       t->arch);
    return fm_fail(err, FM_ERR_LIMIT, "cluster=%d does not fit: %zu weight bytes per CTA and one warpgroup's buffers "
                   "exceed the %zu bytes of shared memory a block may use on sm_%d", cluster,
                   p->w_rank_elems * (size_t)p->elem_bytes, t->smem_per_block, t->arch);
}

/* The auto choice among cluster plans, the first of these that fits: two warpgroups per CTA (one leaves the tensor
 * pipe idle during its epilogue) on clusters of 1 or 2; one on clusters of 2; two on clusters of 4; then any.
 * Clusters of 4 come after one warpgroup on clusters of 2 because the H100 runs only 30 of them at once (120 of its
 * 132 SMs, cuOccupancyMaxActiveClusters) and each CTA sends to three others: 64-256-256-192 and 2-256-256-256 ran
 * 12-14% faster at 2^18 and 2^21 rows on clusters of 2 with one warpgroup (bench/results/h100/plan_probe_s15.txt).
 * Entries [from, to) of that order; returns 1 with the plan in *p, else 0 (*p unchanged). (fm_plan_make puts the
 * streamed register-A form between the first two entries and the rest.) */
int fm_plan_cluster_auto(fm_plan *p, const fm_target *t, const fm_plan_opts *opts, int widest,
                         const int *value_pad, int from, int to) {
    static const int order[][2] = {{1, 8}, {2, 8}, {2, 4}, {4, 8}, {1, 4}, {4, 4}}; /* CTAs, fewest warps */
    for (int i = from; i < to && i < 6; ++i) {
        fm_plan cand = *p;
        fm_error quiet = {0};
        fm_status st = fm_plan_cluster(&cand, t, opts, order[i][0], widest, value_pad, &quiet);
        fm_error_clear(&quiet);
        /* A forced warp count takes any entry but the first two, which are for two warpgroups only (so warps=4 on a
         * network the streamed form takes gets that form: r256 and deep256 ran it 1.7-4.3x faster than one
         * warpgroup on clusters of 2 or 4 at 16384 rows, H100). */
        if (st == FM_OK && (cand.warps >= order[i][1] || (opts->warps && i >= 2))) {
            *p = cand;
            return 1;
        }
    }
    return 0;
}

/* Why the streamed form of the register-A warpgroup kernel cannot run this network (NULL: it can): residuals as the
 * register-A kernel takes them (fm_plan_residuals_unfit; none on a concat layer). An input concat (NeRF's skip) takes
 * x's A fragments, which the kernel keeps in registers from layer 0 on. A norm layer is one group (its statistics need
 * the whole row), its weights read from several slots. */
static const char *fm_plan_stream_unfit(const fm_plan *p, int widest) {
    const char *why = fm_plan_warpgroup_unfit(p, widest, FM_MAX_FUSED_WIDTH);
    if (why != NULL)
        return why;
    /* 8-bit: each layer one column group whose codes are packed whole (fm_epi_codes), its weights read from several
     * slots as a norm layer's; no wide buffer of codes (a layer over 256 wide: GEMMs, _segments.py) */
    if (fm_prec_is_8bit(p->prec) && fm_plan_has_wide_value(p))
        return "the streamed warpgroup kernel's 8-bit form takes layers up to 256 wide";
    for (int l = 0; l < p->num_layers; ++l) {
        if (p->norm[l] != FM_NORM_NONE && p->n_pad[l] > FM_MAX_ONCHIP_WIDTH)
            return "a norm layer's row (its statistics need all its accumulators at once) holds at most 256 features "
                   "in the streamed warpgroup kernel";
        if (p->cat[l] != FM_CAT_NONE && p->res_op[l] != FM_RES_NONE)
            return "the streamed warpgroup kernel takes no residual on a layer with an input concat";
    }
    return fm_plan_residuals_unfit(p);
}

/* Default group width and the most slots. On the H100 (2^21 rows, fp16) groups of 128 columns ran r256 (64-256-256-
 * 256-16, silu) in 1.05 ms and deep256 (64-256x5-64, relu) in 1.55 against 1.23 and 1.63 with 64 and 1.55 and 2.27
 * with 32 (bench/results/h100-stream/). */
enum { STREAM_NC = 128, STREAM_MAX_SLOTS = 8 };
/* The most estimated registers for STREAM_NC-wide groups: ptxas (NVRTC 13) used 198 and 252 registers for r256's and
 * deep256's estimated 232, and for NeRF's 248 (x's fragments kept for its concat) 254 with 48 bytes of spills and
 * serialized wgmma; its 64-wide groups took 218. */
enum { STREAM_WIDE_REGS = 240 };
/* The largest K piece of a network with a layer wider than 256 (fm_plan.k_chunk): a 128-column group of a 512-wide
 * input is 128 KB whole; in 32 KB pieces two slots fit beside the warps' 16 KB wide buffers. On the H100 (2^21 rows)
 * wide512 ran 8.66 ms so against 9.99 in four slots of 16 KB (bench/results/h100-wide-stream/); 16 KB pieces are the
 * fallback where 32 KB ones do not fit (a float32 x's landing buffers). */
enum { STREAM_PIECE_B = 32768 };
/* Whether a value of the network (x, a layer's output) is wider than 256: its wide layers then keep their outputs in
 * shared memory and take their weights in K pieces (fm_plan.wide_out, k_chunk). A concat of narrower values stays in
 * registers, as before the wide form. */
int fm_plan_has_wide_value(const fm_plan *p) {
    int wide = p->k0_pad[0] > FM_MAX_ONCHIP_WIDTH;
    for (int l = 0; l < p->num_layers; ++l)
        wide |= p->n_pad[l] > FM_MAX_ONCHIP_WIDTH;
    return wide;
}

/* The register-A warpgroup kernel with streamed weights (fused_mlp_sm90.cu, FM_STREAM): every layer in column groups
 * of n_chunk (opts->n_chunk, else STREAM_NC) columns whose weights pass through slots of shared memory, each slot
 * one group (the largest group's bytes), as many slots as fit beside the per-warp buffers (up to
 * STREAM_MAX_SLOTS), and two warpgroups per CTA (opts->warps may say otherwise). */
/* fm_plan_stream's plan at a given warp count (the layout, groups and slots; the rest of *p set). */
static fm_status fm_plan_stream_at(fm_plan *p, const fm_target *t, const fm_plan_opts *opts, int warps,
                                   size_t piece, const int *value_pad, fm_error *err) {
    /* The widest groups whose registers and two slots fit (STREAM_NC, else half of it): wider groups mean fewer,
     * longer MMA runs and fewer waits per layer. */
    size_t slot = 0;
    /* Layers wider than 256 in or out keep their output in the warp's wide buffer, not in registers, and their
     * groups' weights arrive in K pieces (fm_plan.wide_out, k_chunk). */
    const int wide = fm_plan_has_wide_value(p);
    for (int l = 0; l < p->num_layers; ++l)
        p->wide_out[l] = wide && l + 1 < p->num_layers && (p->k_pad[l] > FM_MAX_ONCHIP_WIDTH ||
                                                           p->n_pad[l] > FM_MAX_ONCHIP_WIDTH);
    for (int nc = opts->n_chunk > 0 ? fm_round_up(opts->n_chunk, 16) : STREAM_NC;; nc /= 2) {
        slot = 0;
        for (int l = 0; l < p->num_layers; ++l) { /* a norm or 8-bit layer: one group, from slots of nc columns */
            int chunk = p->n_pad[l] < nc ? p->n_pad[l] : nc, kc = p->k_pad[l];
            p->n_chunk[l] = p->norm[l] != FM_NORM_NONE || fm_prec_is_8bit(p->prec) ? p->n_pad[l] : chunk;
            if (p->norm[l] == FM_NORM_NONE && (opts->k_chunk > 0 || wide)) { /* a norm layer's pieces: whole rows */
                int fit = opts->k_chunk > 0 ? fm_round_up(opts->k_chunk, 16)
                                            : (int)piece / (chunk * p->elem_bytes) / 16 * 16;
                kc = fit < kc ? fit : kc;
            }
            p->k_chunk[l] = kc;
            size_t bytes = (size_t)chunk * (size_t)kc * (size_t)p->elem_bytes;
            slot = bytes > slot ? bytes : slot;
        }
        p->stream_slots = 2;
        p->w_slot_elems = slot / (size_t)p->elem_bytes;
        fm_plan_wgmma_layout(p, t, warps, value_pad);
        int regs = fm_plan_wgmma_regs(p);
        if (opts->n_chunk > 0 || nc < STREAM_NC ||
            (65536 / (warps * 32) >= regs && regs <= STREAM_WIDE_REGS && p->smem_bytes <= t->smem_per_block))
            break;
    }
    if (p->smem_bytes > t->smem_per_block)
        return fm_fail(err, FM_ERR_LIMIT, "the streamed warpgroup kernel's two weight slots of %zu bytes and %d warps' "
                       "buffers take %zu bytes of shared memory; a block may use %zu on sm_%d", slot, warps,
                       p->smem_bytes, t->smem_per_block, t->arch);
    int regs = fm_plan_wgmma_regs(p), worst = 0; /* (capped at 255; the layers' own estimates are not) */
    for (int l = 1; l < p->num_layers; ++l)
        worst = fm_wgmma_layer_regs(p, l) > fm_wgmma_layer_regs(p, worst) ? l : worst;
    if (wide && fm_wgmma_layer_regs(p, worst) > 255) { /* a wide concat: x's fragments kept beside a wide input
                                                          * (narrower networks: the estimate's 255 cap, as before) */
        int cat = -1;
        for (int j = worst; j < p->num_layers && cat < 0; ++j)
            cat = p->cat[j] != FM_CAT_NONE ? j : -1;
        char kept[160] = "";
        if (cat > worst)
            snprintf(kept, sizeof kept, ", x's fragments (%d features) kept for layer %d's input concat", p->k0_real[0],
                     cat);
        else if (cat == worst)
            snprintf(kept, sizeof kept, " (x's %d features among them, its input concat)", p->k0_real[0]);
        return fm_fail(err, FM_ERR_LIMIT, "layer %d needs about %d registers per thread in the streamed warpgroup "
                       "kernel, over the 255 a thread has: its input fragments (%d features)%s and a column group's "
                       "accumulators", worst, fm_wgmma_layer_regs(p, worst), p->k_real[worst], kept);
    }
    /* A value kept for a later residual: past the estimate's 255, ptxas spilled 48-368 bytes in random 256-wide
     * chains (NVRTC 13); the mma.sync kernel, which keeps values in shared memory, takes such a network instead. */
    for (int l = 0; l < p->num_layers; ++l) {
        const int kept = fm_plan_kept_at(p, l);
        if (kept != -2 && fm_wgmma_layer_regs(p, l) > 255)
            return fm_fail(err, FM_ERR_LIMIT, "layer %d needs about %d registers per thread in the streamed warpgroup "
                           "kernel, over the 255 a thread has, with %s (%d features) kept in registers for a later "
                           "layer's residual", l, fm_wgmma_layer_regs(p, l), kept < 0 ? "x" : "a layer's output",
                           kept < 0 ? p->k_real[0] : p->n_real[kept]);
    }
    if (65536 / (warps * 32) < regs) {
        fm_fail(err, FM_ERR_LIMIT, "warps=%d leaves %d registers per thread; the streamed warpgroup kernel of this "
                "network needs about %d", warps, 65536 / (warps * 32), regs);
        fm_error_hint(err, "use fewer warps (4 per warpgroup), or a smaller n_chunk");
        return FM_ERR_LIMIT;
    }
    while (p->stream_slots < STREAM_MAX_SLOTS) { /* as many slots as fit */
        p->stream_slots++;
        fm_plan_wgmma_layout(p, t, warps, value_pad);
        if (p->smem_bytes > t->smem_per_block) {
            p->stream_slots--;
            fm_plan_wgmma_layout(p, t, warps, value_pad);
            break;
        }
    }
    return FM_OK;
}

fm_status fm_plan_stream(fm_plan *p, const fm_target *t, const fm_plan_opts *opts, int widest,
                         const int *value_pad, fm_error *err) {
    const char *unfit = fm_plan_stream_unfit(p, widest);
    if (unfit != NULL)
        return fm_fail(err, FM_ERR_LIMIT, "wgmma=1 with resident=0 asks for the streamed warpgroup kernel, but %s",
                       unfit);
    if (opts->kpipe > 0)
        return fm_fail(err, FM_ERR_LIMIT, "kpipe=1 was asked for, but the streamed warpgroup kernel does not "
                       "pipeline its layers");
    if (opts->warps % 4 != 0)
        return fm_fail(err, FM_ERR_VALUE, "warps=%d: the warpgroup kernel runs whole warpgroups (4 warps)",
                       opts->warps);
    p->wgmma = 1;
    p->cluster = 0;
    p->split = opts->split > 1 ? opts->split : 0; /* (fm_plan_make checks that the plan can be split) */
    fm_plan_blobs(p);
    p->kpipe = 0;
    memset(p->pipe, 0, sizeof p->pipe);
    /* Two warpgroups, else one (an SM then has one warpgroup: its epilogues leave the tensor pipe idle, so it is the
     * fallback for buffers too large for two, such as a wide float32 x's landing buffers); a wide network's K pieces
     * of STREAM_PIECE_B, else half that, then its input buffers in its wide buffers' bytes (fm_plan.in_shared), before
     * fewer warps (one warpgroup: wide512 1.57x the time of two on the H100, 9.80 against 6.23 ms at 2^21 rows;
     * smaller pieces add a slot wait per 8 k steps, unmeasured; a shared input buffer leaves each tile's x load
     * unhidden). A split plan's CTAs write each other's wide buffers: its input buffers keep their own bytes. */
    /* warps, piece in STREAM_PIECE_B / 2, in_shared */
    static const int shapes[][3] = {{8, 2, 0}, {8, 1, 0}, {8, 2, 1}, {8, 1, 1}, {4, 2, 0}, {4, 1, 0}};
    if (opts->in_shared > 0 && (p->split || !fm_plan_has_wide_value(p)))
        return fm_fail(err, FM_ERR_LIMIT, "in_shared=1 was asked for, but %s",
                       p->split ? "a split plan's CTAs write each other's wide buffers, so its input buffers keep "
                                  "their own bytes"
                                : "this network has no layer wider than 256, so its warps have no wide buffer to share");
    fm_plan first = *p;
    fm_status st = FM_ERR_LIMIT;
    for (int i = 0; i < 6; ++i) {
        int warps = shapes[i][0];
        size_t piece = (size_t)shapes[i][1] * (STREAM_PIECE_B / 2);
        if ((opts->warps && opts->warps != warps) ||
            (shapes[i][1] == 1 && (opts->k_chunk > 0 || !fm_plan_has_wide_value(p))) || /* no pieces: no smaller */
            (shapes[i][2] && (p->split || !fm_plan_has_wide_value(p) || opts->in_shared != 0)))
            continue; /* (in_shared=1: every shape shares) */
        fm_plan cand = first;
        cand.in_shared = shapes[i][2] || opts->in_shared > 0;
        fm_error quiet = {0};
        st = fm_plan_stream_at(&cand, t, opts, warps, piece, value_pad, &quiet);
        if (st == FM_OK) {
            fm_error_clear(&quiet);
            if (err != NULL) /* an earlier shape's reason is no error now (a later check's message would keep it) */
                fm_error_clear(err);
            *p = cand;
            return FM_OK;
        }
        if (err != NULL) { /* the last shape's reason */
            fm_error_clear(err);
            *err = quiet;
        } else {
            fm_error_clear(&quiet);
        }
    }
    if (opts->warps && opts->warps != 4 && opts->warps != 8) { /* another forced warp count: its own reason */
        p->in_shared = opts->in_shared > 0;
        return fm_plan_stream_at(p, t, opts, opts->warps, STREAM_PIECE_B, value_pad, err);
    }
    return st;
}

