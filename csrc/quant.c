/* quant.c - 8-bit operands (issue 26): per-output-channel weight scales and a spec's scales with their checks. The
 * codes themselves (fm_quant8, util.c beside the 16-bit roundings) are what the CPU forward (ref.c) and the weight
 * packing (plan.c) both use, so the CPU path rounds as the GPU does. */
#include "fm.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

float fm_quant_weight_scale(const float *row, int k, fm_prec p) {
    double amax = 0.0;
    for (int i = 0; i < k; ++i)
        amax = fabs((double)row[i]) > amax ? fabs((double)row[i]) : amax;
    if (amax == 0.0)
        return 1.0f;
    const float s = (float)(amax / (double)fm_quant_max(p));
    return s < FLT_MIN ? FLT_MIN : s;
}

static void fm_spec_free_scales(fm_spec *spec) {
    for (int l = 0; l < FM_MAX_LAYERS; ++l) {
        free(spec->w_scale[l]);
        spec->w_scale[l] = NULL;
        spec->act_scale[l] = 0.0f;
    }
    spec->quant = FM_PREC_F16;
}

/* The activation scales' rules (fm_spec_set_quant); the weight scales are already set. */
static fm_status fm_spec_check_act_scales(const fm_spec *spec, const float *act_scale, fm_error *err) {
    for (int l = 0; l < spec->num_layers; ++l) {
        const float s = act_scale[l];
        if (!isfinite(s) || s < FLT_MIN)
            return fm_fail(err, FM_ERR_VALUE, "act_scale[%d] is %g; an activation scale must be finite and at least "
                           "%g (float32's smallest normal), so that its inverse is finite too", l, (double)s,
                           (double)FLT_MIN);
        if (spec->cat[l] != FM_CAT_NONE && s != act_scale[0])
            return fm_fail(err, FM_ERR_VALUE, "act_scale[%d] is %g but act_scale[0] is %g; layer %d's input is a "
                           "concat with the network input x, and its two parts share one scale (x's)", l, (double)s,
                           (double)act_scale[0], l);
        /* The kernel multiplies the accumulators by act_scale * w_scale in float32: that must be a normal number. */
        for (int n = 0; n < spec->width[l + 1]; ++n) {
            const double dq = (double)s * (double)spec->w_scale[l][n];
            if (!((float)dq <= FLT_MAX) || (float)dq < FLT_MIN)
                return fm_fail(err, FM_ERR_VALUE, "layer %d, channel %d: act_scale %g times weight scale %g is %g, "
                               "which %s float32; the dequantisation factor must be a normal float32", l, n,
                               (double)s, (double)spec->w_scale[l][n], dq, dq > 1.0 ? "overflows" : "underflows");
        }
    }
    return FM_OK;
}

/* Layer l's weight scales from its weights, allocated once (plans keep pointers to them: fm_plan.w_scale). */
static fm_status fm_spec_weight_scales(fm_spec *spec, fm_prec p, const float *const *w, fm_error *err) {
    for (int l = 0; l < spec->num_layers; ++l) {
        const int n_out = spec->width[l + 1], k_in = fm_spec_in_features(spec, l);
        spec->w_scale[l] = malloc(sizeof(float) * (size_t)n_out);
        if (spec->w_scale[l] == NULL) {
            fm_spec_free_scales(spec);
            return fm_fail(err, FM_ERR_NOMEM, "out of memory for layer %d's weight scales", l);
        }
        for (int n = 0; n < n_out; ++n)
            spec->w_scale[l][n] = fm_quant_weight_scale(w[l] + (size_t)n * (size_t)k_in, k_in, p);
    }
    spec->quant = p;
    return FM_OK;
}

fm_status fm_spec_set_quant(fm_spec *spec, fm_prec p, const float *const *w, const float *act_scale, fm_error *err) {
    if (p != FM_PREC_F16 && !fm_prec_is_8bit(p))
        return fm_fail(err, FM_ERR_VALUE, "quantisation precision %d is not int8 (%d) or float8 (%d)", (int)p,
                       (int)FM_PREC_INT8, (int)FM_PREC_E4M3);
    /* The same precision again (a calibration): the weights, so their scales, are unchanged, and plans made before
     * keep valid pointers to them; only the activation scales change, and a refused set leaves the old ones. */
    if (p != spec->quant) {
        fm_spec_free_scales(spec);
        if (p == FM_PREC_F16)
            return FM_OK;
        fm_status st = fm_spec_weight_scales(spec, p, w, err);
        if (st != FM_OK)
            return st;
    }
    if (p == FM_PREC_F16)
        return FM_OK;
    if (act_scale == NULL) {
        memset(spec->act_scale, 0, sizeof spec->act_scale);
        return FM_OK;
    }
    fm_status st = fm_spec_check_act_scales(spec, act_scale, err);
    if (st == FM_OK)
        memcpy(spec->act_scale, act_scale, sizeof(float) * (size_t)spec->num_layers);
    return st;
}

fm_status fm_spec_check_calibrated(const fm_spec *spec, const char *what, fm_error *err) {
    if (!fm_prec_is_8bit(spec->quant) || spec->act_scale[0] > 0.0f)
        return FM_OK;
    fm_fail(err, FM_ERR_VALUE, "%s: dtype='%s' needs an activation scale per layer, and this model has none yet",
            what, fm_prec_name(spec->quant));
    fm_error_hint(err, "call mlp.calibrate(x_sample) with a batch of typical inputs first (or pass calibrate=x to "
                       "fusedmlp.torch.from_torch)");
    return FM_ERR_VALUE;
}
