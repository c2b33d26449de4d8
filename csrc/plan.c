/* plan.c - pad widths for the Tensor Cores, choose the tile shape and weight residency, budget shared memory. */
#include "fm.h"

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

static int fm_round_up(int v, int m) { return (v + m - 1) / m * m; }

/* Halves per row of an activation buffer: wide enough for every layer input and the last layer's staged output,
 * and an odd number of 16-byte units so the 8 rows an ldmatrix reads hit 8 different bank groups. */
static int fm_act_stride(const fm_plan *p) {
    int need = 0;
    for (int l = 0; l < p->num_layers; ++l)
        if (p->k_pad[l] + 8 > need)
            need = p->k_pad[l] + 8;
    int n_out = p->n_pad[p->num_layers - 1];
    int stage = p->out_dtype == FM_F32 ? 2 * (n_out + 4) : n_out + 8; /* staged output row, in halves */
    if (stage > need)
        need = stage;
    need = fm_round_up(need, 8);
    if ((need / 8) % 2 == 0)
        need += 8;
    return need;
}

/* Fills the tile-dependent fields for one candidate and returns its shared-memory bytes. */
static size_t fm_plan_layout(fm_plan *p, const fm_target *t, int warps, int m_tiles, int n_chunk, int resident) {
    p->warps = warps;
    p->m_tiles = m_tiles;
    p->rows_per_cta = warps * m_tiles * 16;
    p->resident = resident;
    p->w_slot_halves = 0;
    p->buffers = 1;
    for (int l = 0; l < p->num_layers; ++l) {
        /* Balanced chunks (96 columns at most 64 wide: 48 + 48, not 64 + 32), so a layer usually needs one
         * instantiation of the chunk code rather than two. */
        int chunks = (p->n_pad[l] + n_chunk - 1) / n_chunk;
        p->n_chunk[l] = fm_round_up((p->n_pad[l] + chunks - 1) / chunks, 16);
        if (chunks > 1) /* a later chunk still reads the input the first one would overwrite */
            p->buffers = 2;
        size_t chunk_halves = (size_t)p->n_chunk[l] * (size_t)(p->k_pad[l] + 8);
        if (chunk_halves > p->w_slot_halves)
            p->w_slot_halves = chunk_halves;
    }
    /* The last layer stages its output in another layout (STAGE_STRIDE): in place, one lane's staged store could
     * overwrite an input element another lane still has to read as its residual. */
    if (p->res_op[p->num_layers - 1] != FM_RES_NONE)
        p->buffers = 2;
    p->act_stride = fm_act_stride(p);
    size_t w_region = resident ? p->w_halves : 2 * p->w_slot_halves;
    if (resident)
        p->w_slot_halves = 0;
    size_t act = (size_t)warps * (size_t)p->buffers * (size_t)(m_tiles * 16) * (size_t)p->act_stride;
    p->smem_bytes = 2 * w_region + 4 * p->b_floats + 2 * act;
    /* CTAs per SM: as shared memory allows (the driver reserves 1 KiB per CTA on sm_80+), up to 16 warps per SM;
     * more would leave under 128 registers per thread for 64 accumulators plus fragments. */
    size_t per_sm = t->smem_per_sm ? t->smem_per_sm : t->smem_per_block;
    int blocks = (int)(per_sm / (p->smem_bytes + 1024));
    if (blocks > 16 / warps)
        blocks = 16 / warps;
    p->blocks_per_sm = blocks < 1 ? 1 : blocks;
    return p->smem_bytes;
}

/* Candidate order: resident weights (loaded once per CTA) beat streaming them per row tile; then more warps per SM
 * (each warp runs its layers serially, so the SM needs several in flight to hide latency); then more rows per CTA
 * (streamed weights are re-read from L2 once per tile); then more rows per warp and wider chunks (fewer ldmatrix per
 * mma). Returns 1 when a beats b. */
static int fm_plan_better(const fm_plan *a, const fm_plan *b) {
    int ka[5] = {a->resident, a->blocks_per_sm * a->warps, a->rows_per_cta, a->m_tiles, a->n_chunk[0]};
    int kb[5] = {b->resident, b->blocks_per_sm * b->warps, b->rows_per_cta, b->m_tiles, b->n_chunk[0]};
    for (int i = 0; i < 5; ++i)
        if (ka[i] != kb[i])
            return ka[i] > kb[i];
    return 0;
}

fm_status fm_plan_make(const fm_spec *spec, const fm_target *target, const fm_plan_opts *opts, fm_dtype in_dtype,
                       fm_dtype out_dtype, fm_plan *plan, fm_error *err) {
    fm_plan_opts none = {0, 0, 0, -1};
    if (opts == NULL)
        opts = &none;
    memset(plan, 0, sizeof *plan);
    plan->num_layers = spec->num_layers;
    plan->in_dtype = in_dtype;
    plan->out_dtype = out_dtype;
    plan->arch = target->arch;
    if (in_dtype == FM_BF16 || out_dtype == FM_BF16)
        return fm_fail(err, FM_ERR_VALUE, "bfloat16 input/output is not supported yet; use float32 or float16");

    int widest = 0;
    for (int l = 0; l < spec->num_layers; ++l) {
        plan->k_real[l] = spec->width[l];
        plan->n_real[l] = spec->width[l + 1];
        plan->has_bias[l] = spec->has_bias[l];
        plan->res_op[l] = spec->res_op[l];
        for (int side = 0; side < 2; ++side) {
            int w = spec->width[l + side];
            if (w > FM_MAX_FUSED_WIDTH) {
                fm_fail(err, FM_ERR_LIMIT,
                        "layer %d has %d %s features; the fused kernel holds at most %d features per layer", l, w,
                        side ? "output" : "input", FM_MAX_FUSED_WIDTH);
                fm_error_hint(err, "split the layer or use device='cpu'; wider layers are a planned feature");
                return FM_ERR_LIMIT;
            }
            if (w > widest)
                widest = w;
        }
        plan->k_pad[l] = fm_round_up(plan->k_real[l], 16);
        plan->n_pad[l] = fm_round_up(plan->n_real[l], 16);
        plan->w_offset[l] = plan->w_halves;
        plan->w_halves += (size_t)plan->n_pad[l] * (size_t)(plan->k_pad[l] + 8);
        plan->b_offset[l] = plan->b_floats;
        plan->b_floats += (size_t)plan->n_pad[l];
    }
    plan->b_floats = (plan->b_floats + 3) / 4 * 4;

    /* Accumulators cost m_tiles * n_chunk / 2 registers per thread: at most 64, and 32 for layers wider than 128,
     * whose longer k loop keeps more fragments live (a 256x8 gelu network spilled at 64). */
    static const int warp_choices[] = {8, 4, 2, 1};
    static const int mt_choices[] = {2, 1};
    static const int nc_choices[] = {128, 64, 32, 16};
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
                if (opts->m_tiles ? opts->m_tiles != mt : (mt == 2 && widest > 128))
                    continue;
                for (size_t ni = 0; ni < 4; ++ni) {
                    int nc = nc_choices[ni];
                    if (opts->n_chunk ? opts->n_chunk != nc : mt * nc > (widest > 128 ? 64 : 128))
                        continue;
                    if (fm_plan_layout(&cand, target, warps, mt, nc, resident) > target->smem_per_block)
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

void fm_plan_pack(const fm_plan *plan, const float *const *w, const float *const *b, uint16_t *w_blob,
                  float *b_blob) {
    /* Round-to-nearest-even float -> binary16, done on the host so the kernel reads ready fp16 weights. */
    memset(w_blob, 0, plan->w_halves * sizeof *w_blob);
    memset(b_blob, 0, plan->b_floats * sizeof *b_blob);
    for (int l = 0; l < plan->num_layers; ++l) {
        int kr = plan->k_real[l], nr = plan->n_real[l], stride = plan->k_pad[l] + 8;
        uint16_t *dst = w_blob + plan->w_offset[l];
        for (int n = 0; n < nr; ++n)
            for (int k = 0; k < kr; ++k)
                dst[(size_t)n * stride + k] = fm_float_to_half(w[l][(size_t)n * kr + k]);
        if (b != NULL && b[l] != NULL && plan->has_bias[l])
            memcpy(b_blob + plan->b_offset[l], b[l], (size_t)nr * sizeof(float));
    }
}
