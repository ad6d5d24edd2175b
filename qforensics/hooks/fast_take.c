/* qforensics: a step plan's takes in C (a CPython extension; hooks/fast_take.py builds it).
 *
 * A decode step repeats its plan (hooks/plan.py): per take, the same signature (call
 * position, module, io, slot), shape, dtype and device, and either a copy of the tensor's bytes
 * into a fixed buffer row or the check that it is the tensor an earlier take copied. In Python
 * that is ~4 us per take, most of it the interpreter and ctypes; here it is the attribute reads
 * of the tensor and a memcpy. Everything else (a take that does not match, a tensor reduced in
 * its hook, a strided one) goes to the Python `fallback`, which finishes the take and sets
 * `pos` as it sees fit.
 *
 * State shared with Python: `refs` and `vers` are PendingStep's own lists (the tensor of each
 * take and its version counter), written here in place; `pos` is the next take's index.
 * No torch headers: the tensor is read through its Python attributes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SLOTS (1LL << 16) /* hooks/plan.py SLOTS */
#define RCOLS 10          /* hooks/plan.py REDUCE_COLUMNS */

/* hooks/plan.py: Python's path, a copy, an earlier take's tensor, a reduction in the hook */
enum { MODE_PY = 0, MODE_COPY = 1, MODE_SHARE = 2, MODE_REDUCE = 3 };
/* a take's state in a step (the `state` bytes): copied or not taken, reduced, reduced+copied */
enum { ST_NONE = 0, ST_REDUCED = 1, ST_COPIED = 2 };

/* fused_reduce.c qf_take_*: one tensor's figures into the split vector */
typedef int (*take_fn)(const void *x, int64_t R, int64_t C, float *S, float *Q, float *MN,
                       float *MX, float *CMIN, float *CMAX, float *TOK);

typedef struct {
    PyObject_HEAD
    PyObject *fallback;              /* callable(ci, mid, io, slot, t) */
    PyObject *spec;                  /* the plan's spec tuple, kept alive while active */
    PyObject *refs, *vers;           /* PendingStep's lists (vers: None without counters) */
    PyObject *shapes, *dtypes, *devices; /* tuples, one item per take */
    const int64_t *sig, *share, *dst, *size;
    const uint8_t *mode;
    const int64_t *rtab;             /* MODE_REDUCE: RCOLS int64 per take (plan.reduce_spec) */
    float *base;                     /* the step's split vector */
    uint8_t *state;                  /* ST_* per take */
    double copy_above;               /* a reduced take this large is copied too (outliers) */
    long long call_ci, call_k0, hot_ci; /* the current call, its first take; a call copied */
    Py_ssize_t n, pos;
    long long first, n_mod;
    int active;
    unsigned long long fast, slow;   /* takes done here / handed to Python (status, tests) */
    unsigned long long hooked;       /* hook calls a Hook did whole */
    unsigned long long reduced, copied; /* MODE_REDUCE takes; of them (or for them) copied */
} Cursor;

static PyObject *s_shape, *s_dtype, *s_device, *s_version, *s_is_contiguous, *s_data_ptr;

static void drop_step(Cursor *c) {
    c->active = 0;
    Py_CLEAR(c->spec);
    Py_CLEAR(c->refs);
    Py_CLEAR(c->vers);
    c->shapes = c->dtypes = c->devices = NULL; /* borrowed from spec */
    c->sig = c->share = c->dst = c->size = c->rtab = NULL;
    c->mode = NULL;
    c->base = NULL;
    c->state = NULL;
    c->n = c->pos = 0;
    c->call_ci = c->hot_ci = -1;
    c->call_k0 = 0;
}

static int Cursor_traverse(Cursor *c, visitproc visit, void *arg) {
    Py_VISIT(c->fallback);
    Py_VISIT(c->spec);
    Py_VISIT(c->refs);
    Py_VISIT(c->vers);
    return 0;
}

static int Cursor_clear(Cursor *c) {
    drop_step(c);
    Py_CLEAR(c->fallback);
    return 0;
}

static void Cursor_dealloc(Cursor *c) {
    PyObject_GC_UnTrack(c);
    Cursor_clear(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int Cursor_init(Cursor *c, PyObject *args, PyObject *kw) {
    PyObject *fb;
    if (!PyArg_ParseTuple(args, "O:Cursor", &fb))
        return -1;
    if (!PyCallable_Check(fb)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be callable");
        return -1;
    }
    drop_step(c);
    Py_XSETREF(c->fallback, Py_NewRef(fb));
    return 0;
}

/* bytes of n int64 (or n uint8 when width is 1) */
static const void *column(PyObject *b, Py_ssize_t n, Py_ssize_t width, const char *what) {
    if (!PyBytes_Check(b) || PyBytes_GET_SIZE(b) != n * width) {
        PyErr_Format(PyExc_ValueError, "plan spec: %s must be %zd bytes", what, n * width);
        return NULL;
    }
    return PyBytes_AS_STRING(b);
}

/* The reduction table's entries, checked once per step against the split vector's length:
 * a kernel, rows and channels, and every place inside the vector. */
static int check_rtab(const int64_t *rtab, const uint8_t *mode, const int64_t *size,
                      Py_ssize_t n, long long len, int have_state) {
    for (Py_ssize_t k = 0; k < n; k++) {
        if (mode[k] != MODE_REDUCE)
            continue;
        const int64_t *r = rtab + k * RCOLS;
        int64_t R = r[1], C = r[2];
        int ok = have_state && r[0] != 0 && R > 0 && C > 0 && size[k] > 0
                 && (size[k] == R * C * 2 || size[k] == R * C * 4);
        for (int i = 3; ok && i < 7; i++) /* S, Q, min, max */
            ok = r[i] >= 0 && r[i] < len;
        for (int i = 7; ok && i < 9; i++) /* channel minima (or values), maxima: C each */
            ok = r[i] == -1 || (r[i] >= 0 && r[i] + C <= len);
        ok = ok && r[9] >= 0 && r[9] + R <= len; /* row maxima */
        if (!ok) {
            PyErr_Format(PyExc_ValueError, "plan spec: reduction entry %zd out of range", k);
            return -1;
        }
    }
    return 0;
}

/* begin(spec, refs, vers, first, n_mod[, base, length, state, copy_above]): run a step on a
 * plan. spec = (sig, share, dst, size, mode, shapes, dtypes, devices[, reductions]), the first
 * five bytes (int64, mode uint8), the next three tuples of n items, the ninth (with MODE_REDUCE
 * takes) RCOLS int64 per take; refs and vers lists of n items (vers None: no version
 * counters). base/length: the step's split vector (float32), state: n bytes, as addresses. */
static PyObject *Cursor_begin(Cursor *c, PyObject *args) {
    PyObject *spec, *refs, *vers;
    long long first, n_mod, len = 0;
    unsigned long long base = 0, state = 0;
    double copy_above = INFINITY;
    if (!PyArg_ParseTuple(args, "O!O!OLL|KLKd:begin", &PyTuple_Type, &spec, &PyList_Type,
                          &refs, &vers, &first, &n_mod, &base, &len, &state, &copy_above))
        return NULL;
    Py_ssize_t items = PyTuple_GET_SIZE(spec);
    if (items != 8 && items != 9) {
        PyErr_SetString(PyExc_ValueError, "plan spec: 8 or 9 items");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(refs);
    if (vers != Py_None && (!PyList_Check(vers) || PyList_GET_SIZE(vers) != n)) {
        PyErr_SetString(PyExc_ValueError, "vers: a list as long as refs, or None");
        return NULL;
    }
    const void *col[5];
    static const char *names[5] = {"sig", "share", "dst", "size", "mode"};
    for (int i = 0; i < 5; i++)
        if (!(col[i] = column(PyTuple_GET_ITEM(spec, i), n, i == 4 ? 1 : 8, names[i])))
            return NULL;
    for (int i = 5; i < 8; i++) {
        PyObject *t = PyTuple_GET_ITEM(spec, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n) {
            PyErr_SetString(PyExc_ValueError, "plan spec: shapes, dtypes, devices of n items");
            return NULL;
        }
    }
    const int64_t *rtab = NULL;
    if (items == 9) {
        if (!(rtab = column(PyTuple_GET_ITEM(spec, 8), n, 8 * RCOLS, "reductions")))
            return NULL;
        if (!base || len <= 0) {
            PyErr_SetString(PyExc_ValueError, "a plan with reductions needs its split vector");
            return NULL;
        }
        if (check_rtab(rtab, col[4], col[3], n, len, state != 0) < 0)
            return NULL;
    } else {
        for (Py_ssize_t k = 0; k < n; k++)
            if (((const uint8_t *)col[4])[k] == MODE_REDUCE) {
                PyErr_SetString(PyExc_ValueError, "plan spec: a reduction without its table");
                return NULL;
            }
    }
    drop_step(c);
    c->spec = Py_NewRef(spec);
    c->refs = Py_NewRef(refs);
    c->vers = vers == Py_None ? NULL : Py_NewRef(vers);
    c->sig = col[0];
    c->share = col[1];
    c->dst = col[2];
    c->size = col[3];
    c->mode = col[4];
    c->rtab = rtab;
    c->base = rtab ? (float *)(uintptr_t)base : NULL;
    c->state = rtab ? (uint8_t *)(uintptr_t)state : NULL;
    c->copy_above = copy_above;
    c->shapes = PyTuple_GET_ITEM(spec, 5);
    c->dtypes = PyTuple_GET_ITEM(spec, 6);
    c->devices = PyTuple_GET_ITEM(spec, 7);
    c->n = n;
    c->pos = 0;
    c->first = first;
    c->n_mod = n_mod;
    c->active = 1;
    Py_RETURN_NONE;
}

static PyObject *Cursor_end(Cursor *c, PyObject *unused) {
    drop_step(c);
    Py_RETURN_NONE;
}

/* 1: the attribute equals want, 0: it does not, -1: error */
static int attr_eq(PyObject *t, PyObject *name, PyObject *want, int identity) {
    PyObject *v = PyObject_GetAttr(t, name);
    if (!v)
        return -1;
    int eq = identity ? v == want : PyObject_RichCompareBool(v, want, Py_EQ);
    Py_DECREF(v);
    return eq;
}

/* Take j's bytes into its buffer row after all (its hook reduced it without a copy): the
 * call it belongs to turned out to matter. A share copies the take it shares. 0 or -1. */
static int copy_row(Cursor *c, Py_ssize_t j) {
    if (c->mode[j] == MODE_SHARE)
        j = (Py_ssize_t)c->share[j];
    if (j < 0 || j >= c->pos || c->mode[j] != MODE_REDUCE || c->state[j] != ST_REDUCED)
        return 0;
    PyObject *p = PyObject_CallMethodNoArgs(PyList_GET_ITEM(c->refs, j), s_data_ptr);
    if (!p)
        return -1;
    void *src = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    if (!src && PyErr_Occurred())
        return -1;
    memcpy((void *)(intptr_t)c->dst[j], src, (size_t)c->size[j]);
    c->state[j] = ST_COPIED;
    c->copied++;
    return 0;
}

/* MODE_REDUCE: take k's figures straight into the split vector. A tensor the end of the step
 * may need whole (a NaN/Inf for the exact pass and the snapshot, a value at or past
 * copy_above for the outlier snapshot) is copied as well, and with it every take of its call,
 * before and after. 0 or -1. */
static int reduce_take(Cursor *c, Py_ssize_t k, long long ci, const void *src) {
    const int64_t *r = c->rtab + k * RCOLS;
    float *p[7];
    for (int i = 0; i < 7; i++)
        p[i] = r[3 + i] >= 0 ? c->base + r[3 + i] : NULL;
    ((take_fn)(intptr_t)r[0])(src, r[1], r[2], p[0], p[1], p[2], p[3], p[4], p[5], p[6]);
    float S = *p[0], Q = *p[1], mn = *p[2], mx = *p[3];
    int hot = !(isfinite(S) && isfinite(Q) && isfinite(mn) && isfinite(mx))
              || fmaxf(fabsf(mn), fabsf(mx)) >= c->copy_above;
    c->reduced++;
    if (hot || ci == c->hot_ci) {
        memcpy((void *)(intptr_t)c->dst[k], src, (size_t)c->size[k]);
        c->state[k] = ST_COPIED;
        c->copied++;
    } else {
        c->state[k] = ST_REDUCED;
    }
    if (hot && ci != c->hot_ci) {
        c->hot_ci = ci;
        for (Py_ssize_t j = c->call_k0; j < k; j++)
            if (copy_row(c, j) < 0)
                return -1;
    }
    return 0;
}

/* 1 taken here, 0 not (Python takes it), -1 error */
static int fast(Cursor *c, long long ci, long long mid, long long io, long long slot,
                PyObject *t) {
    Py_ssize_t k = c->pos;
    if (!c->active || k >= c->n)
        return 0;
    if (slot < 0 || slot >= SLOTS
        || c->sig[k] != (((ci - c->first) * c->n_mod + mid) * 2 + io) * SLOTS + slot)
        return 0;
    int mode = c->mode[k];
    if (mode == MODE_PY)
        return 0;
    if (ci != c->call_ci) { /* takes of one call are consecutive in a plan */
        c->call_ci = ci;
        c->call_k0 = k;
    }
    int eq;
    if ((eq = attr_eq(t, s_shape, PyTuple_GET_ITEM(c->shapes, k), 0)) != 1
        || (eq = attr_eq(t, s_dtype, PyTuple_GET_ITEM(c->dtypes, k), 1)) != 1
        || (eq = attr_eq(t, s_device, PyTuple_GET_ITEM(c->devices, k), 0)) != 1)
        return eq;
    PyObject *ver = NULL;
    if (c->vers && !(ver = PyObject_GetAttr(t, s_version)))
        return -1;
    if (mode == MODE_COPY || mode == MODE_REDUCE) {
        PyObject *r = PyObject_CallMethodNoArgs(t, s_is_contiguous);
        if (!r)
            goto fail;
        int contig = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (contig != 1) {
            Py_XDECREF(ver);
            return contig; /* strided: Python copies it */
        }
        PyObject *p = PyObject_CallMethodNoArgs(t, s_data_ptr);
        if (!p)
            goto fail;
        void *src = PyLong_AsVoidPtr(p);
        Py_DECREF(p);
        if (!src && PyErr_Occurred())
            goto fail;
        if (mode == MODE_COPY) {
            memcpy((void *)(intptr_t)c->dst[k], src, (size_t)c->size[k]);
        } else if (reduce_take(c, k, ci, src) < 0) {
            goto fail;
        }
    } else { /* MODE_SHARE: the tensor of an earlier take, unchanged since */
        int64_t s = c->share[k];
        if (s < 0 || s >= k || PyList_GET_ITEM(c->refs, s) != t)
            goto no;
        if (ver) {
            int same = PyObject_RichCompareBool(PyList_GET_ITEM(c->vers, s), ver, Py_EQ);
            if (same != 1) {
                Py_DECREF(ver);
                return same;
            }
        }
        if (ci == c->hot_ci && copy_row(c, s) < 0)
            goto fail;
    }
    if (ver)
        PyList_SetItem(c->vers, k, ver); /* steals ver */
    PyList_SetItem(c->refs, k, Py_NewRef(t));
    c->pos = k + 1;
    return 1;
no:
    Py_XDECREF(ver);
    return 0;
fail:
    Py_XDECREF(ver);
    return -1;
}

/* One take: here, or through the fallback (ci, mid, io, slot as Python ints). 0 or -1. */
static int take_one(Cursor *c, long long ci, long long mid, long long io, long long slot,
                    PyObject *t) {
    int r = fast(c, ci, mid, io, slot, t);
    if (r < 0)
        return -1;
    if (r) {
        c->fast++;
        return 0;
    }
    c->slow++;
    PyObject *argv[5] = {PyLong_FromLongLong(ci), PyLong_FromLongLong(mid),
                         PyLong_FromLongLong(io), PyLong_FromLongLong(slot), t};
    PyObject *res = NULL;
    if (argv[0] && argv[1] && argv[2] && argv[3])
        res = PyObject_Vectorcall(c->fallback, argv, 5, NULL);
    for (int i = 0; i < 4; i++)
        Py_XDECREF(argv[i]);
    if (!res)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* take(ci, mid, io, slot, t) */
static PyObject *Cursor_take(Cursor *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "take(ci, mid, io, slot, tensor)");
        return NULL;
    }
    long long v[4];
    for (int i = 0; i < 4; i++) {
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    if (take_one(c, v[0], v[1], v[2], v[3], args[4]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *get_pos(Cursor *c, void *unused) { return PyLong_FromSsize_t(c->pos); }

static int set_pos(Cursor *c, PyObject *v, void *unused) {
    Py_ssize_t p = v ? PyLong_AsSsize_t(v) : -1;
    if (p == -1 && (!v || PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "pos cannot be deleted");
        return -1;
    }
    if (p < 0 || p > c->n) {
        PyErr_SetString(PyExc_ValueError, "pos out of range");
        return -1;
    }
    c->pos = p;
    return 0;
}

static PyObject *get_active(Cursor *c, void *unused) { return PyBool_FromLong(c->active); }

static PyObject *get_counts(Cursor *c, void *unused) {
    return Py_BuildValue("(KKKKK)", c->fast, c->slow, c->hooked, c->reduced, c->copied);
}

static PyMethodDef Cursor_methods[] = {
    {"take", (PyCFunction)(void (*)(void))Cursor_take, METH_FASTCALL,
     "take(ci, mid, io, slot, tensor): the plan's take here when it matches, else fallback"},
    {"begin", (PyCFunction)Cursor_begin, METH_VARARGS,
     "begin(spec, refs, vers, first, n_mod): run a step on a plan"},
    {"end", (PyCFunction)Cursor_end, METH_NOARGS, "leave the plan (drops its references)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Cursor_getset[] = {
    {"pos", (getter)get_pos, (setter)set_pos, "index of the next take", NULL},
    {"active", (getter)get_active, NULL, "a step runs on a plan", NULL},
    {"counts", (getter)get_counts, NULL,
     "(takes done in C, takes handed to Python, hook calls done in C, takes reduced in C, "
     "takes copied as well)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CursorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "qf_fast_take.Cursor",
    .tp_basicsize = sizeof(Cursor),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A step plan's takes in C; the rest to a Python fallback.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Cursor_init,
    .tp_dealloc = (destructor)Cursor_dealloc,
    .tp_traverse = (traverseproc)Cursor_traverse,
    .tp_clear = (inquiry)Cursor_clear,
    .tp_methods = Cursor_methods,
    .tp_getset = Cursor_getset,
};


/* ---- Hook: a capture session's forward hook of one module (hooks/session.py `_on_call`) ----
 * Hook(session, cursor, tensor_type, slow, mid, is_block, max_inputs, max_outputs), called as
 * hook(module, args, kwargs, output). While the step runs on a plan it does what `_on_call`
 * does (next call index; the first tensors of args, then the output's), each take through the
 * cursor; anything else (no plan, not in a step, capture degraded, no tensor in args but
 * kwargs, an output that is neither a tensor, a tuple/list nor None) calls `slow`, which is
 * `_on_call` itself, before anything is done. An error in a take goes to session._degrade;
 * after a take handed to Python, session._check_budget runs as in `_on_call`. */
typedef struct {
    PyObject_HEAD
    PyObject *session, *cursor, *tensor_type, *slow;
    long long mid;
    int is_block, max_in, max_out;
    vectorcallfunc vectorcall;
} Hook;

static PyObject *s_degraded, *s_in_step, *s_next_call, *s_degrade, *s_check_budget;

static int Hook_traverse(Hook *h, visitproc visit, void *arg) {
    Py_VISIT(h->session);
    Py_VISIT(h->cursor);
    Py_VISIT(h->tensor_type);
    Py_VISIT(h->slow);
    return 0;
}

static int Hook_clear(Hook *h) {
    Py_CLEAR(h->session);
    Py_CLEAR(h->cursor);
    Py_CLEAR(h->tensor_type);
    Py_CLEAR(h->slow);
    return 0;
}

static void Hook_dealloc(Hook *h) {
    PyObject_GC_UnTrack(h);
    Hook_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyTypeObject CursorType;

static inline int is_tensor(Hook *h, PyObject *o) {
    if ((PyObject *)Py_TYPE(o) == h->tensor_type)
        return 1;
    return PyObject_IsInstance(o, h->tensor_type);
}

#define MAX_TAKES 16

static PyObject *Hook_vectorcall(Hook *h, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Cursor *c = (Cursor *)h->cursor;
    if (nargs != 4 || kwnames || !c->active || !PyTuple_Check(args[1]))
        goto slow;
    PyObject *targs = args[1], *kw = args[2], *out = args[3];
    PyObject *ins[MAX_TAKES], *outs[MAX_TAKES];
    int n_in = 0, n_out = 0, r;
    int limit = h->is_block ? 1 : h->max_in;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(targs) && n_in < limit && n_in < MAX_TAKES; i++) {
        PyObject *a = PyTuple_GET_ITEM(targs, i);
        if ((r = is_tensor(h, a)) < 0)
            goto error;
        if (r)
            ins[n_in++] = a;
    }
    if (!n_in && kw != Py_None && (!PyDict_Check(kw) || PyDict_GET_SIZE(kw)))
        goto slow;
    if (out != Py_None) {
        if ((r = is_tensor(h, out)) < 0)
            goto error;
        if (r) {
            outs[n_out++] = out;
        } else if (PyTuple_Check(out) || PyList_Check(out)) {
            int lim = h->is_block ? 1 : h->max_out;
            Py_ssize_t n = PySequence_Fast_GET_SIZE(out);
            PyObject **items = PySequence_Fast_ITEMS(out);
            for (Py_ssize_t i = 0; i < n && n_out < lim && n_out < MAX_TAKES; i++) {
                if ((r = is_tensor(h, items[i])) < 0)
                    goto error;
                if (r)
                    outs[n_out++] = items[i];
            }
        } else {
            goto slow;
        }
    }
    PyObject *v = PyObject_GetAttr(h->session, s_degraded);
    if (!v)
        goto error;
    int degraded = v != Py_None;
    Py_DECREF(v);
    if (degraded)
        Py_RETURN_NONE;
    if (!(v = PyObject_GetAttr(h->session, s_in_step)))
        goto error;
    int in_step = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (in_step != 1)
        goto slow;
    if (!(v = PyObject_GetAttr(h->session, s_next_call)))
        goto error;
    long long ci = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (ci == -1 && PyErr_Occurred())
        goto error;
    if (!(v = PyLong_FromLongLong(ci + 1)))
        goto error;
    r = PyObject_SetAttr(h->session, s_next_call, v);
    Py_DECREF(v);
    if (r < 0)
        goto error;
    /* as in _on_call: an error (here or in a take) degrades the capture, never the run */
    c->hooked++;
    unsigned long long slow0 = c->slow;
    for (int i = 0; i < n_in; i++)
        if (take_one(c, ci, h->mid, 0, i, ins[i]) < 0)
            goto error;
    for (int i = 0; i < n_out; i++)
        if (take_one(c, ci, h->mid, 1, i, outs[i]) < 0)
            goto error;
    if (c->slow != slow0) {
        PyObject *res = PyObject_CallMethodNoArgs(h->session, s_check_budget);
        if (!res)
            goto error;
        Py_DECREF(res);
    }
    Py_RETURN_NONE;
error:
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return NULL; /* KeyboardInterrupt, SystemExit: as in Python */
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *res = PyObject_CallMethodOneArg(h->session, s_degrade,
                                                  value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        if (!res)
            return NULL;
        Py_DECREF(res);
    }
    Py_RETURN_NONE;
slow:
    return PyObject_Vectorcall(h->slow, args, nargsf, kwnames);
}

static int Hook_init(Hook *h, PyObject *args, PyObject *kw) {
    PyObject *session, *cursor, *ttype, *slow;
    long long mid;
    int is_block, max_in, max_out;
    (void)kw;
    if (!PyArg_ParseTuple(args, "OO!OOLpii:Hook", &session, &CursorType, &cursor, &ttype, &slow,
                          &mid, &is_block, &max_in, &max_out))
        return -1;
    if (!PyType_Check(ttype) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "Hook: tensor_type must be a type, slow callable");
        return -1;
    }
    if (max_in < 1 || max_out < 1) {
        PyErr_SetString(PyExc_ValueError, "Hook: max_inputs and max_outputs must be >= 1");
        return -1;
    }
    Hook_clear(h);
    h->session = Py_NewRef(session);
    h->cursor = Py_NewRef(cursor);
    h->tensor_type = Py_NewRef(ttype);
    h->slow = Py_NewRef(slow);
    h->mid = mid;
    h->is_block = is_block;
    h->max_in = max_in;
    h->max_out = max_out;
    h->vectorcall = (vectorcallfunc)Hook_vectorcall;
    return 0;
}

static PyMemberDef Hook_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Hook, vectorcall), READONLY, NULL},
    {"mid", T_LONGLONG, offsetof(Hook, mid), READONLY, "the module's id"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "qf_fast_take.Hook",
    .tp_basicsize = sizeof(Hook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A capture session's forward hook of one module, in C while a plan runs.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Hook_init,
    .tp_dealloc = (destructor)Hook_dealloc,
    .tp_traverse = (traverseproc)Hook_traverse,
    .tp_clear = (inquiry)Hook_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Hook, vectorcall),
    .tp_members = Hook_members,
};


/* ---- Forward: a module's forward with the session's hook folded in ----
 * Forward(forward, module, hook), set as the module's `forward` instance attribute instead of a
 * registered forward hook: torch's module call then takes its path without hooks (~2.5 us a
 * call less here), and this calls forward(*args, **kwargs), then hook(module, args, kwargs,
 * output) (a Hook: a C call), and returns the output (or what the hook returned, if not None,
 * as torch does). When forward raises, the hook runs with output None (torch's always_call),
 * its own error is dropped, and forward's exception propagates. `off` = True: forward only
 * (set when the capture detaches while someone else still holds this wrapper). */
typedef struct {
    PyObject_HEAD
    PyObject *forward, *module, *hook;
    int off;
    vectorcallfunc vectorcall;
} Forward;

static int Forward_traverse(Forward *f, visitproc visit, void *arg) {
    Py_VISIT(f->forward);
    Py_VISIT(f->module);
    Py_VISIT(f->hook);
    return 0;
}

static int Forward_clear(Forward *f) {
    Py_CLEAR(f->forward);
    Py_CLEAR(f->module);
    Py_CLEAR(f->hook);
    return 0;
}

static void Forward_dealloc(Forward *f) {
    PyObject_GC_UnTrack(f);
    Forward_clear(f);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyObject *Forward_vectorcall(Forward *f, PyObject *const *args, size_t nargsf,
                                    PyObject *kwnames) {
    if (!f->forward) {
        PyErr_SetString(PyExc_RuntimeError, "Forward: not initialised");
        return NULL;
    }
    PyObject *out = PyObject_Vectorcall(f->forward, args, nargsf, kwnames);
    if (f->off || !f->hook)
        return out;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *targs = PyTuple_New(nargs), *kw = PyDict_New(), *res = NULL;
    if (!targs || !kw)
        goto fail;
    for (Py_ssize_t i = 0; i < nargs; i++)
        PyTuple_SET_ITEM(targs, i, Py_NewRef(args[i]));
    if (kwnames)
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++)
            if (PyDict_SetItem(kw, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
                goto fail;
    PyObject *hargs[4] = {f->module, targs, kw, out ? out : Py_None};
    if (!out) { /* forward raised: the hook still runs (call bookkeeping), then the error */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        res = PyObject_Vectorcall(f->hook, hargs, 4, NULL);
        Py_XDECREF(res);
        if (!res)
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
        Py_DECREF(targs);
        Py_DECREF(kw);
        return NULL;
    }
    res = PyObject_Vectorcall(f->hook, hargs, 4, NULL);
    Py_DECREF(targs);
    Py_DECREF(kw);
    if (!res) {
        Py_DECREF(out);
        return NULL;
    }
    if (res != Py_None) { /* a hook's result replaces the output, as in torch */
        Py_DECREF(out);
        return res;
    }
    Py_DECREF(res);
    return out;
fail:
    Py_XDECREF(targs);
    Py_XDECREF(kw);
    Py_XDECREF(out);
    return NULL;
}

static int Forward_init(Forward *f, PyObject *args, PyObject *kw) {
    PyObject *forward, *module, *hook;
    (void)kw;
    if (!PyArg_ParseTuple(args, "OOO:Forward", &forward, &module, &hook))
        return -1;
    if (!PyCallable_Check(forward) || !PyCallable_Check(hook)) {
        PyErr_SetString(PyExc_TypeError, "Forward: forward and hook must be callable");
        return -1;
    }
    Forward_clear(f);
    f->forward = Py_NewRef(forward);
    f->module = Py_NewRef(module);
    f->hook = Py_NewRef(hook);
    f->off = 0;
    f->vectorcall = (vectorcallfunc)Forward_vectorcall;
    return 0;
}

static PyMemberDef Forward_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Forward, vectorcall), READONLY, NULL},
    {"off", T_BOOL, offsetof(Forward, off), 0, "forward only: the hook is not called"},
    {"__wrapped__", T_OBJECT, offsetof(Forward, forward), READONLY, "the wrapped forward"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ForwardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "qf_fast_take.Forward",
    .tp_basicsize = sizeof(Forward),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A module's forward with a capture session's hook folded in.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Forward_init,
    .tp_dealloc = (destructor)Forward_dealloc,
    .tp_traverse = (traverseproc)Forward_traverse,
    .tp_clear = (inquiry)Forward_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Forward, vectorcall),
    .tp_members = Forward_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "qf_fast_take", "A step plan's takes in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit_qf_fast_take(void) {
    if (PyType_Ready(&CursorType) < 0 || PyType_Ready(&HookType) < 0
        || PyType_Ready(&ForwardType) < 0)
        return NULL;
#define INTERN(var, s) if (!(var = PyUnicode_InternFromString(s))) return NULL;
    INTERN(s_shape, "shape")
    INTERN(s_dtype, "dtype")
    INTERN(s_device, "device")
    INTERN(s_version, "_version")
    INTERN(s_is_contiguous, "is_contiguous")
    INTERN(s_data_ptr, "data_ptr")
    INTERN(s_degraded, "_degraded")
    INTERN(s_in_step, "_in_step")
    INTERN(s_next_call, "_next_call")
    INTERN(s_degrade, "_degrade")
    INTERN(s_check_budget, "_check_budget")
#undef INTERN
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "Cursor", (PyObject *)&CursorType) < 0
        || PyModule_AddObjectRef(m, "Hook", (PyObject *)&HookType) < 0
        || PyModule_AddObjectRef(m, "Forward", (PyObject *)&ForwardType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
