/* module_network.c - the Network type: a validated fm_spec with the binding's own copy of the float32 weights, its
 * widths and activations, and the CPU forward (fm_ref_forward, the GIL released). Its plan methods are in
 * module_plan.c. */
#include "module_internal.h"

#include <stdlib.h>
#include <string.h>

static void Network_release(NetworkObject *self) {
    for (int l = 0; l < FM_MAX_LAYERS; ++l) {
        PyMem_RawFree(self->w[l]);
        PyMem_RawFree(self->b[l]);
        self->w[l] = self->b[l] = NULL;
    }
    if (self->has_spec)
        fm_spec_free(&self->spec);
    self->has_spec = 0;
}

/* Copies the float32 arrays into owned memory: later changes to the caller's arrays must not change the model. */
static int Network_copy_arrays(NetworkObject *self, PyObject *weights, PyObject *biases, Py_ssize_t n) {
    for (Py_ssize_t l = 0; l < n; ++l) {
        PyArrayObject *w = fm_array(PyList_GET_ITEM(weights, l), NPY_FLOAT32, 2, "weights[l]");
        if (w == NULL)
            return -1;
        size_t bytes = (size_t)PyArray_NBYTES(w);
        self->w[l] = PyMem_RawMalloc(bytes ? bytes : 1);
        if (self->w[l] != NULL)
            memcpy(self->w[l], PyArray_DATA(w), bytes);
        Py_DECREF(w);
        if (self->w[l] == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        PyObject *bobj = PyList_GET_ITEM(biases, l);
        if (bobj == Py_None)
            continue;
        PyArrayObject *b = fm_array(bobj, NPY_FLOAT32, 1, "biases[l]");
        if (b == NULL)
            return -1;
        bytes = (size_t)PyArray_NBYTES(b);
        self->b[l] = PyMem_RawMalloc(bytes ? bytes : 1);
        if (self->b[l] != NULL)
            memcpy(self->b[l], PyArray_DATA(b), bytes);
        Py_DECREF(b);
        if (self->b[l] == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

/* residuals: a list with, per layer, None or (op, post, src): op 1 = add, 2 = mul with value src (-1: the network
 * input, l - 1: the layer's own input, k: layer k's output). */
static int Network_set_residuals(NetworkObject *self, PyObject *residuals, Py_ssize_t n) {
    if (!PyList_Check(residuals) || PyList_GET_SIZE(residuals) != n) {
        PyErr_Format(PyExc_TypeError, "residuals must be a list with one entry per layer (%zd)", n);
        return -1;
    }
    for (Py_ssize_t l = 0; l < n; ++l) {
        PyObject *item = PyList_GET_ITEM(residuals, l);
        if (item == Py_None)
            continue;
        int op, src;
        PyObject *post_obj;
        if (!PyArg_ParseTuple(item, "iUi", &op, &post_obj, &src))
            return -1;
        const char *post = fm_text(post_obj, "residual activation");
        if (post == NULL)
            return -1;
        fm_error err = {0};
        if (fm_spec_set_residual(&self->spec, (int)l, op, post, src, &err) != FM_OK) {
            fm_raise_clear(&err);
            return -1;
        }
    }
    return 0;
}

/* norms: a list with, per layer, None or (kind, eps, weight, bias): kind 1 = layernorm, 2 = rmsnorm (FM_NORM_*), eps a
 * float, weight and bias None or 1-D float32 arrays (the layer's output width; fm_spec_set_norm checks). */
static int Network_set_norms(NetworkObject *self, PyObject *norms, Py_ssize_t n) {
    if (!PyList_Check(norms) || PyList_GET_SIZE(norms) != n) {
        PyErr_Format(PyExc_TypeError, "norms must be a list with one entry per layer (%zd)", n);
        return -1;
    }
    for (Py_ssize_t l = 0; l < n; ++l) {
        PyObject *item = PyList_GET_ITEM(norms, l), *wobj, *bobj;
        if (item == Py_None)
            continue;
        int kind;
        double eps;
        if (!PyArg_ParseTuple(item, "idOO", &kind, &eps, &wobj, &bobj))
            return -1;
        PyArrayObject *w = NULL, *b = NULL;
        if (wobj != Py_None && (w = fm_array(wobj, NPY_FLOAT32, 1, "norm weight")) == NULL)
            return -1;
        if (bobj != Py_None && (b = fm_array(bobj, NPY_FLOAT32, 1, "norm bias")) == NULL) {
            Py_XDECREF(w);
            return -1;
        }
        fm_error err = {0};
        fm_status st = fm_spec_set_norm(&self->spec, (int)l, kind, eps, w ? (const float *)PyArray_DATA(w) : NULL,
                                        w ? (int64_t)PyArray_SIZE(w) : -1, b ? (const float *)PyArray_DATA(b) : NULL,
                                        b ? (int64_t)PyArray_SIZE(b) : -1, &err);
        Py_XDECREF(w);
        Py_XDECREF(b);
        if (st != FM_OK) {
            fm_raise_clear(&err);
            return -1;
        }
    }
    return 0;
}

/* encoding: (x_features, columns), columns a list of (src, sin, scale, phase), one per layer 0 input
 * (fm_spec_set_encoding checks them). */
static int Network_set_encoding(NetworkObject *self, PyObject *encoding) {
    int x_features;
    PyObject *cols;
    if (!PyArg_ParseTuple(encoding, "iO!", &x_features, &PyList_Type, &cols))
        return -1;
    const Py_ssize_t n = PyList_GET_SIZE(cols);
    if (n < 1 || n > 4 * FM_MAX_FUSED_WIDTH) {
        PyErr_Format(PyExc_ValueError, "an input encoding of %zd columns; 1..%d", n, 4 * FM_MAX_FUSED_WIDTH);
        return -1;
    }
    int src[4 * FM_MAX_FUSED_WIDTH], sin[4 * FM_MAX_FUSED_WIDTH];
    float scale[4 * FM_MAX_FUSED_WIDTH], phase[4 * FM_MAX_FUSED_WIDTH];
    for (Py_ssize_t j = 0; j < n; ++j) {
        double c, p;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(cols, j), "iidd", &src[j], &sin[j], &c, &p))
            return -1;
        scale[j] = (float)c;
        phase[j] = (float)p;
    }
    fm_error err = {0};
    if (fm_spec_set_encoding(&self->spec, x_features, (int)n, src, sin, scale, phase, &err) != FM_OK) {
        fm_raise_clear(&err);
        return -1;
    }
    return 0;
}

static int Network_init(NetworkObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"weights", "biases", "activations", "residuals", "concat", "norms", "encoding", NULL};
    PyObject *weights, *biases, *acts, *residuals = Py_None, *concat = Py_None, *norms = Py_None,
             *encoding = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!|OOOO", kwlist, &PyList_Type, &weights, &PyList_Type,
                                     &biases, &PyList_Type, &acts, &residuals, &concat, &norms, &encoding))
        return -1;
    Network_release(self);
    Py_ssize_t n = PyList_GET_SIZE(weights);
    if (n < 1 || n > FM_MAX_LAYERS || PyList_GET_SIZE(biases) != n || PyList_GET_SIZE(acts) != n) {
        PyErr_Format(PyExc_ValueError, "a network needs 1..%d layers and one bias and activation per layer", FM_MAX_LAYERS);
        return -1;
    }
    int64_t shapes[2 * FM_MAX_LAYERS], bias_len[FM_MAX_LAYERS];
    int cat[FM_MAX_LAYERS] = {0};
    const char *act_text[FM_MAX_LAYERS];
    if (concat != Py_None) { /* one FM_CAT_* per layer */
        if (!PyList_Check(concat) || PyList_GET_SIZE(concat) != n) {
            PyErr_Format(PyExc_TypeError, "concat must be a list with one mode per layer (%zd)", n);
            return -1;
        }
        for (Py_ssize_t l = 0; l < n; ++l) {
            long mode = PyLong_AsLong(PyList_GET_ITEM(concat, l));
            if (mode == -1 && PyErr_Occurred())
                return -1;
            cat[l] = mode < 0 || mode > 2 ? 99 : (int)mode; /* fm_spec_init reports the bad mode */
        }
    }
    for (Py_ssize_t l = 0; l < n; ++l) {
        PyArrayObject *w = fm_array(PyList_GET_ITEM(weights, l), NPY_FLOAT32, 2, "weights[l]");
        if (w == NULL)
            return -1;
        shapes[2 * l] = PyArray_DIM(w, 0);
        shapes[2 * l + 1] = PyArray_DIM(w, 1);
        Py_DECREF(w);
        PyObject *b = PyList_GET_ITEM(biases, l);
        bias_len[l] = b == Py_None ? -1 : (PyArray_Check(b) ? PyArray_SIZE((PyArrayObject *)b) : -2);
        act_text[l] = fm_text(PyList_GET_ITEM(acts, l), "activation");
        if (act_text[l] == NULL)
            return -1;
    }
    fm_error err = {0};
    if (fm_spec_init(&self->spec, (int)n, shapes, bias_len, act_text, cat, &err) != FM_OK) {
        fm_raise_clear(&err);
        return -1;
    }
    self->has_spec = 1;
    if ((residuals != Py_None && Network_set_residuals(self, residuals, n) < 0) ||
        (norms != Py_None && Network_set_norms(self, norms, n) < 0) ||
        (encoding != Py_None && Network_set_encoding(self, encoding) < 0)) {
        Network_release(self);
        return -1;
    }
    if (Network_copy_arrays(self, weights, biases, n) < 0) {
        Network_release(self);
        return -1;
    }
    fm_spec_bound_preacts(&self->spec, (const float *const *)self->w, (const float *const *)self->b);
    fm_spec_find_blocks(&self->spec, (const float *const *)self->w);
    return 0;
}

static void Network_dealloc(NetworkObject *self) {
    Network_release(self);
    PyMem_Free(self->kernels);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

int Network_add_kernel(NetworkObject *self, PyObject *kernel) {
    if (self->n_kernels == self->cap_kernels) {
        const Py_ssize_t cap = self->cap_kernels ? 2 * self->cap_kernels : 8;
        PyObject **grown = PyMem_Realloc(self->kernels, (size_t)cap * sizeof *grown);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->kernels = grown;
        self->cap_kernels = cap;
    }
    self->kernels[self->n_kernels++] = kernel;
    return 0;
}

void Network_drop_kernel(NetworkObject *self, PyObject *kernel) {
    for (Py_ssize_t i = 0; i < self->n_kernels; ++i)
        if (self->kernels[i] == kernel) {
            self->kernels[i] = self->kernels[--self->n_kernels];
            return;
        }
}

/* NULL where other describes the same network as self but for its weights, biases, norm parameters and 8-bit weight
 * scales (what Network.assign takes over), else what differs. */
static const char *Network_other_shape(const NetworkObject *self, const NetworkObject *other) {
    const fm_spec *a = &self->spec, *b = &other->spec;
    if (a->num_layers != b->num_layers || a->x_features != b->x_features || a->enc_cols != b->enc_cols)
        return "another number of layers or input features";
    for (int l = 0; l < a->num_layers; ++l) {
        if (a->width[l + 1] != b->width[l + 1] || a->width[l] != b->width[l] || a->cat[l] != b->cat[l])
            return "another layer shape or concat";
        if ((self->b[l] == NULL) != (other->b[l] == NULL))
            return "a bias present in one and not the other";
        if (a->res_op[l] != b->res_op[l] || (a->res_op[l] != FM_RES_NONE && a->res_src[l] != b->res_src[l]))
            return "another residual";
        if (a->norm[l] != b->norm[l] || a->norm_eps[l] != b->norm_eps[l])
            return "another norm or eps";
        if (a->act_pieces[l] != b->act_pieces[l])
            return "another activation";
        fm_str ta = {0}, tb = {0};
        fm_spec_act_string(a, l, &ta);
        fm_spec_act_string(b, l, &tb);
        const int same_act = ta.data != NULL && tb.data != NULL && strcmp(ta.data, tb.data) == 0;
        fm_str_free(&ta);
        fm_str_free(&tb);
        if (!same_act)
            return "another activation";
    }
    if (a->quant != b->quant)
        return "another 8-bit precision";
    for (int l = 0; fm_prec_is_8bit(a->quant) && l < a->num_layers; ++l)
        if (a->act_scale[l] != b->act_scale[l])
            return "other activation scales";
    return NULL;
}

/* A norm's gamma or beta array (*dst: n floats owned by the spec, or NULL: all `none`) where src has one: made with
 * the value it stands for, so that a CPU forward on another thread reading it meanwhile sees the same network. */
static int Network_norm_array(float **dst, const float *src, size_t n, float none) {
    if (*dst != NULL || src == NULL)
        return 0;
    float *made = malloc(n * sizeof(float));
    if (made == NULL)
        return -1;
    for (size_t i = 0; i < n; ++i)
        made[i] = none;
    *dst = made;
    return 0;
}

/* src's values into a norm's gamma or beta array (NULL src: all `none`); in place, never freed (as above). */
static void Network_norm_values(float *dst, const float *src, size_t n, float none) {
    for (size_t i = 0; dst != NULL && i < n; ++i)
        dst[i] = src != NULL ? src[i] : none;
}

/* assign(other) -> bool: takes over other's weights, biases, norm parameters and 8-bit weight scales, other being
 * the same network but for them (FusedMLP.set_weights builds it from the model's own description). Where every
 * layer's fm_render_weight_key stays, the source of every plan stays too: the kernels loaded from this network's
 * plans then get the new packed weights in their own device buffers (after every stream's work so far), so launches
 * and CUDA graphs made before read them, and it returns True. Else it returns False, and the caller drops those
 * kernels. */
static PyObject *Network_assign(NetworkObject *self, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &NetworkType))
        return PyErr_Format(PyExc_TypeError, "assign takes a Network, not %s", Py_TYPE(arg)->tp_name);
    NetworkObject *other = (NetworkObject *)arg;
    if (!Network_ready(self) || !Network_ready(other))
        return NULL;
    const char *why = Network_other_shape(self, other);
    if (why != NULL)
        return PyErr_Format(PyExc_ValueError, "assign: the other network has %s", why);
    fm_spec *a = &self->spec;
    const fm_spec *b = &other->spec;
    for (int l = 0; l < a->num_layers; ++l) /* (first what may fail: then nothing has changed) */
        if (Network_norm_array(&a->norm_w[l], b->norm_w[l], (size_t)a->width[l + 1], 1.0f) < 0 ||
            Network_norm_array(&a->norm_b[l], b->norm_b[l], (size_t)a->width[l + 1], 0.0f) < 0)
            return PyErr_NoMemory();
    int same = 1;
    for (int l = 0; l < a->num_layers; ++l) {
        same = same && fm_render_weight_key(a, l) == fm_render_weight_key(b, l);
        const size_t n = (size_t)a->width[l + 1];
        memcpy(self->w[l], other->w[l], n * (size_t)fm_spec_in_features(a, l) * sizeof(float));
        if (self->b[l] != NULL)
            memcpy(self->b[l], other->b[l], n * sizeof(float));
        Network_norm_values(a->norm_w[l], b->norm_w[l], n, 1.0f);
        Network_norm_values(a->norm_b[l], b->norm_b[l], n, 0.0f);
        if (fm_prec_is_8bit(a->quant)) /* (in place: plans keep pointers to them) */
            memcpy(a->w_scale[l], b->w_scale[l], n * sizeof(float));
        a->z_bound[l] = b->z_bound[l];
        a->blocks[l] = b->blocks[l];
    }
    if (!same)
        Py_RETURN_FALSE;
    /* (a snapshot: the list may change while the GIL is released) */
    const Py_ssize_t n = self->n_kernels;
    PyObject **kernels = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *kernels);
    if (kernels == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; ++i) {
        kernels[i] = self->kernels[i];
        Py_INCREF(kernels[i]);
    }
    fm_error err = {0};
    fm_status st = FM_OK;
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < n && st == FM_OK; ++i) st = Kernel_upload(kernels[i], &err);
    Py_END_ALLOW_THREADS for (Py_ssize_t i = 0; i < n; ++i) Py_DECREF(kernels[i]);
    PyMem_Free(kernels);
    if (st != FM_OK)
        return fm_raise_clear(&err);
    Py_RETURN_TRUE;
}

int Network_ready(NetworkObject *self) {
    if (!self->has_spec) {
        PyErr_SetString(PyExc_RuntimeError, "Network is not initialised");
        return 0;
    }
    return 1;
}

/* preact_bounds() -> [float]: per layer, the weights' bound on |W h + b| over every input (inf: none). */
static PyObject *Network_preact_bounds(NetworkObject *self, PyObject *unused) {
    (void)unused;
    if (!Network_ready(self))
        return NULL;
    PyObject *list = PyList_New(self->spec.num_layers);
    for (int l = 0; list != NULL && l < self->spec.num_layers; ++l) {
        PyObject *v = PyFloat_FromDouble(self->spec.z_bound[l]);
        if (v == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, l, v);
    }
    return list;
}

/* x as the CPU forward takes it: an aligned 2-D float32 array of the network's input width (NULL with an error). */
static PyArrayObject *Network_input(NetworkObject *self, PyObject *xobj) {
    if (!PyArray_Check(xobj) || PyArray_TYPE((PyArrayObject *)xobj) != NPY_FLOAT32 ||
        PyArray_NDIM((PyArrayObject *)xobj) != 2 || !PyArray_ISALIGNED((PyArrayObject *)xobj)) {
        PyErr_SetString(PyExc_TypeError, "x must be an aligned 2-D float32 array");
        return NULL;
    }
    PyArrayObject *x = (PyArrayObject *)xobj;
    if (PyArray_DIM(x, 1) != self->spec.x_features) {
        PyErr_Format(PyExc_ValueError, "x has %zd features; the network takes %d", (Py_ssize_t)PyArray_DIM(x, 1),
                     self->spec.x_features);
        return NULL;
    }
    return x;
}

/* The CPU forward of x into y (quant: fm_ref_forward_ex's; amax: NULL or L + 1 doubles), the GIL released. */
static int Network_run_cpu(NetworkObject *self, PyArrayObject *x, float *y, int quant, double *amax) {
    fm_error err = {0};
    fm_status st;
    int64_t srow = PyArray_STRIDE(x, 0) / 4, scol = PyArray_STRIDE(x, 1) / 4, rows = PyArray_DIM(x, 0);
    Py_BEGIN_ALLOW_THREADS st = fm_ref_forward_ex(&self->spec, (const float *const *)self->w,
                                                  (const float *const *)self->b, PyArray_DATA(x), rows, srow, scol,
                                                  y, quant, amax, &err);
    Py_END_ALLOW_THREADS if (st != FM_OK) {
        fm_raise_clear(&err);
        return -1;
    }
    return 0;
}

/* forward_cpu(x: float32 (rows, in) array, any strides, quantised=None) -> float32 (rows, out) array. quantised:
 * None emulates the network's 8-bit quantisation where it has one, False computes in float32 storage regardless. */
static PyObject *Network_forward_cpu(NetworkObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"x", "quantised", NULL};
    PyObject *xobj, *qobj = Py_None;
    if (!Network_ready(self) || !PyArg_ParseTupleAndKeywords(args, kwds, "O|O", kwlist, &xobj, &qobj))
        return NULL;
    PyArrayObject *x = Network_input(self, xobj);
    if (x == NULL)
        return NULL;
    int quant = fm_prec_is_8bit(self->spec.quant);
    if (qobj != Py_None && (quant = PyObject_IsTrue(qobj)) < 0)
        return NULL;
    npy_intp dims[2] = {PyArray_DIM(x, 0), self->spec.width[self->spec.num_layers]};
    PyArrayObject *y = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_FLOAT32);
    if (y == NULL)
        return NULL;
    if (Network_run_cpu(self, x, PyArray_DATA(y), quant, NULL) < 0) {
        Py_DECREF(y);
        return NULL;
    }
    return (PyObject *)y;
}

/* amax(x) -> tuple of L + 1 floats: max |v| over x's rows of each value v = -1 (x) .. L-1 as the float forward
 * (no quantisation) stores it; NaN where an element was NaN. What calibrate scales from. */
static PyObject *Network_amax(NetworkObject *self, PyObject *xobj) {
    if (!Network_ready(self))
        return NULL;
    PyArrayObject *x = Network_input(self, xobj);
    if (x == NULL)
        return NULL;
    const int L = self->spec.num_layers;
    size_t ybytes = sizeof(float) * (size_t)PyArray_DIM(x, 0) * (size_t)self->spec.width[L];
    float *y = PyMem_RawMalloc(ybytes ? ybytes : 1);
    if (y == NULL)
        return PyErr_NoMemory();
    double amax[FM_MAX_LAYERS + 1];
    int rc = Network_run_cpu(self, x, y, 0, amax);
    PyMem_RawFree(y);
    if (rc < 0)
        return NULL;
    PyObject *t = PyTuple_New(L + 1);
    for (int v = 0; t != NULL && v <= L; ++v) {
        PyObject *f = PyFloat_FromDouble(amax[v]);
        if (f == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, v, f);
    }
    return t;
}

/* set_quant(precision, act_scales=None): 'int8' or 'float8' makes the network 8-bit (weight scales from its weights;
 * act_scales: None, not calibrated, or one float per layer), 'float16' undoes it (fm_spec_set_quant's rules). */
static PyObject *Network_set_quant(NetworkObject *self, PyObject *args) {
    const char *prec_s;
    PyObject *scales_obj = Py_None;
    if (!Network_ready(self) || !PyArg_ParseTuple(args, "s|O", &prec_s, &scales_obj))
        return NULL;
    fm_prec prec;
    if (fm_prec_from_str(prec_s, &prec) < 0)
        return NULL;
    float scales[FM_MAX_LAYERS];
    const int L = self->spec.num_layers;
    if (scales_obj != Py_None) {
        PyObject *seq = PySequence_Fast(scales_obj, "act_scales must be a sequence of floats");
        if (seq == NULL)
            return NULL;
        if (PySequence_Fast_GET_SIZE(seq) != L) {
            PyErr_Format(PyExc_ValueError, "act_scales has %zd entries; the network has %d layers",
                         PySequence_Fast_GET_SIZE(seq), L);
            Py_DECREF(seq);
            return NULL;
        }
        for (int l = 0; l < L; ++l) {
            double v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, l));
            if (v == -1.0 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return NULL;
            }
            scales[l] = (float)v;
        }
        Py_DECREF(seq);
    }
    fm_error err = {0};
    if (fm_spec_set_quant(&self->spec, prec == FM_PREC_BF16 || prec == FM_PREC_TF32 ? FM_PREC_F16 : prec,
                          (const float *const *)self->w, scales_obj == Py_None ? NULL : scales, &err) != FM_OK)
        return fm_raise_clear(&err);
    Py_RETURN_NONE;
}

/* quant8_value(v, precision) -> float: the value of v's 8-bit code (fm_quant8, then fm_dequant8), v already divided by
 * its scale: what the kernels and the CPU path store. A static method (the module's own function table is
 * module.c's), for tests and tools that check the roundings. */
static PyObject *Network_quant8_value(PyObject *unused, PyObject *args) {
    (void)unused;
    double v;
    const char *prec_s;
    fm_prec prec;
    if (!PyArg_ParseTuple(args, "ds", &v, &prec_s) || fm_prec_from_str(prec_s, &prec) < 0)
        return NULL;
    if (!fm_prec_is_8bit(prec))
        return PyErr_Format(PyExc_ValueError, "quant8_value takes 'int8' or 'float8', not '%s'", prec_s);
    return PyFloat_FromDouble((double)fm_dequant8(fm_quant8((float)v, prec), prec));
}

/* The network's 8-bit scales: (precision name, act_scales tuple or None, [float32 weight-scale arrays]); None when
 * it is not an 8-bit network. */
static PyObject *Network_get_quant(NetworkObject *self, void *closure) {
    (void)closure;
    if (!Network_ready(self))
        return NULL;
    if (!fm_prec_is_8bit(self->spec.quant))
        Py_RETURN_NONE;
    const int L = self->spec.num_layers;
    PyObject *acts = Py_None, *ws = PyList_New(L);
    Py_INCREF(acts);
    if (ws != NULL && self->spec.act_scale[0] > 0.0f) {
        Py_DECREF(acts);
        acts = PyTuple_New(L);
        for (int l = 0; acts != NULL && l < L; ++l) {
            PyObject *f = PyFloat_FromDouble((double)self->spec.act_scale[l]);
            if (f == NULL) {
                Py_CLEAR(acts);
                break;
            }
            PyTuple_SET_ITEM(acts, l, f);
        }
    }
    for (int l = 0; ws != NULL && acts != NULL && l < L; ++l) {
        npy_intp n = self->spec.width[l + 1];
        PyArrayObject *a = (PyArrayObject *)PyArray_SimpleNew(1, &n, NPY_FLOAT32);
        if (a == NULL) {
            Py_CLEAR(ws);
            break;
        }
        memcpy(PyArray_DATA(a), self->spec.w_scale[l], sizeof(float) * (size_t)n);
        PyList_SET_ITEM(ws, l, (PyObject *)a);
    }
    PyObject *res =
        ws != NULL && acts != NULL ? Py_BuildValue("(sOO)", fm_prec_name(self->spec.quant), acts, ws) : NULL;
    Py_XDECREF(acts);
    Py_XDECREF(ws);
    return res;
}

static PyObject *Network_get_widths(NetworkObject *self, void *closure) {
    (void)closure;
    if (!Network_ready(self))
        return NULL;
    PyObject *t = PyTuple_New(self->spec.num_layers + 1);
    for (int l = 0; t && l <= self->spec.num_layers; ++l)
        PyTuple_SET_ITEM(t, l, PyLong_FromLong(self->spec.width[l]));
    return t;
}

static PyObject *Network_get_x_features(NetworkObject *self, void *closure) {
    (void)closure;
    return Network_ready(self) ? PyLong_FromLong(self->spec.x_features) : NULL;
}

static PyObject *Network_get_activations(NetworkObject *self, void *closure) {
    (void)closure;
    if (!Network_ready(self))
        return NULL;
    PyObject *t = PyTuple_New(self->spec.num_layers);
    for (int l = 0; t && l < self->spec.num_layers; ++l) {
        fm_str s = {0};
        fm_spec_act_string(&self->spec, l, &s);
        PyTuple_SET_ITEM(t, l, PyUnicode_FromString(s.data ? s.data : ""));
        fm_str_free(&s);
    }
    return t;
}

static PyMethodDef Network_methods[] = {
    {"assign", (PyCFunction)Network_assign, METH_O,
     "assign(other) -> bool: other's weights, biases, norm parameters and 8-bit weight scales (the same network but "
     "for them) into this one; True where the kernels loaded from its plans keep their source and got them in place, "
     "False where their source changes (drop them)."},
    {"forward_cpu", (PyCFunction)(void (*)(void))Network_forward_cpu, METH_VARARGS | METH_KEYWORDS,
     "forward_cpu(x, quantised=None) -> y: the CPU forward (float64 accumulate; an 8-bit network emulated unless "
     "quantised=False)."},
    {"amax", (PyCFunction)Network_amax, METH_O,
     "amax(x) -> (max|x|, max|layer 0's output|, ...): the float forward's value ranges (calibration)."},
    {"quant8_value", (PyCFunction)Network_quant8_value, METH_VARARGS | METH_STATIC,
     "quant8_value(v, precision) -> float: v rounded to its int8 / float8 code's value (v already scaled)."},
    {"set_quant", (PyCFunction)Network_set_quant, METH_VARARGS,
     "set_quant(precision, act_scales=None): make the network int8/float8 (or 'float16': not) with these scales."},
    {"preact_bounds", (PyCFunction)Network_preact_bounds, METH_NOARGS,
     "preact_bounds() -> [float]: per layer, a bound on |W h + b| for every input (inf: none known)."},
    {"plan", (PyCFunction)(void (*)(void))Network_plan, METH_VARARGS | METH_KEYWORDS,
     "plan(arch, smem_per_block=0, sm_count=0, in_dtype='float32', out_dtype='float32', warps=0, m_tiles=0, "
     "n_chunk=0, resident=-1, smem_per_sm=0, precision='float16', wgmma=-1, cluster=0, kpipe=0, k_chunk=0, "
     "wide_loop=0, split=0, norm_half=0, in_shared=0, x_split=0) -> Plan"},
    {"gemm_plan", (PyCFunction)(void (*)(void))Network_gemm_plan, METH_VARARGS | METH_KEYWORDS,
     "gemm_plan(layer, arch, smem_per_block, sm_count, a0, a1, res, out, smem_per_sm=0, precision='float16', bm=0, "
     "bn=0, stages=0, wgmma=-1, cluster=0, ws=0, norm_pass=False, pad_pass=False, a0_row=0, a1_row=0) -> Plan: the "
     "layer alone as a GEMM (dtype names; a1, res None where the layer has no concat/residual); norm_pass: a norm "
     "layer's second kernel instead (a0: z); pad_pass: x's copy to rows of a0_row elements (a0: x's dtype); a0_row, "
     "a1_row: a part read from such a copy (0: its width)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Network_getset[] = {
    {"widths", (getter)Network_get_widths, NULL, "feature counts: input, then each layer's output", NULL},
    {"x_features", (getter)Network_get_x_features, NULL, "x's features: widths[0], or fewer with an input encoding",
     NULL},
    {"activations", (getter)Network_get_activations, NULL, "canonical text of each layer's activation", NULL},
    {"quant", (getter)Network_get_quant, NULL, "(precision, act_scales or None, [weight scales]) or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject NetworkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fusedmlp._core.Network",
    .tp_basicsize = sizeof(NetworkObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Network(weights, biases, activations): a validated MLP with float32 weights (PyTorch layout).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Network_init,
    .tp_dealloc = (destructor)Network_dealloc,
    .tp_methods = Network_methods,
    .tp_getset = Network_getset,
};
