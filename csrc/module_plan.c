/* module_plan.c - the Plan type: Network.plan and Network.gemm_plan make one (fm_plan_make, fm_plan_gemm); it renders
 * the kernel source and describes itself (info). Plan.load, which makes a Kernel of it, is in module_launch.c. */
#include "module_internal.h"

#include <stdlib.h>

/* A Plan of the network for a target: the arch's published limits, with the GPU's own figures where given (> 0). NULL
 * with a Python error (no memory) or with err filled (an unknown arch); the caller plans into it. */
static PlanObject *Plan_new(NetworkObject *self, int arch, Py_ssize_t smem, int sm_count, Py_ssize_t smem_sm,
                            fm_error *err) {
    PlanObject *p = PyObject_New(PlanObject, &PlanType);
    if (p == NULL)
        return NULL;
    Py_INCREF(self);
    p->net = self;
    if (fm_target_for_arch(arch, &p->target, err) != FM_OK) {
        Py_DECREF(p);
        return NULL;
    }
    if (smem > 0)
        p->target.smem_per_block = (size_t)smem;
    if (smem_sm > 0)
        p->target.smem_per_sm = (size_t)smem_sm;
    p->target.sm_count = sm_count;
    return p;
}

PyObject *Network_plan(NetworkObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"arch", "smem_per_block", "sm_count", "in_dtype", "out_dtype", "warps", "m_tiles",
                             "n_chunk", "resident", "smem_per_sm", "precision", "wgmma", "cluster", "kpipe",
                             "k_chunk", "wide_loop", "split", "norm_half", "in_shared", "x_split", NULL};
    int arch, sm_count = 0;
    Py_ssize_t smem = 0, smem_sm = 0;
    const char *in_s = "float32", *out_s = "float32", *prec_s = "float16";
    fm_plan_opts opts = {0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    if (!Network_ready(self) ||
        !PyArg_ParseTupleAndKeywords(args, kwds, "i|niss$iiiinsiiiiiiiii", kwlist, &arch, &smem, &sm_count, &in_s,
                                     &out_s, &opts.warps, &opts.m_tiles, &opts.n_chunk, &opts.resident, &smem_sm,
                                     &prec_s, &opts.wgmma, &opts.cluster, &opts.kpipe, &opts.k_chunk, &opts.wide_loop,
                                     &opts.split, &opts.norm_half, &opts.in_shared, &opts.x_split))
        return NULL;
    fm_dtype in_d, out_d;
    fm_prec prec;
    if (fm_dtype_from_str(in_s, &in_d) < 0 || fm_dtype_from_str(out_s, &out_d) < 0 ||
        fm_prec_from_str(prec_s, &prec) < 0)
        return NULL;
    fm_error err = {0};
    PlanObject *p = Plan_new(self, arch, smem, sm_count, smem_sm, &err);
    if (p != NULL && fm_plan_make(&self->spec, &p->target, &opts, prec, in_d, out_d, &p->plan, &err) == FM_OK)
        return (PyObject *)p;
    Py_XDECREF(p);
    return PyErr_Occurred() ? NULL : fm_raise_clear(&err);
}

PyObject *Network_gemm_plan(NetworkObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"layer", "arch", "smem_per_block", "sm_count", "a0", "a1", "res", "out", "smem_per_sm",
                             "precision", "bm", "bn", "stages", "wgmma", "cluster", "ws", "norm_pass", "pad_pass",
                             "a0_row", "a1_row", "tma", "tma_store", NULL};
    int layer, arch, sm_count, a1, res;
    fm_gemm_opts opts = {0, 0, 0, -1, 0, 0, 0, 0, {0, 0}, 0, 0};
    Py_ssize_t smem, smem_sm = 0;
    const char *a0_s, *out_s, *prec_s = "float16";
    PyObject *a1_o, *res_o;
    if (!Network_ready(self) ||
        !PyArg_ParseTupleAndKeywords(args, kwds, "iinisOOs|$nsiiiiiippiiii", kwlist, &layer, &arch, &smem, &sm_count,
                                     &a0_s, &a1_o, &res_o, &out_s, &smem_sm, &prec_s, &opts.bm, &opts.bn, &opts.stages,
                                     &opts.wgmma, &opts.cluster, &opts.ws, &opts.norm_pass, &opts.pad_pass,
                                     &opts.a_row[0], &opts.a_row[1], &opts.tma, &opts.tma_store))
        return NULL;
    fm_dtype a0, out;
    fm_prec prec;
    if (fm_dtype_from_str(a0_s, &a0) < 0 || fm_dtype_from_str(out_s, &out) < 0 || fm_prec_from_str(prec_s, &prec) < 0 ||
        fm_dtype_or_none(a1_o, &a1) < 0 || fm_dtype_or_none(res_o, &res) < 0)
        return NULL;
    fm_error err = {0};
    PlanObject *p = Plan_new(self, arch, smem, sm_count, smem_sm, &err);
    if (p != NULL &&
        fm_plan_gemm(&self->spec, layer, &p->target, prec, a0, a1, res, out, &opts, &p->plan, &err) == FM_OK)
        return (PyObject *)p;
    Py_XDECREF(p);
    return PyErr_Occurred() ? NULL : fm_raise_clear(&err);
}

static void Plan_dealloc(PlanObject *self) {
    Py_XDECREF(self->net);
    PyObject_Free(self);
}

static PyObject *Plan_render(PlanObject *self, PyObject *args) {
    const char *prelude, *tmpl, *name;
    if (!PyArg_ParseTuple(args, "sss", &prelude, &tmpl, &name))
        return NULL;
    fm_error err = {0};
    fm_str out = {0};
    if (fm_render(&self->net->spec, &self->plan, prelude, tmpl, name, &out, &err) != FM_OK) {
        fm_str_free(&out);
        return fm_raise_clear(&err);
    }
    PyObject *res = PyUnicode_FromStringAndSize(out.data, (Py_ssize_t)out.len);
    fm_str_free(&out);
    return res;
}

static PyObject *Plan_get_info(PlanObject *self, void *closure) {
    (void)closure;
    const fm_plan *p = &self->plan;
    int halved = 0; /* norm layers whose act takes x / 2 (fm_plan.norm_half) */
    for (int l = 0; l < p->num_layers; ++l)
        halved += p->norm_half[l] != 0;
    PyObject *info = Py_BuildValue(
        "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:n,s:i,s:s,s:s,s:s,s:i,s:i}", "arch", p->arch, "wgmma",
        p->wgmma, "cluster", p->cluster, "kpipe", p->kpipe, "warps", p->warps, "m_tiles", p->m_tiles, "rows_per_cta",
        p->rows_per_cta, "resident", p->resident, "stream_slots", p->stream_slots, "buffers", p->buffers,
        "blocks_per_sm", p->blocks_per_sm, "smem_bytes", (Py_ssize_t)p->smem_bytes, "threads", p->warps * 32,
        "in_dtype", fm_dtype_name(p->in_dtype), "out_dtype", fm_dtype_name(p->out_dtype), "precision",
        fm_prec_name(p->prec), "norm_half", halved, "x_split", p->x_split);
    if (info != NULL && p->stream_slots) { /* the streamed form's layers wider than 256 (fm_plan.wide_out, k_chunk) */
        /* tuples: the tuner hashes plan.info's items to tell plans apart */
        Py_ssize_t nwide = 0;
        for (int l = 0; l < p->num_layers; ++l)
            nwide += p->wide_out[l] != 0;
        PyObject *wide = PyTuple_New(nwide), *kc = PyTuple_New(p->num_layers);
        int ok = wide != NULL && kc != NULL;
        for (int l = 0, w = 0; ok && l < p->num_layers; ++l) {
            PyObject *k = PyLong_FromLong(fm_plan_k_chunk(p, l)), *v = p->wide_out[l] ? PyLong_FromLong(l) : NULL;
            ok = k != NULL && (v != NULL || !p->wide_out[l]);
            if (k != NULL)
                PyTuple_SET_ITEM(kc, l, k); /* steals k */
            if (v != NULL)
                PyTuple_SET_ITEM(wide, w++, v);
        }
        PyObject *loop = ok ? PyLong_FromLong(p->wide_loop) : NULL; /* the wide layers' groups as a loop */
        PyObject *split = ok ? PyLong_FromLong(p->split) : NULL;    /* and split over a cluster's CTAs */
        PyObject *shared = ok ? PyLong_FromLong(p->in_shared) : NULL; /* x landing in the wide buffers */
        ok = ok && loop != NULL && split != NULL && shared != NULL &&
             PyDict_SetItemString(info, "wide_layers", wide) == 0 && PyDict_SetItemString(info, "k_chunk", kc) == 0 &&
             PyDict_SetItemString(info, "wide_loop", loop) == 0 && PyDict_SetItemString(info, "split", split) == 0 &&
             PyDict_SetItemString(info, "in_shared", shared) == 0;
        Py_XDECREF(loop);
        Py_XDECREF(split);
        Py_XDECREF(shared);
        Py_XDECREF(wide);
        Py_XDECREF(kc);
        if (!ok) {
            Py_DECREF(info);
            return NULL;
        }
    }
    if (info != NULL && p->gemm) {
        PyObject *g = Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "gemm", 1, "gemm_layer",
                                    p->gemm_layer, "bm", p->gemm_bm, "bn", p->gemm_bn, "stages", p->gemm_stages,
                                    "cluster", p->gemm_cluster, "ws", p->gemm_ws, "norm_pass", p->gemm_norm, "pad_pass",
                                    p->gemm_pad, "a0_row", p->gemm_a_row[0], "a1_row", p->gemm_a_row[1], "tma",
                                    p->gemm_tma, "tma_store", p->gemm_tma_store);
        if (g == NULL || PyDict_Update(info, g) < 0) {
            Py_XDECREF(g);
            Py_DECREF(info);
            return NULL;
        }
        Py_DECREF(g);
    }
    return info;
}

/* The blobs Plan.load uploads, in the plan's layout, for tests that read it back on the host: the weights (floats = 0,
 * fm_plan_pack) or the float blob (floats = 1: biases, a norm layer's gamma and beta by fm_plan_pack_norms, an 8-bit
 * plan's dequantisation factors). */
static PyObject *Plan_packed(PlanObject *self, int floats) {
    const fm_plan *p = &self->plan;
    const size_t bytes = p->w_elems * (size_t)p->elem_bytes, n_floats = p->b_floats ? p->b_floats : 4;
    void *wh = malloc(bytes ? bytes : 1);
    float *bf = calloc(n_floats, sizeof *bf);
    PyObject *res = NULL;
    if (wh == NULL || bf == NULL)
        PyErr_NoMemory();
    else {
        fm_plan_pack(p, (const float *const *)self->net->w, (const float *const *)self->net->b, wh, bf);
        if (floats)
            fm_plan_pack_norms(p, &self->net->spec, bf);
        res = floats ? PyBytes_FromStringAndSize((const char *)bf, (Py_ssize_t)(p->b_floats * sizeof *bf))
                     : PyBytes_FromStringAndSize((const char *)wh, (Py_ssize_t)bytes);
    }
    free(wh);
    free(bf);
    return res;
}

static PyObject *Plan_packed_weights(PlanObject *self, PyObject *unused) {
    (void)unused;
    return Plan_packed(self, 0);
}

static PyObject *Plan_packed_floats(PlanObject *self, PyObject *unused) {
    (void)unused;
    return Plan_packed(self, 1);
}

static PyMethodDef Plan_methods[] = {
    {"render", (PyCFunction)Plan_render, METH_VARARGS, "render(prelude, template, kernel_name) -> CUDA source"},
    {"packed_weights", (PyCFunction)Plan_packed_weights, METH_NOARGS,
     "packed_weights() -> bytes: the weight blob load() puts on the device, in the plan's layout"},
    {"packed_floats", (PyCFunction)Plan_packed_floats, METH_NOARGS,
     "packed_floats() -> bytes: the float32 blob load() puts on the device (biases, norms' gamma and beta, ...)"},
    {"load", (PyCFunction)Plan_load, METH_VARARGS, "load(gpu, cubin, kernel_name) -> Kernel"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Plan_getset[] = {
    {"info", (getter)Plan_get_info, NULL, "dict describing the chosen tiles and budget", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fusedmlp._core.Plan",
    .tp_basicsize = sizeof(PlanObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A kernel plan for one network, target and dtype pair (made by Network.plan).",
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_methods = Plan_methods,
    .tp_getset = Plan_getset,
};
