/* plan.c - pad widths for the Tensor Cores, choose the kernel (the sm_90a warpgroup forms: plan_sm90.c), the mma.sync
 * tile shape and weight residency, budget shared memory, pack the blobs. */
#include "fm.h"
#include "plan_internal.h"

#include <stdio.h>
#include <string.h>

/* Published per-architecture shared-memory limits (CUDA C Programming Guide, "Technical Specifications per Compute
 * Capability"), for compiling ahead of time without the GPU at hand. A live device's own figures replace these. */
static const struct {
    int arch;
    size_t smem_per_block; /* opt-in maximum per block */
    size_t smem_per_sm;
} fm_arch_table[] = {
    {75, 64 * 1024, 64 * 1024},   {80, 163 * 1024, 164 * 1024}, {86, 99 * 1024, 100 * 1024},
    {87, 163 * 1024, 164 * 1024}, {89, 99 * 1024, 100 * 1024},  {90, 227 * 1024, 228 * 1024},
    {100, 227 * 1024, 228 * 1024}, {103, 227 * 1024, 228 * 1024}, {120, 99 * 1024, 100 * 1024},
};

fm_status fm_target_for_arch(int arch, fm_target *t, fm_error *err) {
    memset(t, 0, sizeof *t);
    for (size_t i = 0; i < sizeof fm_arch_table / sizeof fm_arch_table[0]; ++i) {
        if (fm_arch_table[i].arch == arch) {
            t->arch = arch;
            t->smem_per_block = fm_arch_table[i].smem_per_block;
            t->smem_per_sm = fm_arch_table[i].smem_per_sm;
            return FM_OK;
        }
    }
    fm_fail(err, FM_ERR_VALUE, "arch sm_%d is not supported; the fused kernel needs Tensor Core mma and ldmatrix "
                               "(sm_75 or newer): sm_75, sm_80, sm_86, sm_87, sm_89, sm_90, sm_100, sm_103, sm_120",
            arch);
    return FM_ERR_VALUE;
}

int fm_round_up(int v, int m) { return (v + m - 1) / m * m; }

/* Bytes per row of the last layer's staged output: out_t, plus a 16-byte pad (STAGE_STRIDE in the mma.sync
 * template, STAGE_W in the warpgroup one). A cluster plan's CTA stages only the columns it computes (n_chunk: all of them in
 * CTA 0, or its share where the last layer is split). The width is a multiple of 16 elements, so this is an odd
 * number of 16-byte units. */
int fm_stage_row_bytes(const fm_plan *p) {
    const int l = p->num_layers - 1;
    return (p->cluster ? p->n_chunk[l] : p->n_pad[l]) * (int)fm_dtype_size(p->out_dtype) + 16;
}

/* Elements per row of an activation buffer: wide enough for every value and, where the last layer stages its output
 * in one (the mma.sync kernel: `stage`), that output, and an odd number of 16-byte units so the 8 rows an ldmatrix
 * reads hit 8 different bank groups. */
int fm_act_stride(const fm_plan *p, const int *value_pad, int num_values, int stage) {
    int need = 0; /* bytes */
    for (int v = 0; v < num_values; ++v)
        if (value_pad[v] * p->elem_bytes + 16 > need)
            need = value_pad[v] * p->elem_bytes + 16;
    if (stage && fm_stage_row_bytes(p) > need)
        need = fm_stage_row_bytes(p);
    need = fm_round_up(need, 16);
    if ((need / 16) % 2 == 0)
        need += 16;
    return need / p->elem_bytes;
}

int fm_plan_w_stride(const fm_plan *plan, int l) { return plan->k_pad[l] + 16 / plan->elem_bytes; }

int fm_plan_k_chunk(const fm_plan *plan, int l) {
    return plan->stream_slots && plan->k_chunk[l] > 0 ? plan->k_chunk[l] : plan->k_pad[l];
}

size_t fm_plan_w_index(const fm_plan *plan, int l, int n, int k) {
    if (plan->gemm && plan->gemm_cluster < 2 && !plan->gemm_ws)
        return (size_t)n * (size_t)plan->k_pad[l] + (size_t)k;
    if (plan->gemm) { /* block (column tile, K stage), BN rows of 128 bytes, 16-byte chunk c of row r at c ^ (r % 8) */
        const int kt = 128 / plan->elem_bytes, per16 = 16 / plan->elem_bytes, bn = plan->gemm_bn;
        const int r = n % bn, kk = k % kt;
        const size_t block = (size_t)(n / bn) * (size_t)(plan->k_pad[l] / kt) + (size_t)(k / kt);
        return (block * (size_t)bn + (size_t)r) * (size_t)kt + (size_t)(((kk / per16) ^ (r & 7)) * per16 + kk % per16);
    }
    if (!plan->wgmma)
        return plan->w_offset[l] + (size_t)n * (size_t)fm_plan_w_stride(plan, l) + (size_t)k;
    /* packed codes (k_perm): the previous layer's part of the input; x's part of a concat is in column order */
    const int x_part = plan->cat[l] == FM_CAT_BEFORE ? k < plan->k0_pad[l]
                     : plan->cat[l] == FM_CAT_AFTER   ? k >= plan->k0_pad[l]
                                                      : 0;
    if (plan->k_perm[l] && !x_part)
        k = fm_plan_k_perm(k);
    const int per16 = 16 / plan->elem_bytes; /* elements per 16-byte core-matrix row */
    if (fm_plan_k_chunk(plan, l) < plan->k_pad[l]) {
        /* K pieces (fm_plan.k_chunk): column group n / n_chunk at its first row's place, its pieces one after
         * another, piece k / k_chunk a core-matrix block of the group's width and the piece's */
        const int nc = plan->n_chunk[l], kc = plan->k_chunk[l], c0 = n / nc * nc, p0 = k / kc * kc;
        const int w = plan->n_pad[l] - c0 < nc ? plan->n_pad[l] - c0 : nc;
        const int kw = plan->k_pad[l] - p0 < kc ? plan->k_pad[l] - p0 : kc;
        const size_t base = plan->w_offset[l] + (size_t)c0 * (size_t)plan->k_pad[l] + (size_t)w * (size_t)p0;
        n -= c0;
        k -= p0;
        const size_t core = (size_t)(n / 8) * (size_t)(kw / per16) + (size_t)(k / per16);
        return base + core * (size_t)(8 * per16) + (size_t)(n % 8) * (size_t)per16 + (size_t)(k % per16);
    }
    const size_t chunks = (size_t)(plan->k_pad[l] / per16);
    size_t base = plan->w_offset[l];
    if (plan->cluster) { /* CTA n / n_chunk's share of the layer's rows (a last layer not split: all in CTA 0's) */
        base += (size_t)(n / plan->n_chunk[l]) * plan->w_rank_elems;
        n %= plan->n_chunk[l];
    }
    const size_t core = (size_t)(n / 8) * chunks + (size_t)(k / per16);
    return base + core * (size_t)(8 * per16) + (size_t)(n % 8) * (size_t)per16 + (size_t)(k % per16);
}

int fm_plan_k_perm(int k) {
    const int j = (k >> 3) & 3, t = (k >> 1) & 3, e = k & 1;
    return (k & ~31) | (j >> 1) << 4 | t << 2 | (j & 1) << 1 | e;
}

int fm_plan_result_type(const fm_plan *plan, int l) {
    if (l == plan->num_layers - 1 && plan->out_dtype != FM_CODES) /* (codes: an 8-bit GEMM's hidden layer) */
        return (int)plan->out_dtype;
    /* 8-bit hidden layers: float16's forms. Their ~2^-11 error is far under an e4m3 step (2^-4 of the value) and at
     * most 1/16 of an int8 step (1/127 of the layer's range, at its top): it moves a value near a rounding boundary
     * to the neighbouring code where the CPU emulation (exact activations) does not, and no nearer to float64. */
    if (fm_prec_is_8bit(plan->prec))
        return (int)FM_PREC_F16 + 1;
    return plan->prec == FM_PREC_TF32 ? 0 : (int)plan->prec + 1;
}

/* Assigns the per-warp activation buffers (a register allocation over the values x, layer 0's output, ...): x
 * arrives in buffer 0; layer l writes in place over its input h when it is one chunk (a later chunk would still
 * read what an earlier one overwrote) and nothing after it reads h; otherwise into the lowest buffer whose value is
 * dead. The last layer stages its output in another layout, so it never writes in place over its own residual
 * operand. Returns the number of buffers. */
static int fm_plan_buffers(fm_plan *p) {
    const int L = p->num_layers;
    int last_use[FM_MAX_LAYERS + 1], buf_of[FM_MAX_LAYERS + 1], holder[FM_MAX_LAYERS + 1], nbuf = 1;
    for (int v = 0; v <= L; ++v)
        last_use[v] = v; /* value v - 1 is read by layer v (the output of the last layer by the store, "layer L") */
    for (int l = 0; l < L; ++l) {
        if (p->res_op[l] != FM_RES_NONE && last_use[p->res_src[l] + 1] < l)
            last_use[p->res_src[l] + 1] = l;
        if (p->cat[l] != FM_CAT_NONE)
            last_use[0] = l;
    }
    holder[0] = -1;
    buf_of[0] = 0;
    for (int l = 0; l < L; ++l) {
        const int in = buf_of[l], x = buf_of[0];
        p->a0_buf[l] = p->cat[l] == FM_CAT_BEFORE ? x : in;
        p->a1_buf[l] = p->cat[l] == FM_CAT_NONE ? -1 : (p->cat[l] == FM_CAT_AFTER ? x : in);
        p->res_buf[l] = p->res_op[l] != FM_RES_NONE ? buf_of[p->res_src[l] + 1] : -1;
        int one_chunk = p->n_chunk[l] >= p->n_pad[l];
        int staged_over_res = l == L - 1 && p->res_buf[l] == in;
        int out = -1;
        if (one_chunk && last_use[l] == l && !staged_over_res)
            out = in;
        for (int bi = 0; bi < nbuf && out < 0; ++bi)
            if (last_use[holder[bi] + 1] < l)
                out = bi;
        if (out < 0)
            out = nbuf++;
        holder[out] = l;
        buf_of[l + 1] = out;
        p->out_buf[l] = out;
    }
    return nbuf;
}

/* Fills the tile-dependent fields for one candidate and returns its shared-memory bytes. */
static size_t fm_plan_layout(fm_plan *p, const fm_target *t, int warps, int m_tiles, int n_chunk, int resident,
                             const int *value_pad) {
    p->warps = warps;
    p->m_tiles = m_tiles;
    p->rows_per_cta = warps * m_tiles * 16;
    p->resident = resident;
    p->w_slot_elems = 0;
    int widest = 0; /* fm_plan_make's accumulator budget: m_tiles * n_chunk <= 128, 64 with layers over 128 wide */
    for (int v = 0; v <= p->num_layers; ++v)
        widest = value_pad[v] > widest ? value_pad[v] : widest;
    for (int l = 0; l < p->num_layers; ++l) {
        /* Balanced chunks (96 columns at most 64 wide: 48 + 48, not 64 + 32), so a layer usually needs one
         * instantiation of the chunk code rather than two. A norm layer is one chunk where that fits the accumulator
         * budget (its statistics then come from the registers in one pass); over more chunks the kernel runs them
         * twice, first for the statistics (fused_mlp.cu, fm_layer). */
        int one = p->norm[l] && m_tiles * p->n_pad[l] <= (widest > 128 ? 64 : 128);
        int chunks = one ? 1 : (p->n_pad[l] + n_chunk - 1) / n_chunk;
        p->n_chunk[l] = fm_round_up((p->n_pad[l] + chunks - 1) / chunks, 16);
        size_t chunk_elems = (size_t)p->n_chunk[l] * (size_t)fm_plan_w_stride(p, l);
        if (chunk_elems > p->w_slot_elems)
            p->w_slot_elems = chunk_elems;
    }
    p->buffers = fm_plan_buffers(p);
    p->act_stride = fm_act_stride(p, value_pad, p->num_layers + 1, 1);
    size_t w_region = resident ? p->w_elems : 2 * p->w_slot_elems;
    if (resident)
        p->w_slot_elems = 0;
    size_t act = (size_t)warps * (size_t)p->buffers * (size_t)(m_tiles * 16) * (size_t)p->act_stride;
    p->smem_bytes = (size_t)p->elem_bytes * (w_region + act) + 4 * p->b_floats;
    /* CTAs per SM: as shared memory allows (the driver reserves 1 KiB per CTA on sm_80+), up to 16 warps per SM;
     * more would leave under 128 registers per thread for 64 accumulators plus fragments. */
    size_t per_sm = t->smem_per_sm ? t->smem_per_sm : t->smem_per_block;
    int blocks = (int)(per_sm / (p->smem_bytes + 1024));
    if (blocks > 16 / warps)
        blocks = 16 / warps;
    p->blocks_per_sm = blocks < 1 ? 1 : blocks;
    return p->smem_bytes;
}

/* Lays out the weight and bias blobs: per layer, n_pad rows of k_pad (plus the mma.sync row pad). A cluster plan's
 * blob is one share per CTA, each with n_chunk rows of every layer (a last layer not split: whole, in CTA 0's share;
 * the others leave it zero and do not copy it). */
void fm_plan_blobs(fm_plan *p) {
    p->w_elems = 0;
    p->b_floats = 0;
    for (int l = 0; l < p->num_layers; ++l) {
        p->w_offset[l] = p->w_elems;
        size_t rows = (size_t)(p->cluster ? p->n_chunk[l] : p->n_pad[l]);
        p->w_elems += rows * (size_t)(p->wgmma ? p->k_pad[l] : fm_plan_w_stride(p, l));
        p->b_offset[l] = p->b_floats;
        p->b_floats += (size_t)p->n_pad[l] * (p->norm[l] ? 3 : 1); /* a norm's gamma and beta after the bias */
        p->dq_offset[l] = p->b_floats; /* 8-bit: the dequantisation factors after those */
        if (fm_prec_is_8bit(p->prec))
            p->b_floats += (size_t)p->n_pad[l];
    }
    p->b_floats = (p->b_floats + 3) / 4 * 4;
    p->w_rank_elems = p->cluster ? p->w_elems : 0;
    if (p->cluster)
        p->w_elems *= (size_t)p->cluster;
}

/* Whether a candidate's residency counts first in fm_plan_better. An 8-bit plan's weights are half as large, so
 * residency often fits only with one warp per SM (res128 on sm_89: its float32 output stage widens every activation
 * row), which leaves three of the SM's four schedulers idle; there it must come with 4 warps per SM at least.
 * Unmeasured: a rule of thumb until the 8-bit kernels have been timed (tests/test_lowbit_gpu.py). */
static int fm_plan_resident_rank(const fm_plan *p) {
    return p->resident && (!fm_prec_is_8bit(p->prec) || p->blocks_per_sm * p->warps >= 4);
}

/* Candidate order: resident weights (loaded once per CTA) beat streaming them per row tile; then more warps per SM
 * (each warp runs its layers serially, so the SM needs several in flight to hide latency); then more rows per CTA
 * (streamed weights are re-read from L2 once per tile); then more rows per warp and wider chunks (fewer ldmatrix per
 * mma). Returns 1 when a beats b. */
static int fm_plan_better(const fm_plan *a, const fm_plan *b) {
    int ka[5] = {fm_plan_resident_rank(a), a->blocks_per_sm * a->warps, a->rows_per_cta, a->m_tiles, a->n_chunk[0]};
    int kb[5] = {fm_plan_resident_rank(b), b->blocks_per_sm * b->warps, b->rows_per_cta, b->m_tiles, b->n_chunk[0]};
    for (int i = 0; i < 5; ++i)
        if (ka[i] != kb[i])
            return ka[i] > kb[i];
    return 0;
}

fm_status fm_plan_check_prec(const fm_spec *spec, const fm_target *target, fm_prec prec, fm_error *err) {
    if (prec != FM_PREC_F16 && prec != FM_PREC_BF16 && prec != FM_PREC_TF32 && !fm_prec_is_8bit(prec))
        return fm_fail(err, FM_ERR_VALUE, "precision %d is not float16 (0), bfloat16 (1), tf32 (2), int8 (3) or "
                       "float8 (4)", (int)prec);
    if (target->arch < fm_prec_min_arch(prec)) {
        fm_fail(err, FM_ERR_LIMIT, "dtype='%s' needs Tensor Cores of sm_%d or newer; the target is sm_%d",
                fm_prec_name(prec), fm_prec_min_arch(prec), target->arch);
        fm_error_hint(err, prec == FM_PREC_E4M3 && target->arch >= 80 ? "use dtype='int8' (sm_80+) or 'float16' on "
                      "this GPU" : "use dtype='float16' on this GPU");
        return FM_ERR_LIMIT;
    }
    if (!fm_prec_is_8bit(prec))
        return FM_OK;
    if (spec->quant != prec)
        return fm_fail(err, FM_ERR_VALUE, "a dtype='%s' plan needs the network's %s scales, and it has %s", 
                       fm_prec_name(prec), fm_prec_name(prec),
                       fm_prec_is_8bit(spec->quant) ? fm_prec_name(spec->quant) : "none (it is not an 8-bit network)");
    return fm_spec_check_calibrated(spec, "planning the kernel", err);
}

void fm_plan_take_scales(const fm_spec *spec, fm_plan *plan) {
    for (int l = 0; l < spec->num_layers && fm_prec_is_8bit(plan->prec); ++l) {
        plan->act_scale[l] = spec->act_scale[l];
        plan->w_scale[l] = spec->w_scale[l];
    }
}

static fm_status fm_plan_form(const fm_spec *spec, const fm_target *target, const fm_plan_opts *opts, fm_prec prec,
                              fm_dtype in_dtype, fm_dtype out_dtype, fm_plan *plan, fm_error *err) {
    memset(plan, 0, sizeof *plan);
    plan->num_layers = spec->num_layers;
    plan->in_dtype = in_dtype;
    plan->out_dtype = out_dtype;
    plan->arch = target->arch;
    plan->prec = prec;
    plan->elem_bytes = (int)fm_prec_size(prec);
    fm_status st = fm_plan_check_prec(spec, target, prec, err);
    if (st != FM_OK)
        return st;
    fm_plan_take_scales(spec, plan);
    if ((unsigned)in_dtype >= FM_CODES || (unsigned)out_dtype >= FM_CODES)
        return fm_fail(err, FM_ERR_VALUE, "a fused kernel's x and y are float32, float16 or bfloat16 (in_dtype %d, "
                       "out_dtype %d); codes are a GEMM segment's", (int)in_dtype, (int)out_dtype);
    if ((in_dtype == FM_BF16 || out_dtype == FM_BF16) && target->arch < 80) {
        fm_fail(err, FM_ERR_LIMIT, "bfloat16 input/output needs sm_80 or newer (cvt.rn.bf16x2); the target is sm_%d",
                target->arch);
        fm_error_hint(err, "pass float32 or float16 arrays on this GPU");
        return FM_ERR_LIMIT;
    }

    int widest = 0, value_pad[FM_MAX_LAYERS + 1];
    for (int v = 0; v <= spec->num_layers; ++v) {
        int w = spec->width[v];
        if (w > FM_MAX_FUSED_WIDTH) {
            fm_fail(err, FM_ERR_LIMIT, "layer %d has %d %s features; the fused kernels hold at most %d features per "
                    "layer (sm_90a's streamed warpgroup kernel; %d elsewhere)", v == 0 ? 0 : v - 1, w,
                    v == 0 ? "input" : "output", FM_MAX_FUSED_WIDTH, FM_MAX_ONCHIP_WIDTH);
            fm_error_hint(err, "a network with wider layers runs cut into segments, its wide layers as GEMMs "
                          "(evaluate_fused_mlp, FusedMLP); or use device='cpu'");
            return FM_ERR_LIMIT;
        }
        widest = w > widest ? w : widest;
        value_pad[v] = fm_round_up(w, fm_prec_is_8bit(prec) ? 32 : 16); /* whole k steps: 16 halves, 32 bytes */
    }
    plan->x_features = spec->x_features;
    for (int l = 0; l < spec->num_layers; ++l) {
        plan->k_real[l] = fm_spec_in_features(spec, l);
        plan->n_real[l] = spec->width[l + 1];
        plan->has_bias[l] = spec->has_bias[l];
        plan->res_op[l] = spec->res_op[l];
        plan->res_src[l] = spec->res_src[l];
        plan->cat[l] = spec->cat[l];
        plan->norm[l] = spec->norm[l];
        plan->centred[l] = spec->norm[l] == FM_NORM_LAYER && !fm_prec_is_8bit(prec) &&
                           plan->k_real[l] <= 2 * FM_MAX_FUSED_WIDTH; /* (fm_plan_pack's column means) */
        /* A concat input is two parts, each padded on its own: they live in different activation buffers. */
        int first = spec->cat[l] == FM_CAT_BEFORE ? 0 : l, second = spec->cat[l] == FM_CAT_AFTER ? 0 : l;
        plan->k0_real[l] = spec->width[first];
        plan->k0_pad[l] = value_pad[first];
        plan->k_pad[l] = plan->k0_pad[l] + (spec->cat[l] != FM_CAT_NONE ? value_pad[second] : 0);
        plan->n_pad[l] = value_pad[l + 1];
    }

    /* sm_90a: the warpgroup kernel when the network fits it (and no mma.sync tile shape was asked for). Its register-A
     * form first (activations stay in registers between layers), with the most warpgroups per CTA that the register
     * estimate lets share an SM, up to 4; where that form cannot take the network (a 256-wide hidden layer's
     * fragments, weights over one CTA's shared memory, a concat, a norm whose row does not fit), two warpgroups of
     * the shared-memory-A form on a cluster of 1 or 2 (fm_plan_cluster), else the register-A form with its weights
     * streamed through shared memory (fm_plan_stream), else the other cluster shapes. */
    const char *unfit = fm_plan_wgmma_unfit(plan, widest);
    int shape_free = !opts->m_tiles && !opts->n_chunk && opts->resident != 0 && opts->warps % 4 == 0;
    int want_wgmma = opts->wgmma > 0 || (opts->wgmma < 0 && shape_free);
    /* float8 takes its wgmma form by default where it fits: on the H100 it ran tcnn64 in 0.103 ms and tcnn128 in 0.234
     * against mma.sync's 0.169 and 0.620 (Hopper runs mma.sync e4m3 as float16 HMMAs plus unpacks;
     * bench/results/h100-lowbit/). It runs each layer as one column group (its epilogue packs whole k32 fragments).
     * So does int8 (s32 accumulators started at the rounding constant's bits): H100, 2^20 rows, tcnn128 0.332 ms and
     * res128 1.698 against its mma.sync's 0.427 and 2.662 (bench/results/h100-float8-epilogue/int8_wgmma.txt). */
    if (fm_prec_is_8bit(prec) && want_wgmma && (opts->n_chunk || opts->kpipe > 0))
        return fm_fail(err, FM_ERR_LIMIT, "wgmma=1 with dtype='%s' runs each layer whole: n_chunk=%d and kpipe=%d "
                       "cannot be forced", fm_prec_name(prec), opts->n_chunk, opts->kpipe);
    if (opts->kpipe > 0 && (opts->cluster > 0 || !want_wgmma || unfit != NULL))
        return fm_fail(err, FM_ERR_LIMIT, "kpipe=1 was asked for, but only the register-A warpgroup kernel pipelines "
                       "its layers, and %s", unfit != NULL ? unfit : "this plan is not that kernel");
    if (opts->k_chunk < 0)
        return fm_fail(err, FM_ERR_VALUE, "k_chunk=%d: the streamed kernel's K inputs per slot fill, 0 (the plan's) or "
                       "positive (rounded up to 16)", opts->k_chunk);
    if (opts->cluster > 0)
        return fm_plan_cluster(plan, target, opts, opts->cluster, widest, value_pad, err);
    if (opts->wgmma > 0 && opts->resident == 0)
        return fm_plan_stream(plan, target, opts, widest, value_pad, err);
    if (want_wgmma && unfit == NULL) {
        plan->wgmma = 1;
        fm_plan_blobs(plan);
        fm_plan_wgmma_chunks(plan, opts->n_chunk);
        fm_plan_pipe(plan, spec, opts->kpipe > 0); /* asked for: the warps are chosen with its registers */
        if (opts->kpipe > 0 && !plan->kpipe)
            return fm_fail(err, FM_ERR_LIMIT, "kpipe=1 was asked for, but no layer of this network can be pipelined "
                           "(that needs a layer before the last whose activation is not relu or the identity, and no "
                           "residuals, n_chunk, or stretch of layers with the same code the kernel loops over)");
        int warps = opts->warps;
        if (warps == 0) { /* the register estimate needs only the padded widths and the column groups */
            int per_sm = 65536 / (fm_plan_wgmma_regs(plan) * 128);
            warps = 4 * (per_sm < 1 ? 1 : (per_sm > 4 ? 4 : per_sm));
        }
        /* Fewer warpgroups when the stages do not fit, or when the per-thread register share (64K / threads) is
         * under the estimate: ptxas refuses a wgmma whose accumulators it cannot hold ("Insufficient registers"). */
        int regs_ok = 0;
        for (; warps >= 4; warps -= 4) {
            size_t bytes = fm_plan_wgmma_layout(plan, target, warps, value_pad);
            regs_ok = 65536 / (warps * 32) >= fm_plan_wgmma_regs(plan);
            if ((bytes <= target->smem_per_block && regs_ok) || opts->warps)
                break;
        }
        if (opts->warps && !regs_ok) {
            fm_fail(err, FM_ERR_LIMIT, "warps=%d leaves %d registers per thread; the wgmma kernel of this network "
                    "needs about %d", opts->warps, 65536 / (opts->warps * 32), fm_plan_wgmma_regs(plan));
            fm_error_hint(err, "use fewer warps (4 per warpgroup)");
            return FM_ERR_LIMIT;
        }
        if (warps >= 4 && plan->smem_bytes <= target->smem_per_block) {
            if (opts->kpipe == 0) { /* auto: pipelined where that fits the same CTAs per SM */
                int blocks = plan->blocks_per_sm;
                fm_plan_pipe(plan, spec, 1);
                fm_plan_wgmma_layout(plan, target, warps, value_pad);
                int fits = plan->blocks_per_sm == blocks && 65536 / (warps * 32) >= fm_plan_wgmma_regs(plan);
                if (plan->kpipe && !fits) {
                    fm_plan_pipe(plan, spec, 0);
                    fm_plan_wgmma_layout(plan, target, warps, value_pad);
                }
            }
            return FM_OK;
        }
        if (opts->kpipe > 0)
            return fm_fail(err, FM_ERR_LIMIT, "kpipe=1 was asked for, but the register-A warpgroup kernel's "
                           "resident weights and stages do not fit one CTA");
        plan->wgmma = 0; /* the resident weights and stages do not fit one CTA */
        fm_plan_pipe(plan, spec, 0);
    }
    /* Where the register-A form with resident weights does not take the network: two warpgroups on clusters of 1 or
     * 2 CTAs (the shared-memory-A form), else the register-A form with streamed weights, else the other cluster
     * shapes. On the H100 (2^21 rows, fp16; bench/results/h100-stream/) the streamed form ran r256 2.2x and deep256
     * 4.9x faster than their one-warpgroup clusters of 2 and 4, and siren256 (sin) 10% slower than its two-warpgroup
     * cluster of 2. */
    if (want_wgmma && opts->cluster <= 0 && shape_free) {
        if (opts->cluster == 0 && fm_plan_cluster_auto(plan, target, opts, widest, value_pad, 0, 2))
            return FM_OK;
        if (opts->resident < 0) { /* (resident=1 asked for: not streamed) */
            fm_plan cand = *plan;
            fm_error quiet = {0};
            fm_status st_stream = fm_plan_stream(&cand, target, opts, widest, value_pad, &quiet);
            fm_error_clear(&quiet);
            if (st_stream == FM_OK) {
                *plan = cand;
                return FM_OK;
            }
        }
        if (opts->cluster == 0 && fm_plan_cluster_auto(plan, target, opts, widest, value_pad, 2, 6))
            return FM_OK;
    }
    if (opts->wgmma > 0) {
        if (unfit != NULL)
            fm_fail(err, FM_ERR_LIMIT, "wgmma=1 was asked for, but %s", unfit);
        else
            fm_fail(err, FM_ERR_LIMIT, "wgmma=1 was asked for, but the resident weights (%zu bytes) and stage buffers "
                    "do not fit in the %zu bytes of shared memory a block may use on sm_%d, in one CTA or split "
                    "over a cluster", plan->w_elems * (size_t)plan->elem_bytes, target->smem_per_block,
                    target->arch);
        return FM_ERR_LIMIT;
    }
    if (widest > FM_MAX_ONCHIP_WIDTH) { /* the streamed warpgroup kernel did not take it: name the widest layer */
        int v = 0;
        while (spec->width[v] != widest)
            ++v;
        fm_fail(err, FM_ERR_LIMIT, "layer %d has %d %s features; the fused kernels hold at most %d features per layer, "
                "but for sm_90a's streamed warpgroup kernel (up to %d, float16 or bfloat16, where its registers and "
                "shared memory allow: %s)", v == 0 ? 0 : v - 1, widest,
                v == 0 ? "input" : "output", FM_MAX_ONCHIP_WIDTH, FM_MAX_FUSED_WIDTH,
                target->arch != 90 ? "the target is not sm_90" : "not this network");
        fm_error_hint(err, "on other GPUs a network with wider layers runs cut into segments (evaluate_fused_mlp, "
                      "FusedMLP), its wide layers as GEMMs; or use device='cpu'");
        return FM_ERR_LIMIT;
    }
    fm_plan_blobs(plan);

    /* Accumulators cost m_tiles * n_chunk / 2 registers per thread: at most 64, and 32 for layers wider than 128,
     * whose longer k loop keeps more fragments live (a 256x8 gelu network spilled at 64). */
    static const int warp_choices[] = {8, 4, 2, 1};
    static const int mt_choices[] = {2, 1};
    static const int nc_choices[] = {128, 64, 32, 16};
    int norm_widest = 0; /* a norm layer is one chunk whatever nc: m_tiles * n_pad / 2 accumulators */
    for (int l = 0; l < plan->num_layers; ++l)
        norm_widest = plan->norm[l] && plan->n_pad[l] > norm_widest ? plan->n_pad[l] : norm_widest;
    fm_plan best, cand = *plan;
    int found = 0;
    for (int resident = 1; resident >= 0; --resident) {
        if (opts->resident >= 0 && opts->resident != resident)
            continue;
        for (size_t wi = 0; wi < 4; ++wi) {
            int warps = warp_choices[wi];
            if (opts->warps && opts->warps != warps)
                continue;
            for (size_t mi = 0; mi < 2; ++mi) {
                int mt = mt_choices[mi];
                if (opts->m_tiles ? opts->m_tiles != mt : (mt == 2 && (widest > 128 || norm_widest > 64)))
                    continue;
                for (size_t ni = 0; ni < 4; ++ni) {
                    int nc = nc_choices[ni];
                    if (opts->n_chunk ? opts->n_chunk != nc : mt * nc > (widest > 128 ? 64 : 128))
                        continue;
                    if (fm_plan_layout(&cand, target, warps, mt, nc, resident, value_pad) > target->smem_per_block)
                        continue;
                    if (!found || fm_plan_better(&cand, &best))
                        best = cand;
                    found = 1;
                }
            }
        }
    }
    if (found) {
        *plan = best;
        return FM_OK;
    }
    if (opts->warps || opts->m_tiles || opts->n_chunk || opts->resident >= 0)
        fm_fail(err, FM_ERR_LIMIT,
                "no tile shape with warps=%d, m_tiles=%d, n_chunk=%d, resident=%d fits in the %zu bytes of shared "
                "memory a block may use on sm_%d",
                opts->warps, opts->m_tiles, opts->n_chunk, opts->resident, target->smem_per_block, target->arch);
    else
        fm_fail(err, FM_ERR_LIMIT,
                "the network does not fit in the %zu bytes of shared memory a block may use on sm_%d (widest layer: "
                "%d features)",
                target->smem_per_block, target->arch, widest);
    return FM_ERR_LIMIT;
}

/* Whether a streamed plan with looped wide layers can split them over clusters of `split` CTAs (fm_plan.split, set
 * with its layout by fm_plan_stream, the only form that sets it): every wide layer a loop of whole groups (no residual, no norm, its width a
 * multiple of its group width), their number a multiple of the cluster's CTAs. */
static fm_status fm_plan_split_check(const fm_plan *plan, int split, fm_error *err) {
    for (int l = 0; l < plan->num_layers; ++l) {
        if (!plan->wide_out[l])
            continue;
        int groups = plan->n_pad[l] / plan->n_chunk[l];
        if (plan->res_op[l] != FM_RES_NONE || plan->norm[l] != FM_NORM_NONE)
            return fm_fail(err, FM_ERR_LIMIT, "split=%d: layer %d has a %s, and a split layer has none", split, l,
                           plan->res_op[l] != FM_RES_NONE ? "residual" : "norm");
        if (plan->n_pad[l] % plan->n_chunk[l] != 0 || groups % split != 0 || groups < 2)
            return fm_fail(err, FM_ERR_LIMIT, "split=%d: layer %d's %d columns are %d groups of %d, not a multiple of "
                           "%d groups", split, l, plan->n_pad[l], (plan->n_pad[l] + plan->n_chunk[l] - 1) /
                           plan->n_chunk[l], plan->n_chunk[l], split);
        if ((size_t)plan->n_chunk[l] * (size_t)fm_plan_k_chunk(plan, l) > plan->w_slot_elems)
            return fm_fail(err, FM_ERR_LIMIT, "split=%d: layer %d's groups take more than one slot each", split, l);
    }
    return FM_OK;
}

/* fm_plan.k_perm and q_fold of an 8-bit plan: k_perm on the register-A warpgroup kernel (resident or streamed
 * weights), where every layer after the first reads the codes the layer before packed from its accumulators (its
 * 8-bit forms: no cluster or K-pipelined one, fm_plan_sm90); q_fold on every kernel. */
static void fm_plan_codes_in_place(const fm_spec *spec, fm_plan *plan) {
    if (!fm_prec_is_8bit(plan->prec))
        return;
    for (int l = 0; l < plan->num_layers; ++l) {
        const char *act = fm_spec_act_unary(spec, l);
        plan->k_perm[l] = plan->wgmma && l > 0;
        /* every 8-bit kernel folds (the mma.sync one stores its codes to shared memory the same way) */
        const int plain = l < plan->num_layers - 1 && plan->res_op[l] == FM_RES_NONE && plan->norm[l] == FM_NORM_NONE;
        if (plain && act != NULL)
            plan->q_fold[l] = strcmp(act, "") == 0 ? 1 : strcmp(act, "relu") == 0 ? 2 : 0;
    }
}

/* fm_plan.norm_half for every layer of a fused plan. */
static void fm_plan_norm_halves(const fm_spec *spec, fm_plan *plan) {
    for (int l = 0; l < plan->num_layers; ++l) {
        /* a layernorm's or rmsnorm's: a softmax has no gamma and beta to halve */
        const int affine = spec->norm[l] != FM_NORM_NONE && !FM_NORM_IS_SOFT(spec->norm[l]);
        const char *act = affine ? fm_spec_act_unary(spec, l) : NULL;
        plan->norm_half[l] = act != NULL && !fm_prec_is_8bit(plan->prec) && fm_plan_result_type(plan, l) != 0 &&
                             (strcmp(act, "silu") == 0 || strcmp(act, "sigmoid") == 0);
    }
}

/* fm_plan.x_split for a fused plan (opts: fm_plan_opts.x_split). */
static fm_status fm_plan_x_splits(const fm_spec *spec, fm_plan *plan, int opt, fm_error *err) {
    const char *why = NULL;
    if (plan->prec != FM_PREC_F16 && plan->prec != FM_PREC_BF16)
        why = "only float16 and bfloat16 plans split x (tf32 and 8-bit ones keep it whole)";
    else if (spec->enc_cols > 0)
        why = "x is encoded as it is loaded (the encoding's sines are formed from x in float32)";
    else if (3 * spec->width[0] > plan->k0_pad[0])
        why = "x has more than 5 features (three parts would take more k steps than one)";
    for (int l = 0; why == NULL && l < spec->num_layers; ++l)
        if (spec->res_op[l] != FM_RES_NONE && spec->res_src[l] == -1)
            why = "a layer adds or multiplies x itself (its residual operand is x's columns)";
    plan->x_split = opt >= 0 && why == NULL;
    if (opt > 0 && why != NULL)
        return fm_fail(err, FM_ERR_LIMIT, "x_split=1 was asked for, but %s", why);
    return FM_OK;
}

/* The plan of the form fm_plan_form chooses, with the options that do not change the choice: wide_loop (auto or on)
 * where the plan is the streamed warpgroup kernel of a network with a layer wider than 256 in or out (its wide form:
 * fm_plan.wide_out, k_chunk; the kernel loops over such a layer's column groups, fm_plan.wide_loop); wide_loop=1 on
 * any other plan is a limit naming it. */
fm_status fm_plan_make(const fm_spec *spec, const fm_target *target, const fm_plan_opts *opts, fm_prec prec,
                       fm_dtype in_dtype, fm_dtype out_dtype, fm_plan *plan, fm_error *err) {
    fm_plan_opts none = {0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    if (opts == NULL)
        opts = &none;
    if (opts->in_shared < -1 || opts->in_shared > 1) {
        memset(plan, 0, sizeof *plan);
        return fm_fail(err, FM_ERR_VALUE, "in_shared=%d: the streamed kernel's input buffers in its wide buffers' "
                       "bytes, 0 (auto: where two warpgroups fit no other way), 1 (on, else an error) or -1 (off)",
                       opts->in_shared);
    }
    if (opts->wide_loop < -1 || opts->wide_loop > 1) {
        memset(plan, 0, sizeof *plan);
        return fm_fail(err, FM_ERR_VALUE, "wide_loop=%d: the streamed kernel's wide layers' column groups, 0 (auto: "
                       "a loop), 1 (a loop, else an error) or -1 (unrolled)", opts->wide_loop);
    }
    if (opts->x_split < -1 || opts->x_split > 1) {
        memset(plan, 0, sizeof *plan);
        return fm_fail(err, FM_ERR_VALUE, "x_split=%d: x and the weights multiplying it in two 16-bit parts each, 0 "
                       "(auto: where x has at most 5 features), 1 (on, else an error) or -1 (off)", opts->x_split);
    }
    if (opts->split != 0 && opts->split != 2 && opts->split != 4 && opts->split != 8) {
        memset(plan, 0, sizeof *plan);
        return fm_fail(err, FM_ERR_VALUE, "split=%d: the streamed kernel's wide layers over clusters of 2, 4 or 8 "
                       "CTAs, or 0 (none, the default)", opts->split);
    }
    fm_status st = fm_plan_form(spec, target, opts, prec, in_dtype, out_dtype, plan, err);
    if (st == FM_OK) {
        fm_plan_codes_in_place(spec, plan);
        if (opts->norm_half >= 0)
            fm_plan_norm_halves(spec, plan);
        st = fm_plan_x_splits(spec, plan, opts->x_split, err);
    }
    if (st == FM_OK && opts->in_shared > 0 && !plan->in_shared)
        return fm_fail(err, FM_ERR_LIMIT, "in_shared=1 was asked for, but only the streamed warpgroup kernel (wgmma=1, "
                       "resident=0) of a network with a layer wider than 256 shares its buffers, and this plan is not "
                       "that kernel");
    if (st == FM_OK && opts->split > 1 && opts->wide_loop < 0)
        return fm_fail(err, FM_ERR_LIMIT, "split=%d was asked for with wide_loop=-1: a split layer's column groups "
                       "run as a loop (fused_mlp_sm90.cu, fm_wide_layer)", opts->split);
    if (st != FM_OK || opts->wide_loop < 0)
        return st;
    if (!plan->stream_slots || !fm_plan_has_wide_value(plan)) { /* nothing to loop over or split */
        if (opts->split <= 1 && opts->wide_loop == 0)
            return FM_OK;
        return fm_fail(err, FM_ERR_LIMIT, "%s=%d was asked for, but %s", opts->split > 1 ? "split" : "wide_loop",
                       opts->split > 1 ? opts->split : opts->wide_loop, plan->stream_slots
                       ? "this network has no layer wider than 256 (the streamed kernel's wide layers are looped, "
                         "or split)"
                       : "only the streamed warpgroup kernel (wgmma=1, resident=0) loops over or splits a wide "
                         "layer's groups, and this plan is not that kernel");
    }
    plan->wide_loop = 1;
    return opts->split > 1 ? fm_plan_split_check(plan, opts->split, err) : FM_OK;
}
