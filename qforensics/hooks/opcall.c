/* qforensics: the stats op's eager calls on the CPU without the dispatcher (a CPython
 * extension; hooks/opcall.py builds it).
 *
 * An eager hook on the op path (hooks/graphhooks.py `_call_plan`) calls the stats op once per
 * module call. Through torch's dispatcher that call costs ~7 us on warm caches and ~25-30 us
 * between a real model's GEMMs (its 11 arguments parsed and boxed on cold caches), for ~2 us of
 * reduction: the whole of the op path's cost over the C takes' in HF eager. An OpCall does what
 * the op's C++ kernel (hooks/statsop_cpu.cpp) does first, with the same function: the call's
 * tensors described for fused_reduce.c's `qf_group`, which reduces them into the same ring row
 * and token slot. It returns True when qf_group finished every tensor (all finite: no exact
 * pass, no first-failure word, no snapshot to take); False when it cannot or did not (another
 * device or dtype, a strided tensor, a tensor given twice, a non-finite value): the caller then
 * calls the op, which rewrites every entry of the call. So the figures written are the op's,
 * whichever way a call went.
 *
 * The ring, token ring and step counter are CPU tensors allocated once at attach and never
 * moved (hooks/graphstats.py); the OpCall holds references to them. No torch headers: a
 * tensor is read through its Python attributes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP_DESC 10 /* fused_reduce.c qf_group */

typedef int (*group_fn)(int64_t n, const int64_t *desc, const int64_t *addr, float *row,
                        float *toks, int64_t tstride, float stamp, float *spill,
                        int64_t spill_n, int8_t *done);

typedef struct {
    PyObject_HEAD
    group_fn fn;
    Py_ssize_t m;
    int64_t *entry, *off, *cap, *tok; /* per tensor, the op's arguments */
    int64_t *desc, *addr;
    int8_t *done;
    float *spill;
    int64_t spill_n;
    float *ring;
    int64_t ring_rows, ring_stride;
    float *toks;
    int64_t tok_slots, tok_rows, tok_cols, tok_stride;
    const int64_t *step;
    int64_t stamp_mod;
    PyObject *keep;   /* the tensors the pointers are into */
    PyObject *dtypes; /* (float32, bfloat16, int64, int32): qf_group's dtype codes 0..3 */
    unsigned long long fast, slow;
    /* the first outlier's snapshot: its region's `taken`, the threshold, the candidate inputs
     * (group positions) and where a ring row keeps min and max; none when otaken is NULL */
    const float *otaken;
    double othr;
    int64_t *ocand, ocand_n, col_min, col_max;
    vectorcallfunc vectorcall;
} OpCall;

static PyObject *s_is_cpu, *s_dtype, *s_shape, *s_is_contiguous, *s_data_ptr;

static int OpCall_traverse(OpCall *c, visitproc visit, void *arg) {
    Py_VISIT(c->keep);
    Py_VISIT(c->dtypes);
    return 0;
}

static int OpCall_clear(OpCall *c) {
    Py_CLEAR(c->keep);
    Py_CLEAR(c->dtypes);
    return 0;
}

static void OpCall_dealloc(OpCall *c) {
    PyObject_GC_UnTrack(c);
    OpCall_clear(c);
    free(c->entry); /* one block: entry, off, cap, tok, desc, addr */
    free(c->done);
    free(c->spill);
    free(c->ocand);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int64_t pos_mod(int64_t a, int64_t m) { return ((a % m) + m) % m; }

/* 1: described; 0: not for this lane; -1: error */
static int describe(OpCall *c, Py_ssize_t i, PyObject *t) {
    PyObject *v = PyObject_GetAttr(t, s_is_cpu);
    if (!v)
        return -1;
    int cpu = v == Py_True;
    Py_DECREF(v);
    if (!cpu)
        return 0;
    if (!(v = PyObject_GetAttr(t, s_dtype)))
        return -1;
    int code = -1;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(c->dtypes); k++)
        if (PyTuple_GET_ITEM(c->dtypes, k) == v)
            code = (int)k;
    Py_DECREF(v);
    if (code < 0)
        return 0;
    PyObject *shape = PyObject_GetAttr(t, s_shape);
    if (!shape)
        return -1;
    if (!PyTuple_Check(shape)) {
        Py_DECREF(shape);
        return 0;
    }
    Py_ssize_t dim = PyTuple_GET_SIZE(shape);
    int64_t numel = 1, chans = 1;
    for (Py_ssize_t k = 0; k < dim; k++) {
        long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, k));
        if (d == -1 && PyErr_Occurred()) {
            Py_DECREF(shape);
            return -1;
        }
        numel *= d;
        if (k == dim - 1 && dim >= 2)
            chans = d;
    }
    Py_DECREF(shape);
    if (chans <= 0 || numel <= 0)
        return 0;
    if (!(v = PyObject_CallMethodNoArgs(t, s_is_contiguous)))
        return -1;
    int contiguous = v == Py_True;
    Py_DECREF(v);
    if (!contiguous)
        return 0;
    if (!(v = PyObject_CallMethodNoArgs(t, s_data_ptr)))
        return -1;
    void *p = PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    if (!p)
        return PyErr_Occurred() ? -1 : 0;
    int64_t a = (int64_t)(intptr_t)p;
    for (Py_ssize_t j = 0; j < i; j++)
        if (c->addr[j] == a)
            return 0; /* given twice (or overlapping starts): the op copies the repeat */
    const int64_t rows = numel / chans;
    int64_t kk = 0;
    if (dim >= 2 && c->entry[i] >= 0 && c->entry[i] < c->tok_cols)
        kk = c->tok[i] < c->tok_rows ? c->tok[i] : c->tok_rows;
    if (kk > 0 && c->spill_n < rows) {
        float *s = (float *)realloc(c->spill, (size_t)rows * sizeof(float));
        if (!s) {
            PyErr_NoMemory();
            return -1;
        }
        c->spill = s;
        c->spill_n = rows;
    }
    int64_t *d = c->desc + GROUP_DESC * i;
    const int64_t w[GROUP_DESC] = {c->entry[i], code, rows, chans, c->off[i], c->cap[i], kk,
                                   -1, 0, chans};
    memcpy(d, w, sizeof w);
    c->addr[i] = a;
    return 1;
}

static PyObject *OpCall_vectorcall(OpCall *c, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n != 1 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "OpCall(tensors): one list of tensors");
        return NULL;
    }
    PyObject *xs = args[0];
    if (!PyList_Check(xs) || PyList_GET_SIZE(xs) != c->m) {
        c->slow++;
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < c->m; i++) {
        int r = describe(c, i, PyList_GET_ITEM(xs, i));
        if (r < 0)
            return NULL;
        if (r == 0) {
            c->slow++;
            Py_RETURN_FALSE;
        }
    }
    const int64_t step = *c->step;
    float *row = c->ring + pos_mod(step, c->ring_rows) * c->ring_stride;
    float *tslot = c->toks + pos_mod(step, c->tok_slots) * c->tok_stride;
    const float stamp = (float)pos_mod(step, c->stamp_mod);
    int left = c->fn(c->m, c->desc, c->addr, row, tslot, c->tok_cols, stamp, c->spill,
                     c->spill_n, c->done);
    if (left) {
        c->slow++;
        Py_RETURN_FALSE;
    }
    if (c->otaken && *c->otaken == 0.f) { /* an input at the threshold: the op keeps it */
        for (int64_t k = 0; k < c->ocand_n; k++) {
            const float *e = row + c->off[c->ocand[k]];
            const double lo = e[c->col_min], hi = e[c->col_max];
            if ((-lo > hi ? -lo : hi) >= c->othr) {
                c->slow++;
                Py_RETURN_FALSE;
            }
        }
    }
    c->fast++;
    Py_RETURN_TRUE;
}

/* OpCall(fn, ring, ring_rows, ring_stride, toks, tok_slots, tok_rows, tok_cols, tok_stride,
 *        step, stamp_mod, entries, offs, caps, toks_per_tensor, dtypes, keep
 *        [, otaken, othr, ocand, col_min, col_max]): addresses as ints, the per-tensor
 * arguments as tuples of ints (the op's `entry`, `off`, `cap`, `tok`); `ocand` the group
 * positions of the first outlier's candidate inputs (otaken 0: none). */
static int OpCall_init(OpCall *c, PyObject *args, PyObject *kw) {
    unsigned long long fn, ring, toks, step, otaken = 0;
    long long ring_rows, ring_stride, tok_slots, tok_rows, tok_cols, tok_stride, stamp_mod;
    long long col_min = 0, col_max = 0;
    double othr = 0.0;
    PyObject *ents, *offs, *caps, *tks, *dtypes, *keep, *ocand = NULL;
    (void)kw;
    if (!PyArg_ParseTuple(args, "KKLLKLLLLKLO!O!O!O!O!O!|KdO!LL:OpCall", &fn, &ring, &ring_rows,
                          &ring_stride, &toks, &tok_slots, &tok_rows, &tok_cols, &tok_stride,
                          &step, &stamp_mod, &PyTuple_Type, &ents, &PyTuple_Type, &offs,
                          &PyTuple_Type, &caps, &PyTuple_Type, &tks, &PyTuple_Type, &dtypes,
                          &PyTuple_Type, &keep, &otaken, &othr, &PyTuple_Type, &ocand,
                          &col_min, &col_max))
        return -1;
    Py_ssize_t m = PyTuple_GET_SIZE(ents);
    if (!fn || !ring || !toks || !step || m < 1 || ring_rows < 1 || tok_slots < 1
        || stamp_mod < 1 || PyTuple_GET_SIZE(offs) != m || PyTuple_GET_SIZE(caps) != m
        || PyTuple_GET_SIZE(tks) != m) {
        PyErr_SetString(PyExc_ValueError, "OpCall: bad geometry");
        return -1;
    }
    OpCall_clear(c);
    free(c->entry);
    free(c->done);
    c->entry = (int64_t *)calloc((size_t)m * (6 + GROUP_DESC), sizeof(int64_t));
    c->done = (int8_t *)calloc((size_t)m, 1);
    if (!c->entry || !c->done) {
        PyErr_NoMemory();
        return -1;
    }
    c->off = c->entry + m;
    c->cap = c->off + m;
    c->tok = c->cap + m;
    c->addr = c->tok + m;
    c->desc = c->addr + m;
    PyObject *lists[4] = {ents, offs, caps, tks};
    int64_t *dst[4] = {c->entry, c->off, c->cap, c->tok};
    for (int k = 0; k < 4; k++)
        for (Py_ssize_t i = 0; i < m; i++) {
            long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(lists[k], i));
            if (v == -1 && PyErr_Occurred())
                return -1;
            dst[k][i] = v;
        }
    c->fn = (group_fn)(intptr_t)fn;
    c->m = m;
    c->ring = (float *)(intptr_t)ring;
    c->ring_rows = ring_rows;
    c->ring_stride = ring_stride;
    c->toks = (float *)(intptr_t)toks;
    c->tok_slots = tok_slots;
    c->tok_rows = tok_rows;
    c->tok_cols = tok_cols;
    c->tok_stride = tok_stride;
    c->step = (const int64_t *)(intptr_t)step;
    c->stamp_mod = stamp_mod;
    c->dtypes = Py_NewRef(dtypes);
    c->keep = Py_NewRef(keep);
    c->fast = c->slow = 0;
    free(c->ocand);
    c->ocand = NULL;
    c->ocand_n = 0;
    c->otaken = NULL;
    if (otaken && ocand && PyTuple_GET_SIZE(ocand)) {
        Py_ssize_t k = PyTuple_GET_SIZE(ocand);
        c->ocand = (int64_t *)calloc((size_t)k, sizeof(int64_t));
        if (!c->ocand) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < k; i++) {
            long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(ocand, i));
            if (v == -1 && PyErr_Occurred())
                return -1;
            if (v < 0 || v >= m) {
                PyErr_SetString(PyExc_ValueError, "OpCall: outlier candidate out of range");
                return -1;
            }
            c->ocand[i] = v;
        }
        c->ocand_n = k;
        c->otaken = (const float *)(intptr_t)otaken;
        c->othr = othr;
        c->col_min = col_min;
        c->col_max = col_max;
    }
    c->vectorcall = (vectorcallfunc)OpCall_vectorcall;
    return 0;
}

static PyMemberDef OpCall_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(OpCall, vectorcall), READONLY, NULL},
    {"fast", T_ULONGLONG, offsetof(OpCall, fast), READONLY, "calls finished here"},
    {"slow", T_ULONGLONG, offsetof(OpCall, slow), READONLY, "calls left to the op"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject OpCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "qf_op_call.OpCall",
    .tp_basicsize = sizeof(OpCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "One eager call site of the stats op, reduced by qf_group without the dispatcher.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)OpCall_init,
    .tp_dealloc = (destructor)OpCall_dealloc,
    .tp_traverse = (traverseproc)OpCall_traverse,
    .tp_clear = (inquiry)OpCall_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(OpCall, vectorcall),
    .tp_members = OpCall_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "qf_op_call", "The stats op's eager CPU calls without the dispatcher.",
    -1, NULL,
};

PyMODINIT_FUNC PyInit_qf_op_call(void) {
    if (PyType_Ready(&OpCallType) < 0)
        return NULL;
#define INTERN(var, s) if (!(var = PyUnicode_InternFromString(s))) return NULL;
    INTERN(s_is_cpu, "is_cpu")
    INTERN(s_dtype, "dtype")
    INTERN(s_shape, "shape")
    INTERN(s_is_contiguous, "is_contiguous")
    INTERN(s_data_ptr, "data_ptr")
#undef INTERN
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "OpCall", (PyObject *)&OpCallType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
