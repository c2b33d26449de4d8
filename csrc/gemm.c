/* gemm.c - the plan of one layer as a tiled Tensor Core GEMM (kernel_templates/gemm_layer.cu).
 *
 * A network the fused kernels cannot hold (a layer wider than FM_MAX_FUSED_WIDTH, a stretch whose weights fit no CTA
 * or cluster) is cut into segments (python/fusedmlp/_segments.py); a layer no fused segment takes runs as this GEMM,
 * reading its input parts and residual operand from global memory and writing its result once, with the layer's
 * whole epilogue in registers. The plan is an fm_plan with gemm set, so the renderer, the weight packing and the
 * binding's kernel object serve it as they serve the fused plans. */
#include "fm.h"
#include "plan_internal.h"

#include <string.h>

/* fm_gemm_opts.cluster's auto choice for the wgmma form: 1 (one CTA a tile) until clusters of two are measured on an
 * H100 against it (docs/performance.md, "Networks bigger than the chip"); 2 makes them the default. */
enum { FM_GEMM_CLUSTER_AUTO = 1 };
/* fm_gemm_opts.ws's auto choice where fm_gemm_ws_fits (fm_gemm_ws_auto). On the H100 at 2^21 rows rec1024's GEMMs took
 * 22.60 -> 20.28 ms warp-specialised; sdf512's concat layer, whose x part is converted element by element on the way in
 * (259 columns: rows of 518 bytes), 26.35 -> 33.77 ms for the network, its 128 producer threads doing the converting
 * loads that 256 did (docs/performance.md). */
enum { FM_GEMM_WS_AUTO = 1 };
/* fm_gemm_opts.tma_store's auto choice: 1, TMA stores of the staged slabs wherever the persistent form's y allows. On
 * the H100 at 2^21 rows they took rec1024's 1024 x 1024 GEMM 6.70 -> 6.55 ms, its 1024 -> 512 one 3.43 -> 3.37 and
 * sdf512's 512 x 512 2.87 -> 2.79 against the consumers' 16-byte stores (docs/performance.md, "y by TMA stores"). */
enum { FM_GEMM_TMA_STORE_AUTO = 1 };

/* The global dtype holding the compute precision's elements as they are: an 8-bit network's codes, float16 or
 * bfloat16 for those, float32 for tf32 (gemm_layer.cu's fm_a_raw). */
static int fm_gemm_storage(fm_prec p) {
    return fm_prec_is_8bit(p) ? FM_CODES : p == FM_PREC_TF32 ? FM_F32 : (int)p + 1;
}

/* Whether an input part of dtype d and `real` elements a row is copied as it is (cp.async of 16-byte pieces): the
 * compute dtype's storage with 16-byte rows (gemm_layer.cu, fm_a_raw). */
static int fm_gemm_raw_part(const fm_plan *plan, int d, int real) {
    return d == fm_gemm_storage(plan->prec) && real * plan->elem_bytes % 16 == 0;
}

/* Whether every input part of layer l is copied as it is. */
static int fm_gemm_parts_raw(const fm_plan *plan, int l) {
    return fm_gemm_raw_part(plan, (int)plan->in_dtype, fm_gemm_part_row(plan, l, 0)) &&
           (plan->a1_dtype < 0 || fm_gemm_raw_part(plan, plan->a1_dtype, fm_gemm_part_row(plan, l, 1)));
}

/* The auto rule for warp specialisation: the default 128 x 256 tile (smaller ones run several CTAs an SM, which the
 * producer's registers would cut to one for 128 x 128) and every input part copied as it is. */
static int fm_gemm_ws_fits(const fm_plan *plan, int l) {
    return plan->gemm_bm == 128 && plan->gemm_bn == 256 && fm_gemm_parts_raw(plan, l);
}

/* The warp-specialised form where fm_gemm_ws_fits: on a persistent grid (ws=3) for 16-bit layers, else one CTA a tile
 * (ws=1). Each 128 x 256 GEMM of rec1024 and sdf512 in both forms, H100, 2^21 rows, float16 x and y
 * (bench/results/h100-gemm-persistent/): 1024 x 1024 7.89 -> 7.55 ms, 1024 -> 512 4.05 -> 3.84, 512 x 512 3.44 ->
 * 3.33 (and 4-6% at 16384 rows); float8's 1024 x 1024 4.82 -> 5.50, so 8-bit layers keep one CTA a tile. */
static int fm_gemm_ws_auto(const fm_plan *plan, int l) {
    if (!plan->wgmma || plan->gemm_cluster != 1 || !FM_GEMM_WS_AUTO || !fm_gemm_ws_fits(plan, l))
        return 0;
    return fm_prec_is_8bit(plan->prec) ? 1 : 3;
}

/* Whether every input part of layer l has rows of whole 16-byte pieces in its global dtype (sdf512's 259-column x
 * part, 518-byte rows, does not: its element-by-element loads held a producer warpgroup at 5x the plain form's time;
 * the chain gives such a layer x's padded copy, fm_plan.gemm_pad). */
static int fm_gemm_parts_whole(const fm_plan *plan, int l) {
    return fm_gemm_part_row(plan, l, 0) * fm_dtype_size(plan->in_dtype) % 16 == 0 &&
           (plan->a1_dtype < 0 || fm_gemm_part_row(plan, l, 1) * fm_dtype_size((fm_dtype)plan->a1_dtype) % 16 == 0);
}

/* The auto rule for the form in turn (ws=2), from each GEMM of wide512, rec1024 and sdf512 timed in the plain form, the
 * producer form and in turn (H100, 2^21 rows, bench/results/h100-gemm-pingpong/): the wgmma form on one CTA a tile,
 * more than 128 outputs, no residual operand (the form takes none), input rows of whole 16-byte pieces, and
 *  - int8: every such layer (a 512 x 512 layer 3.66 -> 3.25 ms, rec1024's 1024 x 1024 7.13 -> 5.80);
 *  - float8: at most 512 inputs (512 x 512 2.72 -> 1.73; at 1024 inputs the producer form stays ahead, 4.87 against
 *    5.24), and an input converted on the way of at most 128 columns (rec1024's 256-column float16 x: 5.85 in turn,
 *    4.20 plain);
 *  - 16-bit: at most 512 bytes of inputs a row, copied as they are (rec1024's 256 -> 1024 layer 3.67 -> 3.07; its
 *    1024 x 1024 layer 7.88 -> 10.45, each warpgroup's 128-column tile reading A twice as often as 128 x 256). */
static int fm_gemm_pp_auto(const fm_plan *plan, int l, int res) {
    if (!plan->wgmma || plan->gemm_cluster != 1 || plan->n_real[l] <= 128 || res >= 0 || !fm_gemm_parts_whole(plan, l))
        return 0;
    const int raw = fm_gemm_parts_raw(plan, l);
    if (plan->prec == FM_PREC_INT8)
        return 1;
    if (plan->prec == FM_PREC_E4M3)
        return plan->k_real[l] <= 512 && (raw || plan->k_real[l] <= 128);
    return raw && plan->k_real[l] * plan->elem_bytes <= 512;
}

/* The auto form at a tile given explicitly (a small batch's, python/fusedmlp/_segments.py gemm_tile), for 16-bit
 * wgmma layers whose input parts copy as they are: 128 x 128 in turn (ws=2; more than 128 outputs, no residual), a
 * 64-row tile with a producer warpgroup (ws=1); else 0 (the plain form). Each GEMM of rec1024 and sdf512 timed in every
 * tile and form on the H100 at 1024, 4096, 16384 and 2^18 rows (bench/results/h100-gemm-small/gemm_probe.txt):
 * wherever a smaller tile was the fastest, it was in this form (1024 rows: rec1024's 1024 x 1024 layer 64x128 9.44 us
 * with the producer, 12.31 plain; its 1024 -> 512 one 64x64 8.12 against 10.49; 4096 rows: 128x128 in turn 12.71
 * against 14.09). */
static int fm_gemm_small_form(const fm_plan *plan, int l, int res, int bm, int bn) {
    if (!plan->wgmma || plan->gemm_cluster != 1 || fm_prec_is_8bit(plan->prec) || plan->n_real[l] <= 128 ||
        !fm_gemm_parts_raw(plan, l))
        return 0;
    if (bm == 128 && bn == 128)
        return res < 0 ? 2 : 0;
    return bm == 64 ? 1 : 0;
}

/* Whether d is a global dtype code a GEMM of precision p takes: 0 float32, 1 float16, 2 bfloat16, and for an 8-bit
 * network 3, its codes. */
static int fm_gemm_valid_dtype(int d, fm_prec p) {
    return d == FM_F32 || d == FM_F16 || d == FM_BF16 || (d == FM_CODES && fm_prec_is_8bit(p));
}

/* What a GEMM layer's row kernels (its norm layer's second kernel, the pad pass of x) share: layer l alone, eight warps a
 * CTA, no tile, no weights (w_elems a dummy 16 bytes: k_real stays 0, so fm_plan_pack packs none). */
static void fm_plan_row_kernel(fm_plan *plan, int l, const fm_target *target, fm_prec prec, fm_dtype in, fm_dtype out,
                               int res) {
    plan->gemm = 1;
    plan->gemm_layer = l;
    plan->num_layers = l + 1;
    plan->prec = prec;
    plan->elem_bytes = (int)fm_prec_size(prec);
    plan->arch = target->arch;
    plan->in_dtype = in;
    plan->out_dtype = out;
    plan->a1_dtype = -1;
    plan->res_dtype = res;
    plan->gemm_cluster = 1;
    plan->a1_buf[l] = plan->res_buf[l] = -1;
    plan->warps = 8;
    plan->act_stride = 16 / plan->elem_bytes;
    plan->w_elems = (size_t)(16 / plan->elem_bytes);
}

/* The second kernel of norm layer l (fm_plan.gemm_norm): z (dtype a0, the compute dtype's storage the GEMM wrote)
 * normalised over the row, then act, the residual (res: its dtype, -1 none) and post, y in out. Eight warps a CTA, a
 * warp a row; four or two CTAs an SM by the launch bounds, by the registers a row's values take.
 * An 8-bit network's GEMM writes z in float16, which the CPU emulation rounds to as well (fm_spec_z16): float32 z
 * took the H100 30.3 ms for float8 rl1024 at 2^21 rows against float16's 26.3 (its three z round trips, 52 GB). Its
 * weights' codes are of the weights as given, so z keeps a layernorm's common part, and float16 rounds it to 2^-11
 * of |z|: for a row whose mean is 30 times its spread, 1.5% of the spread, about the 8-bit sums' own error. Its
 * residual operand may be codes (times their scale, RSCALE) and its result the next layer's codes (QOUT). */
static fm_status fm_plan_gemm_norm(const fm_spec *spec, int l, const fm_target *target, fm_prec prec, fm_dtype a0,
                                   int a1, int res, fm_dtype out, fm_plan *plan, fm_error *err) {
    if (spec->norm[l] == FM_NORM_NONE)
        return fm_fail(err, FM_ERR_VALUE, "layer %d has no norm: its GEMM has no second kernel", l);
    const int q = fm_prec_is_8bit(prec);
    if (a1 != -1 || !fm_gemm_valid_dtype((int)a0, prec) || a0 == FM_CODES || (q && a0 != FM_F16) ||
        !fm_gemm_valid_dtype((int)out, prec) || (res != -1 && !fm_gemm_valid_dtype(res, prec)))
        return fm_fail(err, FM_ERR_VALUE, "norm pass dtypes z=%d a1=%d res=%d out=%d: z 0 (float32), 1 (float16) or 2 "
                       "(bfloat16), an 8-bit network's 1; res and out those, or 3 (codes) for an 8-bit network; a1 -1 "
                       "(the concat is the GEMM's), res -1 where absent", (int)a0, a1, res, (int)out);
    if ((spec->res_op[l] != FM_RES_NONE) != (res != -1))
        return fm_fail(err, FM_ERR_VALUE, "layer %d %s residual, but res=%d (-1: none)", l,
                       spec->res_op[l] != FM_RES_NONE ? "has a" : "has no", res);
    if ((a0 == FM_BF16 || res == FM_BF16 || out == FM_BF16) && target->arch < 80)
        return fm_fail(err, FM_ERR_LIMIT, "bfloat16 input/output needs sm_80 or newer; the target is sm_%d",
                       target->arch);
    fm_plan_row_kernel(plan, l, target, prec, a0, out, res);
    /* 8-bit: QOUT and RSCALE (fm_render_quant); fm_plan_pack writes the dequantisation factors at dq_offset 0, over
     * the bias, which this kernel does not read (the GEMM added it) */
    fm_plan_take_scales(spec, plan);
    plan->gemm_norm = 1;
    plan->n_real[l] = spec->width[l + 1];
    plan->n_pad[l] = plan->n_chunk[l] = fm_round_up(plan->n_real[l], 8);
    plan->res_op[l] = spec->res_op[l];
    plan->res_src[l] = spec->res_src[l];
    plan->norm[l] = spec->norm[l];
    plan->rows_per_cta = plan->warps;
    /* a lane's values of a row in registers (row_norm.cu's CPL * VE; past 64 it reads the row twice instead): up to
     * 32 fit the 64 registers of four CTAs an SM, more take two CTAs' 128 (NVRTC 13, sm_90a: 1536 float32 columns
     * spilled 24 bytes at 64 registers, 2048 float16 ones 344; at 128, 2048 float32 ones spill 8) */
    const int nr = plan->n_real[l], ve = nr % 8 == 0 ? 8 : nr % 4 == 0 ? 4 : nr % 2 == 0 ? 2 : 1;
    plan->blocks_per_sm = (nr / ve + 31) / 32 * ve <= 32 ? 4 : 2;
    plan->b_floats = (size_t)3 * (size_t)plan->n_pad[l];
    return FM_OK;
}

/* The dtype of the pad pass's copy of x: the compute dtype's storage, or float16 for an 8-bit network's encoded x
 * (its GEMMs quantise a float16 part on the way in, as they do x). */
static fm_dtype fm_gemm_copy_dtype(const fm_spec *spec, fm_prec p) {
    return fm_prec_is_8bit(p) && spec->enc_cols > 0 ? FM_F16 : (fm_dtype)fm_gemm_storage(p);
}

/* Elements a row of the pad pass's copy of x (fm_plan.gemm_pad) for precision p: x's width (an encoding's columns)
 * rounded up to whole 16-byte pieces of the copy's dtype. */
static int fm_gemm_pad_row(const fm_spec *spec, fm_prec p) {
    const int e16 = 16 / (int)fm_dtype_size(fm_gemm_copy_dtype(spec, p));
    return fm_round_up(spec->width[0], e16);
}

/* The pad pass (fm_plan.gemm_pad) of a GEMM layer l that reads x: x (dtype a0) to rows of `row` elements of the
 * compute dtype's storage. A CTA stages rows_per_cta rows of x (contiguous in memory) through shared memory with
 * 16-byte loads, then writes their padded rows in 16-byte pieces. */
static fm_status fm_plan_gemm_pad(const fm_spec *spec, int l, const fm_target *target, fm_prec prec, fm_dtype a0,
                                  int row, fm_plan *plan, fm_error *err) {
    if (prec != FM_PREC_F16 && prec != FM_PREC_BF16 && !(fm_prec_is_8bit(prec) && spec->enc_cols > 0))
        return fm_fail(err, FM_ERR_LIMIT, "the pad pass of x copies it to float16 or bfloat16 rows (or an 8-bit "
                       "network's encoded x to float16 ones); the network computes in %s (its GEMMs convert x on the "
                       "way in)", fm_prec_name(prec));
    if (a0 != FM_F32 && a0 != FM_F16 && a0 != FM_BF16)
        return fm_fail(err, FM_ERR_VALUE, "pad pass x dtype %d: 0 (float32), 1 (float16) or 2 (bfloat16)", (int)a0);
    if (a0 == FM_BF16 && target->arch < 80)
        return fm_fail(err, FM_ERR_LIMIT, "bfloat16 input/output needs sm_80 or newer; the target is sm_%d",
                       target->arch);
    if (row != fm_gemm_pad_row(spec, prec))
        return fm_fail(err, FM_ERR_VALUE, "pad pass a0_row=%d: x's %d features take rows of %d elements (whole "
                       "16-byte pieces of %s)", row, spec->width[0], fm_gemm_pad_row(spec, prec), fm_prec_name(prec));
    const size_t in_row = (size_t)spec->x_features * fm_dtype_size(a0); /* (x as it is: an encoding's features) */
    int rows = 32; /* rows a CTA: 16 KB of float16 x at 259 features; fewer for wide x, down to 8 */
    while (rows > 8 && (size_t)rows * in_row > 48 * 1024)
        rows /= 2;
    if ((size_t)rows * in_row > target->smem_per_block || (size_t)rows * in_row > 200 * 1024)
        return fm_fail(err, FM_ERR_LIMIT, "the pad pass stages %d rows of x (%zu bytes each) in shared memory; sm_%d "
                       "gives a block %zu", rows, in_row, target->arch, target->smem_per_block);
    fm_plan_row_kernel(plan, l, target, prec, a0, fm_gemm_copy_dtype(spec, prec), -1);
    fm_plan_take_scales(spec, plan); /* (an 8-bit network's: its rendered layer's constants, unused by the pass) */
    plan->gemm_pad = 1;
    plan->x_features = spec->x_features;
    plan->gemm_a_row[0] = row;
    plan->rows_per_cta = rows;
    plan->smem_bytes = (size_t)rows * in_row;
    plan->blocks_per_sm = 4;
    plan->b_floats = 4; /* (no biases either: n_pad stays 0) */
    return FM_OK;
}

fm_status fm_plan_gemm(const fm_spec *spec, int l, const fm_target *target, fm_prec prec, fm_dtype a0, int a1,
                       int res, fm_dtype out, const fm_gemm_opts *opts, fm_plan *plan, fm_error *err) {
    const fm_gemm_opts auto_opts = {0, 0, 0, -1, 0, 0, 0, 0, {0, 0}, 0, 0};
    if (opts == NULL)
        opts = &auto_opts;
    const int bm = opts->bm, bn = opts->bn;
    memset(plan, 0, sizeof *plan);
    if (l < 0 || l >= spec->num_layers)
        return fm_fail(err, FM_ERR_VALUE, "layer %d: the network has layers 0..%d", l, spec->num_layers - 1);
    fm_status st = fm_plan_check_prec(spec, target, prec, err); /* (the 8-bit scales among its checks) */
    if (st != FM_OK)
        return st;
    /* An encoded x (fm_spec.enc_*) reaches a GEMM only as the pad pass's copy, which the pass encodes (a0_row /
     * a1_row name the copy's row for the part that is x; no copy in tf32: fm_gemm_copy_dtype); never as a residual
     * operand. */
    const int x_part = l == 0 ? 0 : spec->cat[l] == FM_CAT_AFTER ? 1 : spec->cat[l] == FM_CAT_BEFORE ? 0 : -1;
    if (spec->enc_cols > 0 && !opts->pad_pass && !opts->norm_pass &&
        ((x_part >= 0 && opts->a_row[x_part] <= 0) || (spec->res_op[l] != FM_RES_NONE && spec->res_src[l] == -1))) {
        fm_fail(err, FM_ERR_LIMIT, "layer %d reads x's input encoding (%d columns of %d features) as a GEMM %s, which "
                "no GEMM computes", l, spec->enc_cols, spec->x_features,
                x_part >= 0 && opts->a_row[x_part] <= 0 ? "input part other than the pad pass's encoded copy (float16, "
                "bfloat16 and 8-bit chains)" : "residual operand");
        fm_error_hint(err, "encode x before the model (it then takes %d features), or make every layer reading x fit a "
                      "fused kernel", spec->enc_cols);
        return FM_ERR_LIMIT;
    }
    /* 8-bit: a result in codes (a GEMM's or a row pass's) is the next layer's input, with that layer's scale (the
     * last layer has none) */
    if (out == FM_CODES && l == spec->num_layers - 1)
        return fm_fail(err, FM_ERR_VALUE, "layer %d is the network's last: its result is y (float32, float16 or "
                       "bfloat16), not codes", l);
    if (opts->norm_pass)
        return fm_plan_gemm_norm(spec, l, target, prec, a0, a1, res, out, plan, err);
    if (opts->pad_pass)
        return fm_plan_gemm_pad(spec, l, target, prec, a0, opts->a_row[0], plan, err);
    if (!fm_gemm_valid_dtype((int)a0, prec) || !fm_gemm_valid_dtype((int)out, prec) ||
        (a1 != -1 && !fm_gemm_valid_dtype(a1, prec)) || (res != -1 && !fm_gemm_valid_dtype(res, prec)))
        return fm_fail(err, FM_ERR_VALUE, "GEMM dtypes a0=%d a1=%d res=%d out=%d: each is 0 (float32), 1 (float16), "
                       "2 (bfloat16) or, for an 8-bit network, 3 (its codes); a1 and res -1 where absent", (int)a0, a1,
                       res, (int)out);
    if ((spec->cat[l] != FM_CAT_NONE) != (a1 != -1))
        return fm_fail(err, FM_ERR_VALUE, "layer %d %s input concat, but a1=%d (-1: none)", l,
                       spec->cat[l] != FM_CAT_NONE ? "has an" : "has no", a1);
    if ((spec->res_op[l] != FM_RES_NONE) != (res != -1))
        return fm_fail(err, FM_ERR_VALUE, "layer %d %s residual, but res=%d (-1: none)", l,
                       spec->res_op[l] != FM_RES_NONE ? "has a" : "has no", res);
    if (spec->norm[l] != FM_NORM_NONE)
        return fm_fail(err, FM_ERR_LIMIT, "layer %d has a %s, whose row statistics need all its %d columns at once; "
                       "the GEMM form computes a row in tiles of columns, so it multiplies the layer without its "
                       "norm and a second kernel (norm_pass=1) finishes the rows", l, fm_norm_name(spec->norm[l]),
                       spec->width[l + 1]);
    if ((a0 == FM_BF16 || a1 == FM_BF16 || res == FM_BF16 || out == FM_BF16) && target->arch < 80)
        return fm_fail(err, FM_ERR_LIMIT, "bfloat16 input/output needs sm_80 or newer; the target is sm_%d",
                       target->arch);
    if ((bm != 0 && bm != 64 && bm != 128) || (bn != 0 && bn != 64 && bn != 128 && bn != 256))
        return fm_fail(err, FM_ERR_VALUE, "GEMM tile %dx%d: rows 64 or 128, columns 64, 128 or 256 (0: auto)", bm, bn);

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
    fm_plan_take_scales(spec, plan); /* 8-bit: QIN, QOUT, RSCALE and the dequantisation factors */

    /* sm_90a takes the warpgroup MMA (16- and 8-bit operands; tf32 stays on mma.sync): wgmma.mma_async with both
     * operands from shared memory, as the fused warpgroup kernel's layers. */
    if (opts->wgmma > 0 && (target->arch != 90 || prec == FM_PREC_TF32))
        return fm_fail(err, FM_ERR_LIMIT, "a wgmma GEMM needs sm_90a and a dtype other than tf32 (sm_%d, %s)",
                       target->arch, fm_prec_name(prec));
    plan->wgmma = opts->wgmma >= 0 ? opts->wgmma : target->arch == 90 && prec != FM_PREC_TF32;
    /* Clusters of two CTAs on adjacent row tiles of one column tile, each loading half of every stage's weight tile
     * into both (one TMA multicast): a 128 x 256 stage reads 48 KB from L2 for about 1,024 cycles of MMA, twice what
     * L2 delivers to 132 SMs at that rate; the pair reads B once, 32 KB a stage instead of 64. */
    if (opts->cluster < 0 || opts->cluster > 2)
        return fm_fail(err, FM_ERR_VALUE, "GEMM cluster=%d: 1 (one CTA a tile) or 2 (pairs sharing the weight tile); "
                       "0: auto", opts->cluster);
    if (opts->cluster == 2 && fm_prec_is_8bit(prec))
        return fm_fail(err, FM_ERR_LIMIT, "a GEMM on clusters of 2 is 16-bit only: its %s form has not passed the GPU "
                       "tests (its one run had a bug elsewhere)", fm_prec_name(prec));
    if (opts->cluster == 2 && !plan->wgmma)
        return fm_fail(err, FM_ERR_LIMIT, "a GEMM on clusters of 2 needs the wgmma form (sm_90a, not tf32; "
                       "sm_%d, %s)", target->arch, fm_prec_name(prec));
    plan->gemm_cluster = opts->cluster ? opts->cluster : plan->wgmma ? FM_GEMM_CLUSTER_AUTO : 1;
    /* Warp specialisation: the loads leave the consumers' instruction stream and their waits (every thread of the
     * other forms copies its share of A and B each stage, then meets the others at a barrier). */
    if (opts->ws < -1 || opts->ws > 3)
        return fm_fail(err, FM_ERR_VALUE, "GEMM ws=%d: 1 (a producer warpgroup), 2 (its consumers in turn), 3 (as 1 on "
                       "a persistent grid), -1 (none) or 0 (auto)", opts->ws);
    if (opts->ws >= 1 && (!plan->wgmma || (plan->gemm_cluster > 1 && opts->ws != 3)))
        return fm_fail(err, FM_ERR_LIMIT, "a warp-specialised GEMM (ws=%d) is the wgmma form on one CTA a tile, or "
                       "for ws=3 clusters of 2 (sm_90a, not tf32; sm_%d, %s, cluster %d)", opts->ws, target->arch,
                       fm_prec_name(prec), plan->gemm_cluster);
    if (opts->ws == 2 && res >= 0)
        return fm_fail(err, FM_ERR_LIMIT, "a GEMM in turn (ws=2) takes no residual operand yet: its epilogue's reads "
                       "spill at the 168 registers three warpgroups leave a thread (layer %d)", l);
    if (opts->ws == 2 && (bm == 64 || bn == 256))
        return fm_fail(err, FM_ERR_VALUE, "GEMM tile %dx%d in turn (ws=2): 128 rows a warpgroup, at most 128 columns "
                       "(two m64 MMAs of 128 accumulators a thread)", bm ? bm : 128, bn);
    plan->gemm_ws = opts->ws >= 1 ? opts->ws : 0; /* (auto: below, once the tile is known) */
    /* K in stages of 64 bytes (mma.sync) or 128 (wgmma), each input part padded to whole stages so a stage reads
     * one part. */
    const int kt = (plan->wgmma ? 128 : 64) / plan->elem_bytes;
    const int first = spec->cat[l] == FM_CAT_BEFORE ? 0 : l, second = spec->cat[l] == FM_CAT_AFTER ? 0 : l;
    plan->k_real[l] = fm_spec_in_features(spec, l);
    plan->k0_real[l] = spec->width[first];
    plan->k0_pad[l] = fm_round_up(spec->width[first], kt);
    plan->k_pad[l] = plan->k0_pad[l] + (spec->cat[l] != FM_CAT_NONE ? fm_round_up(spec->width[second], kt) : 0);
    /* a part read from a padded copy (the pad pass's): rows of whole 16-byte pieces, no wider than its K stages */
    for (int p = 0; p < 2; ++p) {
        const int real = fm_gemm_part_width(plan, l, p);
        const int padded = p == 0 ? plan->k0_pad[l] : plan->k_pad[l] - plan->k0_pad[l];
        const int row = opts->a_row[p];
        if (row && (real == 0 || row < real || row > padded))
            return fm_fail(err, FM_ERR_VALUE, "GEMM a%d_row=%d: input part %d has %d features (0: its width; a padded "
                           "copy's rows between that and %d)", p, row, p, real, padded);
        plan->gemm_a_row[p] = row == real ? 0 : row;
    }
    plan->n_real[l] = spec->width[l + 1];
    plan->has_bias[l] = spec->has_bias[l];
    plan->res_op[l] = spec->res_op[l];
    plan->res_src[l] = spec->res_src[l];
    plan->cat[l] = spec->cat[l];
    plan->a1_buf[l] = plan->res_buf[l] = -1;

    /* mma.sync: 128 x 128 tiles of 8 warps (64 x 32 each) by default, 4 stages of 80 KB in all, two CTAs an SM on
     * sm_80..sm_90; a layer of 64 or fewer outputs takes 64 columns (warps 32 x 32), so no tile is mostly padding.
     * wgmma: two warpgroups of 64 rows, each all the tile's columns: 256 for a layer of more than 128 outputs (a
     * warpgroup then reads each A fragment once for 256 columns), else 128 or 64; 4 stages of 128 bytes of K, 192 KB
     * for 128 x 256. */
    /* ws=2: each consumer warpgroup a 128-row tile of its own, two m64 MMAs of up to 128 columns a k step; the auto
     * choice for 8-bit layers of more than 128 outputs at the default tile (fm_gemm_pp_auto) */
    if (opts->ws == 0 && !bm && !bn && fm_gemm_pp_auto(plan, l, res))
        plan->gemm_ws = 2;
    const int small = bm && bn && (bm < 128 || bn < 256); /* a tile smaller than the default 128 x 256, given */
    if (opts->ws == 0 && small)
        plan->gemm_ws = fm_gemm_small_form(plan, l, res, bm, bn);
    const int pp = plan->gemm_ws == 2;
    plan->gemm_bm = bm ? bm : 128;
    plan->gemm_bn = bn ? bn : (plan->n_real[l] <= 64 ? 64 : plan->n_real[l] <= 128 || !plan->wgmma || pp ? 128 : 256);
    if (opts->ws == 0 && !pp && !small)
        plan->gemm_ws = fm_gemm_ws_auto(plan, l);
    const int pc = plan->gemm_ws == 3; /* (known only now: the auto form needs the tile) */
    /* A by tensor maps: a producer warpgroup's thread 0 issues each stage's A rows as one TMA copy, where every part
     * copies as it is (the TMA unit swizzles and zero-fills as the cp.async path does). Auto: wherever it can. Timed on
     * the H100 against the 128 producer threads' cp.async (docs/performance.md, "A by tensor maps"). */
    if (opts->tma < -1 || opts->tma > 1)
        return fm_fail(err, FM_ERR_VALUE, "GEMM tma=%d: 1 (A by tensor maps), -1 (by cp.async) or 0 (auto)", opts->tma);
    const int tma_fits = plan->gemm_ws && fm_gemm_parts_raw(plan, l);
    if (opts->tma == 1 && !tma_fits)
        return fm_fail(err, FM_ERR_LIMIT, "GEMM tma=1 needs a warp-specialised form (ws=%d here) whose input parts are "
                       "the compute dtype's storage with rows of whole 16-byte pieces (layer %d)", plan->gemm_ws, l);
    plan->gemm_tma = opts->tma >= 0 && tma_fits;
    /* y by TMA stores: the persistent form's slabs (16 rows by 128 bytes, an even count a tile) where y's rows are whole
     * 16-byte pieces (the staged store's own condition) */
    if (opts->tma_store < -1 || opts->tma_store > 1)
        return fm_fail(err, FM_ERR_VALUE, "GEMM tma_store=%d: 1 (y by TMA stores), -1 (by the warps' stores) or 0 (auto)",
                       opts->tma_store);
    const int out_b = (int)fm_dtype_size(out), slabs = plan->gemm_bn * out_b / 128;
    const int store_fits = pc && plan->n_real[l] * out_b % 16 == 0 && slabs >= 2 && slabs % 2 == 0;
    if (opts->tma_store == 1 && !store_fits)
        return fm_fail(err, FM_ERR_LIMIT, "GEMM tma_store=1 needs the persistent form (ws=3; ws=%d here) with rows of y "
                       "of whole 16-byte pieces and an even number of 128-byte slabs a tile row (layer %d: %d outputs "
                       "of %d bytes, %d columns a tile)", plan->gemm_ws, l, plan->n_real[l], out_b, plan->gemm_bn);
    plan->gemm_tma_store = store_fits && (opts->tma_store == 1 || (opts->tma_store == 0 && FM_GEMM_TMA_STORE_AUTO));
    plan->warps = pp ? 12 : plan->wgmma ? plan->gemm_bm / 16 + (plan->gemm_ws ? 4 : 0) : 8;
    if (pp)
        plan->gemm_warps_m = 4; /* a warp's rows 16 w.. and 64 + 16 w.. of its warpgroup's tile, all columns */
    else if (plan->wgmma)
        plan->gemm_warps_m = plan->gemm_bm / 16; /* a warp's 16 rows of its warpgroup's 64, all columns */
    else
        plan->gemm_warps_m = plan->gemm_bn == 128 ? (plan->gemm_bm == 128 ? 2 : 1) : (plan->gemm_bm == 128 ? 4 : 2);
    plan->n_pad[l] = fm_round_up(plan->n_real[l], plan->gemm_bn);
    plan->n_chunk[l] = plan->gemm_bn;
    plan->rows_per_cta = plan->gemm_bm;
    plan->m_tiles = plan->gemm_bm / plan->gemm_warps_m / 16;
    plan->resident = 0;

    if (plan->gemm_bn == 256 && !plan->wgmma)
        return fm_fail(err, FM_ERR_VALUE, "GEMM tile columns 256 need the wgmma form (sm_90a, not tf32)");
    /* a stage's A and B rows, and in the cluster form its two mbarriers (full, empty) */
    const size_t stage = (size_t)(plan->gemm_bm + plan->gemm_bn) * (plan->wgmma ? 128 : 64 + 16) +
                         (plan->gemm_cluster > 1 || plan->gemm_ws ? 16 : 0);
    const int least = plan->wgmma ? 3 : 2; /* wgmma keeps two stages ahead of the one it reads */
    if (opts->stages && (opts->stages < least || opts->stages > 8))
        return fm_fail(err, FM_ERR_VALUE, "GEMM stages=%d: %d..8 (0: auto)", opts->stages, least);
    /* Stages: 4 for 128 x 256 wgmma tiles (one CTA an SM; 3 were 4-7% slower) and for mma.sync (two CTAs an SM at
     * 80 KB); 3 for 128 x 128 wgmma tiles, which then fit two CTAs an SM (8% faster than 4 at one). H100, 2^21 rows of
     * wide512 and rec1024: docs/performance.md. */
    int stages = opts->stages ? opts->stages : (plan->wgmma && plan->gemm_bn <= 128 && !pp ? 3 : 4);
    /* ws=2: after the stages, each consumer warp's staged output (its 32 rows of BN outputs, a row padded by 16
     * bytes: gemm_layer.cu's STG_WARP_B); not for float32 y (135 KB for 128 columns), which is stored as it was.
     * ws=3: each consumer warp's 16 rows of 128 bytes of y at a time (a slab), padded by 16 bytes, so that four stages
     * of a 128 x 256 tile fit beside them (tma_store: two unpadded slabs a warp, from the next 1024-byte boundary after
     * the stages and their mbarriers) */
    const int ts = plan->gemm_tma_store;
    const size_t staged = pp && fm_dtype_size(out) <= 2
                              ? (size_t)8 * 32 * ((size_t)plan->gemm_bn * fm_dtype_size(out) + 16)
                              : pc ? (size_t)plan->gemm_bm * (ts ? 2 * 128 : 128 + 16) : 0;
    const size_t align = (plan->wgmma ? 1024 : 0) + staged + (pp ? 16 : 0); /* (pp: two turn mbarriers) */
#define FM_GEMM_SMEM(n) ((size_t)(n) * stage + align + (ts ? (1024 - (size_t)(n) * stage % 1024) % 1024 : 0))
    while (!opts->stages && stages > least && FM_GEMM_SMEM(stages) > target->smem_per_block)
        --stages;
    if (FM_GEMM_SMEM(stages) > target->smem_per_block)
        return fm_fail(err, FM_ERR_LIMIT, "the GEMM tile %dx%d in %d stages needs %zu bytes of shared memory; sm_%d "
                       "gives a block %zu", plan->gemm_bm, plan->gemm_bn, stages, FM_GEMM_SMEM(stages),
                       target->arch, target->smem_per_block);
    plan->gemm_stages = stages;
    plan->smem_bytes = FM_GEMM_SMEM(stages); /* wgmma: room to align the swizzle atoms */
#undef FM_GEMM_SMEM
    size_t per_sm = target->smem_per_sm ? target->smem_per_sm : target->smem_per_block;
    int blocks = (int)(per_sm / (plan->smem_bytes + 1024)); /* the driver reserves 1 KB a block */
    plan->blocks_per_sm = blocks < 1 ? 1 : (blocks > 2 ? 2 : blocks);
    if ((plan->wgmma && plan->gemm_bn > 128) || pp) /* 128 accumulators a thread: two CTAs' threads would spill */
        plan->blocks_per_sm = 1;
    if (plan->gemm_ws) { /* its producer's threads take registers too: BN / 2 accumulators and ~48 more a thread */
        const int need = (plan->gemm_bn / 2 + 48 + 7) / 8 * 8, fit = 65536 / (plan->warps * 32 * need);
        plan->blocks_per_sm = fit < plan->blocks_per_sm ? (fit < 1 ? 1 : fit) : plan->blocks_per_sm;
    }

    plan->act_stride = 16 / plan->elem_bytes; /* fm_common.cuh's activation rows, which this kernel has none of */
    plan->w_offset[l] = 0;
    plan->b_offset[l] = 0;
    plan->w_elems = (size_t)plan->n_pad[l] * (size_t)plan->k_pad[l];
    plan->b_floats = (size_t)fm_round_up(plan->n_pad[l], 4);
    plan->dq_offset[l] = plan->b_floats; /* 8-bit: act_scale[l] * w_scale[l][n] after the bias (fm_plan_pack) */
    if (fm_prec_is_8bit(prec))
        plan->b_floats += (size_t)fm_round_up(plan->n_pad[l], 4);
    return FM_OK;
}
