/* gemm.c - the plan of one layer as a tiled Tensor Core GEMM (kernel_templates/gemm_layer.cu).
 *
 * A network the fused kernels cannot hold (a layer wider than FM_MAX_FUSED_WIDTH, a stretch whose weights fit no CTA
 * or cluster) is cut into segments (python/fusedmlp/_segments.py); a layer no fused segment takes runs as this GEMM,
 * reading its input parts and residual operand from global memory and writing its result once, with the layer's
 * whole epilogue in registers. The plan is an fm_plan with gemm set, so the renderer, the weight packing and the
 * binding's kernel object serve it as they serve the fused plans. */
#include "fm.h"

#include <string.h>

static int fm_gemm_round_up(int v, int m) { return (v + m - 1) / m * m; }

/* Whether d is a global dtype code: 0 float32, 1 float16, 2 bfloat16. */
static int fm_gemm_valid_dtype(int d) { return d == FM_F32 || d == FM_F16 || d == FM_BF16; }

fm_status fm_plan_gemm(const fm_spec *spec, int l, const fm_target *target, fm_prec prec, fm_dtype a0, int a1,
                       int res, fm_dtype out, int bm, int bn, fm_plan *plan, fm_error *err) {
    memset(plan, 0, sizeof *plan);
    if (l < 0 || l >= spec->num_layers)
        return fm_fail(err, FM_ERR_VALUE, "layer %d: the network has layers 0..%d", l, spec->num_layers - 1);
    if (prec != FM_PREC_F16 && prec != FM_PREC_BF16 && prec != FM_PREC_TF32)
        return fm_fail(err, FM_ERR_VALUE, "precision %d is not float16 (0), bfloat16 (1) or tf32 (2)", (int)prec);
    if (!fm_gemm_valid_dtype((int)a0) || !fm_gemm_valid_dtype((int)out) || (a1 != -1 && !fm_gemm_valid_dtype(a1)) ||
        (res != -1 && !fm_gemm_valid_dtype(res)))
        return fm_fail(err, FM_ERR_VALUE, "GEMM dtypes a0=%d a1=%d res=%d out=%d: each is 0 (float32), 1 (float16) or "
                       "2 (bfloat16), a1 and res -1 where absent", (int)a0, a1, res, (int)out);
    if ((spec->cat[l] != FM_CAT_NONE) != (a1 != -1))
        return fm_fail(err, FM_ERR_VALUE, "layer %d %s input concat, but a1=%d (-1: none)", l,
                       spec->cat[l] != FM_CAT_NONE ? "has an" : "has no", a1);
    if ((spec->res_op[l] != FM_RES_NONE) != (res != -1))
        return fm_fail(err, FM_ERR_VALUE, "layer %d %s residual, but res=%d (-1: none)", l,
                       spec->res_op[l] != FM_RES_NONE ? "has a" : "has no", res);
    if (spec->norm[l] != FM_NORM_NONE)
        return fm_fail(err, FM_ERR_LIMIT, "layer %d has a %s, whose row statistics need all its %d columns at once; "
                       "the GEMM form computes a row in tiles of columns, so a norm layer runs in a fused kernel (up "
                       "to %d features)", l, fm_norm_name(spec->norm[l]), spec->width[l + 1],
                       FM_MAX_FUSED_WIDTH);
    if (target->arch < fm_prec_min_arch(prec)) {
        fm_fail(err, FM_ERR_LIMIT, "dtype='%s' needs Tensor Cores of sm_%d or newer; the target is sm_%d",
                fm_prec_name(prec), fm_prec_min_arch(prec), target->arch);
        fm_error_hint(err, "use dtype='float16' on this GPU");
        return FM_ERR_LIMIT;
    }
    if ((a0 == FM_BF16 || a1 == FM_BF16 || res == FM_BF16 || out == FM_BF16) && target->arch < 80)
        return fm_fail(err, FM_ERR_LIMIT, "bfloat16 input/output needs sm_80 or newer; the target is sm_%d",
                       target->arch);
    if ((bm != 0 && bm != 64 && bm != 128) || (bn != 0 && bn != 64 && bn != 128))
        return fm_fail(err, FM_ERR_VALUE, "GEMM tile %dx%d: rows and columns are each 64 or 128 (0: auto)", bm, bn);

    plan->gemm = 1;
    plan->gemm_layer = l;
    plan->num_layers = l + 1; /* fm_plan_result_type: this layer's result is the plan's output */
    plan->prec = prec;
    plan->elem_bytes = (int)fm_prec_size(prec);
    plan->arch = target->arch;
    plan->in_dtype = a0;
    plan->out_dtype = out;
    plan->a1_dtype = a1;
    plan->res_dtype = res;

    /* K in stages of 64 bytes (32 halves or 16 floats), each input part padded to whole stages so a stage reads one. */
    const int kt = 64 / plan->elem_bytes;
    const int first = spec->cat[l] == FM_CAT_BEFORE ? 0 : l, second = spec->cat[l] == FM_CAT_AFTER ? 0 : l;
    plan->k_real[l] = fm_spec_in_features(spec, l);
    plan->k0_real[l] = spec->width[first];
    plan->k0_pad[l] = fm_gemm_round_up(spec->width[first], kt);
    plan->k_pad[l] = plan->k0_pad[l] + (spec->cat[l] != FM_CAT_NONE ? fm_gemm_round_up(spec->width[second], kt) : 0);
    plan->n_real[l] = spec->width[l + 1];
    plan->has_bias[l] = spec->has_bias[l];
    plan->res_op[l] = spec->res_op[l];
    plan->res_src[l] = spec->res_src[l];
    plan->cat[l] = spec->cat[l];
    plan->a1_buf[l] = plan->res_buf[l] = -1;

    /* 128 x 128 tiles of 8 warps (64 x 32 each) by default: 4 stages are 80 KB, two CTAs an SM on sm_80..sm_90. A
     * layer of 64 or fewer outputs takes 64 columns, warps 32 x 32, so no tile is mostly padding. */
    plan->gemm_bm = bm ? bm : 128;
    plan->gemm_bn = bn ? bn : (plan->n_real[l] <= 64 ? 64 : 128);
    plan->warps = 8;
    plan->gemm_warps_m = plan->gemm_bn == 128 ? (plan->gemm_bm == 128 ? 2 : 1) : (plan->gemm_bm == 128 ? 4 : 2);
    plan->n_pad[l] = fm_gemm_round_up(plan->n_real[l], plan->gemm_bn);
    plan->n_chunk[l] = plan->gemm_bn;
    plan->rows_per_cta = plan->gemm_bm;
    plan->m_tiles = plan->gemm_bm / plan->gemm_warps_m / 16;
    plan->resident = 0;

    const size_t stage = (size_t)(plan->gemm_bm + plan->gemm_bn) * (64 + 16);
    int stages = 4;
    while (stages > 2 && (size_t)stages * stage > target->smem_per_block)
        --stages;
    if ((size_t)stages * stage > target->smem_per_block)
        return fm_fail(err, FM_ERR_LIMIT, "the GEMM tile %dx%d needs %zu bytes of shared memory; sm_%d gives a block "
                       "%zu", plan->gemm_bm, plan->gemm_bn, 2 * stage, target->arch, target->smem_per_block);
    plan->gemm_stages = stages;
    plan->smem_bytes = (size_t)stages * stage;
    size_t per_sm = target->smem_per_sm ? target->smem_per_sm : target->smem_per_block;
    int blocks = (int)(per_sm / (plan->smem_bytes + 1024)); /* the driver reserves 1 KB a block */
    plan->blocks_per_sm = blocks < 1 ? 1 : (blocks > 2 ? 2 : blocks);

    plan->act_stride = 16 / plan->elem_bytes; /* fm_common.cuh's activation rows, which this kernel has none of */
    plan->w_offset[l] = 0;
    plan->b_offset[l] = 0;
    plan->w_elems = (size_t)plan->n_pad[l] * (size_t)plan->k_pad[l];
    plan->b_floats = (size_t)fm_gemm_round_up(plan->n_pad[l], 4);
    return FM_OK;
}
