/* The native span recorder: the router's per-request spans in C (services.common.trace_recorder uses it where it is
 * built; `make` builds it, scripts/build_native.py).
 *
 * What a traced request costs is its spans: their ids, clock readings, the current-span ContextVar, the record of
 * each and its encoding, and then the exporter process's work on it. In Python that is 40-60k instructions per
 * request in the router and about 16 us per span in the exporter (benchmarks/results/NOTES.md, 2026-11-29). Here the
 * router's operations are single C calls:
 *
 *   root()                          a new trace's server span (`Root`), made current
 *   Root.finish(name, names, values, error=None)
 *                                   restores the span before it and records it, with its children
 *   open_call() / close_call(...)   a client span whose context goes with a call, ended into its parent's record
 *   leaf(...)                       a finished child of the current span (a routing decision)
 *   server_span, put_context, set_attribute, clear_context
 *                                   services.common.tracing's helpers of those names, for a Root
 *   call_traceparent(opened)        the W3C traceparent of an open_call
 *   traceparent(trace_id, span_id, sampled)
 *   add(record)                     any other finished span, a Record tuple (trace_recorder.Span, Child)
 *   take(most)                      (count, bytes): the oldest records' spans, up to `most` of them
 *
 * Spans are written, as they end, straight into one buffer as OTLP: each a ScopeSpans.spans field holding its Span
 * message, byte for byte what services.common.trace_otlp makes of the same record (a child becomes a span of its
 * own; attribute names get `radixmesh.` unless dotted; None values are left out; values OTLP has no type for go as
 * their str()). The pipe's writer thread takes the buffer whole, and the exporter process only wraps it in a request.
 * With a Python callable as the sink instead (tests), each record is handed to it as a tuple.
 *
 * Everything here runs under the GIL, which guards the buffer and the id generator (xoshiro256**, seeded from the
 * kernel and reseeded in a forked child, so two processes never share a sequence). Rare paths (a span that ends with
 * an error, a parent that is not a Root) call back into trace_recorder's Python functions. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#define SERVER 2
#define MAX_DEPTH 100 /* lists nested deeper go as their str() (trace_otlp's recursion would fail first) */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the OTLP writer copies fixed64, fixed32 and doubles from memory: a little-endian host is assumed"
#endif

/* ---- ids ---- */

static uint64_t rng[4];

static void seed_ids(void) {
    if (getrandom(rng, sizeof rng, GRND_NONBLOCK) != (ssize_t)sizeof rng) { /* never blocks a fork's child */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        rng[0] = (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^ (uint64_t)getpid();
        rng[1] = (uint64_t)ts.tv_sec ^ 0xD1B54A32D192ED03ull;
        rng[2] = (uint64_t)(uintptr_t)&ts ^ 0xABCDEF0123456789ull;
        rng[3] = 0x94D049BB133111EBull ^ ((uint64_t)getpid() << 32);
    }
    if (!(rng[0] | rng[1] | rng[2] | rng[3]))
        rng[0] = 1;
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t next64(void) {
    uint64_t out = rotl(rng[1] * 5, 7) * 9, t = rng[1] << 17;
    rng[2] ^= rng[0];
    rng[3] ^= rng[1];
    rng[1] ^= rng[2];
    rng[0] ^= rng[3];
    rng[2] ^= t;
    rng[3] = rotl(rng[3], 45);
    return out;
}

static inline uint64_t new_id(void) {
    uint64_t v;
    do
        v = next64();
    while (!v); /* an all-zero id is invalid in W3C trace context */
    return v;
}

static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* time.time_ns()'s clock */
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- configuration (configure / set_buffer) ---- */

static PyObject *current_var;  /* trace_recorder.CURRENT */
static PyObject *finish_error; /* trace_recorder.finish_error(span, error) */
static PyObject *py_close_call, *py_leaf; /* trace_recorder's Python versions, for what C does not handle */
static PyObject *sink;         /* a callable taking Record tuples, or NULL: the buffer */
static PyObject *wake;         /* called when `batch` spans wait in the buffer */
static uint64_t bound;         /* roots whose trace id's low 64 bits are below it are sampled... */
static int bound_all = 1;      /* ...or all of them (always_on) */
static PyTypeObject *RootType;

static int not_configured(PyObject *what) { /* configure() / bind() first: RuntimeError (and true) otherwise */
    if (what != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "the span recorder is not configured (trace_recorder.configure, bind)");
    return 1;
}

#include "_spanrec_otlp.c" /* the buffer and the OTLP encoders */
#include "_spanrec_root.c" /* Root */

/* ---- children of a Root: calls and leaves ---- */

/* (buffer mode) a child entry written into its Root's own buffer, which stands in for the global one meanwhile */
static int write_child(Root *p, uint64_t span_id, PyObject *name, PyObject *kind, PyObject *start, PyObject *names,
                       PyObject *values) {
    uint64_t k, begun;
    if (writing) { /* Python code run by a write came here: the buffers are not ours to touch (see `writing`) */
        buf_dropped++;
        return 0;
    }
    if (id_of(kind, &k) < 0 || id_of(start, &begun) < 0)
        return -1;
    uint64_t end = (uint64_t)now_ns();
    char *saved = buf;
    Py_ssize_t saved_len = buf_len, saved_cap = buf_cap;
    Py_INCREF(p); /* its buffer stands in for the global one until the end */
    buf = p->cbuf, buf_len = p->clen, buf_cap = p->ccap;
    swapped = 1;
    writing++;
    Attrs attrs = {NULL, names, values}; /* held by the caller */
    int rc = w_span(p->hi, p->lo, span_id ? span_id : new_id(), p->span_id, 0, NULL, name, k, begun, end, &attrs,
                    NULL, NULL);
    writing--;
    if (rc == 0) {
        p->clen = buf_len;
        p->cn++;
    }
    p->cbuf = buf, p->ccap = buf_cap; /* it may have grown; a failed entry is left out (clen unchanged) */
    buf = saved, buf_len = saved_len, buf_cap = saved_cap;
    swapped = 0;
    Py_DECREF(p);
    return rc;
}

static int append_child(Root *p, PyObject *span_id, PyObject *name, PyObject *kind, PyObject *start, PyObject *names,
                        PyObject *values) {
    if (sink == NULL) {
        uint64_t id = PyLong_AsUnsignedLongLongMask(span_id);
        if (id == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        return write_child(p, id, name, kind, start, names, values);
    }
    PyObject *end = PyLong_FromLongLong(now_ns());
    if (end == NULL)
        return -1;
    PyObject *attrs = PyTuple_Pack(2, names, values);
    if (attrs == NULL) {
        Py_DECREF(end);
        return -1;
    }
    PyObject *entry = PyTuple_Pack(8, span_id, name, kind, start, end, attrs, Py_None, Py_None);
    Py_DECREF(end);
    Py_DECREF(attrs);
    if (entry == NULL)
        return -1;
    int rc;
    if (p->children == NULL || p->children == Py_None) {
        PyObject *list = PyList_New(1);
        if (list == NULL) {
            Py_DECREF(entry);
            return -1;
        }
        PyList_SET_ITEM(list, 0, entry); /* steals it */
        Py_XSETREF(p->children, list);
        return 0;
    }
    rc = PyList_Append(p->children, entry);
    Py_DECREF(entry);
    return rc;
}

static PyObject *current(void) { /* a new reference (None when no span is current) */
    PyObject *p;
    if (not_configured(current_var) || PyContextVar_Get(current_var, Py_None, &p) < 0)
        return NULL;
    return p;
}

static PyObject *open_call(PyObject *module, PyObject *unused) {
    PyObject *p = current();
    if (p == NULL || p == Py_None)
        return p;
    PyObject *span_id = PyLong_FromUnsignedLongLong(new_id()), *start = PyLong_FromLongLong(now_ns()), *out = NULL;
    if (span_id && start)
        out = PyTuple_Pack(3, p, span_id, start);
    Py_DECREF(p);
    Py_XDECREF(span_id);
    Py_XDECREF(start);
    return out;
}

static PyObject *close_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 5 || nargs > 6 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 3) {
        PyErr_SetString(PyExc_TypeError, "close_call(opened, name, kind, names, values, error=None)");
        return NULL;
    }
    PyObject *opened = args[0], *p = PyTuple_GET_ITEM(opened, 0);
    if ((nargs == 5 || args[5] == Py_None) && Py_TYPE(p) == RootType && ((Root *)p)->recording) {
        if (append_child((Root *)p, PyTuple_GET_ITEM(opened, 1), args[1], args[2], PyTuple_GET_ITEM(opened, 2),
                         args[3], args[4]) < 0) { /* a value's str() failed, or memory: the span is lost, counted */
            PyErr_Clear();
            buf_dropped++;
        }
        Py_RETURN_NONE;
    }
    if (not_configured(py_close_call))
        return NULL;
    return PyObject_Vectorcall(py_close_call, args, (size_t)nargs, NULL);
}

static PyObject *zero;

static PyObject *leaf(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 5 || nargs > 6) {
        PyErr_SetString(PyExc_TypeError, "leaf(name, kind, start_ns, names, values, error=None)");
        return NULL;
    }
    PyObject *p = current();
    if (p == NULL || p == Py_None)
        return p;
    if ((nargs == 5 || args[5] == Py_None) && Py_TYPE(p) == RootType && ((Root *)p)->recording) {
        if (append_child((Root *)p, zero, args[0], args[1], args[2], args[3], args[4]) < 0) {
            PyErr_Clear(); /* as in close_call */
            buf_dropped++;
        }
        Py_DECREF(p);
        Py_RETURN_NONE;
    }
    Py_DECREF(p);
    if (not_configured(py_leaf))
        return NULL;
    return PyObject_Vectorcall(py_leaf, args, (size_t)nargs, NULL);
}

static int u128_of(PyObject *v, uint64_t *hi, uint64_t *lo) {
    *lo = PyLong_AsUnsignedLongLongMask(v);
    if (*lo == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    PyObject *shift = PyLong_FromLong(64);
    if (shift == NULL)
        return -1;
    PyObject *high = PyNumber_Rshift(v, shift);
    Py_DECREF(shift);
    if (high == NULL)
        return -1;
    *hi = PyLong_AsUnsignedLongLongMask(high);
    Py_DECREF(high);
    return (*hi == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *traceparent(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "traceparent(trace_id, span_id, sampled)");
        return NULL;
    }
    uint64_t hi, lo, span_id;
    if (u128_of(args[0], &hi, &lo) < 0)
        return NULL;
    span_id = PyLong_AsUnsignedLongLongMask(args[1]);
    if (span_id == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    int sampled = PyObject_IsTrue(args[2]);
    if (sampled < 0)
        return NULL;
    return format_traceparent(hi, lo, span_id, sampled);
}

static PyObject *call_traceparent(PyObject *module, PyObject *opened) {
    if (!PyTuple_Check(opened) || PyTuple_GET_SIZE(opened) != 3) {
        PyErr_SetString(PyExc_TypeError, "call_traceparent takes what open_call gave");
        return NULL;
    }
    PyObject *p = PyTuple_GET_ITEM(opened, 0);
    uint64_t span_id = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(opened, 1));
    if (span_id == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (Py_TYPE(p) == RootType)
        return format_traceparent(((Root *)p)->hi, ((Root *)p)->lo, span_id, ((Root *)p)->sampled);
    PyObject *trace_id = PyObject_GetAttrString(p, "trace_id"), *sampled = NULL, *out = NULL;
    if (trace_id != NULL && (sampled = PyObject_GetAttrString(p, "sampled")) != NULL) {
        uint64_t hi, lo;
        int s = PyObject_IsTrue(sampled);
        if (s >= 0 && u128_of(trace_id, &hi, &lo) == 0)
            out = format_traceparent(hi, lo, span_id, s);
    }
    Py_XDECREF(trace_id);
    Py_XDECREF(sampled);
    return out;
}

/* ---- tracing's helpers for the router's call sites (bind), with their Python versions for the rest ---- */

static PyObject *py_server_span, *py_put_context, *py_set_attribute, *py_clear_context, *str_traceparent, *empty_str;
static int propagate = 1; /* OTEL_PROPAGATORS has tracecontext */

static PyObject *server_span(PyObject *module, PyObject *headers) {
    int has = PySequence_Contains(headers, str_traceparent);
    if (has < 0)
        return NULL;
    if (has) /* under a caller's span: tracing.server_span's Span */
        return not_configured(py_server_span) ? NULL : PyObject_CallOneArg(py_server_span, headers);
    return root_new(module, NULL);
}

static PyObject *set_attribute(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_attribute(key, value)");
        return NULL;
    }
    PyObject *p = current();
    if (p == NULL || p == Py_None)
        return p;
    PyObject *out = Py_TYPE(p) == RootType  ? root_set_attribute((Root *)p, args, nargs)
                    : not_configured(py_set_attribute) ? NULL
                                                       : PyObject_Vectorcall(py_set_attribute, args, (size_t)nargs, NULL);
    Py_DECREF(p);
    return out;
}

static PyObject *put_context(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put_context(target, span)");
        return NULL;
    }
    PyObject *opened = args[1];
    if (opened == Py_None || !propagate)
        Py_RETURN_FALSE;
    int root = Py_TYPE(opened) == RootType; /* the router's calls: under the request's span itself, or a call span */
    if (root || (PyTuple_CheckExact(opened) && PyTuple_GET_SIZE(opened) == 3 &&
                 Py_TYPE(PyTuple_GET_ITEM(opened, 0)) == RootType)) {
        /* a Root's trace has no tracestate or baggage to pass on */
        PyObject *tp = root ? root_traceparent((Root *)opened, NULL) : call_traceparent(module, opened);
        if (tp == NULL)
            return NULL;
        int rc = PyObject_SetAttr(args[0], str_traceparent, tp); /* the request's traceparent field */
        Py_DECREF(tp);
        if (rc < 0)
            return NULL;
        Py_RETURN_TRUE;
    }
    return not_configured(py_put_context) ? NULL : PyObject_Vectorcall(py_put_context, args, (size_t)nargs, NULL);
}

static PyObject *clear_context(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "clear_context(target, span)");
        return NULL;
    }
    PyObject *opened = args[1];
    if (Py_TYPE(opened) == RootType || (PyTuple_CheckExact(opened) && PyTuple_GET_SIZE(opened) == 3 &&
                                        Py_TYPE(PyTuple_GET_ITEM(opened, 0)) == RootType)) {
        if (PyObject_SetAttr(args[0], str_traceparent, empty_str) < 0) /* all put_context wrote for a Root or its call */
            return NULL;
        Py_RETURN_NONE;
    }
    return not_configured(py_clear_context) ? NULL : PyObject_Vectorcall(py_clear_context, args, (size_t)nargs, NULL);
}

static PyObject *bind(PyObject *module, PyObject *args) {
    PyObject *ss, *pc, *sa, *cc;
    int prop;
    if (!PyArg_ParseTuple(args, "OOOOp", &ss, &pc, &sa, &cc, &prop))
        return NULL;
    Py_INCREF(cc);
    Py_XSETREF(py_clear_context, cc);
    Py_INCREF(ss);
    Py_XSETREF(py_server_span, ss);
    Py_INCREF(pc);
    Py_XSETREF(py_put_context, pc);
    Py_INCREF(sa);
    Py_XSETREF(py_set_attribute, sa);
    propagate = prop;
    Py_RETURN_NONE;
}

/* ---- other records, the buffer, configuration ---- */

static PyObject *add(PyObject *module, PyObject *record) {
    if (sink != NULL) {
        Py_INCREF(record);
        if (hand_to_sink(record) < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    if (buf_count >= buf_limit || writing) {
        buf_dropped += 1 + ((PyTuple_Check(record) && PyTuple_GET_SIZE(record) == 13 &&
                             PyList_Check(PyTuple_GET_ITEM(record, 12))) ? PyList_GET_SIZE(PyTuple_GET_ITEM(record, 12)) : 0);
        Py_RETURN_NONE;
    }
    Py_ssize_t mark = buf_len, spans = 0;
    writing++;
    int rc = w_record(record, &spans);
    writing--;
    written(mark, rc, spans);
    Py_RETURN_NONE;
}

static PyObject *take(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t most = PY_SSIZE_T_MAX;
    if (nargs > 1 || (nargs == 1 && (most = PyLong_AsSsize_t(args[0])) == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "take(most=all)");
        return NULL;
    }
    if (writing) /* a record is half written (see `writing`): nothing now, all of it next time */
        return Py_BuildValue("(ny#)", (Py_ssize_t)0, "", (Py_ssize_t)0);
    /* the records whose spans add up to at most `most` (at least one record, however many spans it has) */
    Py_ssize_t k = 0;
    while (k < rec_n && (rec_spans[k] <= most || k == 0))
        k++;
    Py_ssize_t len = k ? rec_end[k - 1] : 0, count = k ? rec_spans[k - 1] : 0;
    PyObject *data = PyBytes_FromStringAndSize(buf, len);
    if (data == NULL)
        return NULL;
    PyObject *out = Py_BuildValue("(nN)", count, data);
    if (out == NULL)
        return NULL;
    if (len)
        memmove(buf, buf + len, (size_t)(buf_len - len));
    buf_len -= len;
    buf_count -= count;
    for (Py_ssize_t i = k; i < rec_n; i++) {
        rec_end[i - k] = rec_end[i] - len;
        rec_spans[i - k] = rec_spans[i] - count;
    }
    rec_n -= k;
    if (buf_len == 0 && buf_cap > (1 << 22)) { /* a burst grew it: give the memory back */
        PyMem_Free(buf);
        buf = NULL;
        buf_cap = 0;
    }
    return out;
}

static PyObject *dropped(PyObject *module, PyObject *unused) { return PyLong_FromUnsignedLongLong(buf_dropped); }

static PyObject *waiting(PyObject *module, PyObject *unused) { return PyLong_FromSsize_t(buf_count); }

static PyObject *configure(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"current", "bound", "finish_error", "close_call", "leaf", "attributes", "sink", NULL};
    PyObject *var, *bound_obj, *fe, *cc, *lf, *at, *sk = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO|O", names, &var, &bound_obj, &fe, &cc, &lf, &at, &sk))
        return NULL;
    if (!PyContextVar_CheckExact(var)) {
        PyErr_SetString(PyExc_TypeError, "current must be a ContextVar");
        return NULL;
    }
    PyObject *limit = PyLong_FromUnsignedLongLong(UINT64_MAX);
    if (limit == NULL)
        return NULL;
    int all = PyObject_RichCompareBool(bound_obj, limit, Py_GT);
    Py_DECREF(limit);
    if (all < 0)
        return NULL;
    uint64_t b = all ? 0 : PyLong_AsUnsignedLongLong(bound_obj);
    if (!all && b == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    bound_all = all;
    bound = b;
    Py_INCREF(var);
    Py_XSETREF(current_var, var);
    Py_INCREF(fe);
    Py_XSETREF(finish_error, fe);
    Py_INCREF(cc);
    Py_XSETREF(py_close_call, cc);
    Py_INCREF(lf);
    Py_XSETREF(py_leaf, lf);
    Py_INCREF(at);
    Py_XSETREF(attributes_of, at);
    if (sk == Py_None) {
        Py_CLEAR(sink);
    } else {
        Py_INCREF(sk);
        Py_XSETREF(sink, sk);
    }
    Py_RETURN_NONE;
}

static PyObject *set_buffer(PyObject *module, PyObject *args) {
    Py_ssize_t limit, batch;
    PyObject *w;
    if (!PyArg_ParseTuple(args, "nnO", &limit, &batch, &w))
        return NULL;
    buf_limit = limit < 0 ? 0 : limit;
    buf_batch = batch < 1 ? 1 : batch;
    if (w == Py_None) {
        Py_CLEAR(wake);
    } else {
        Py_INCREF(w);
        Py_XSETREF(wake, w);
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"root", root_new, METH_NOARGS, "root() -> Root: a new trace's server span, made current"},
    {"open_call", open_call, METH_NOARGS, "open_call() -> (parent, span id, start ns) or None"},
    {"close_call", (PyCFunction)(void (*)(void))close_call, METH_FASTCALL,
     "close_call(opened, name, kind, names, values, error=None)"},
    {"leaf", (PyCFunction)(void (*)(void))leaf, METH_FASTCALL, "leaf(name, kind, start_ns, names, values, error=None)"},
    {"traceparent", (PyCFunction)(void (*)(void))traceparent, METH_FASTCALL, "traceparent(trace_id, span_id, sampled)"},
    {"call_traceparent", call_traceparent, METH_O, "the traceparent of an open_call"},
    {"add", add, METH_O, "record a finished span (a Record tuple)"},
    {"server_span", server_span, METH_O, "tracing.server_span: a Root, or the Python one's span under a traceparent"},
    {"set_attribute", (PyCFunction)(void (*)(void))set_attribute, METH_FASTCALL,
     "tracing.set_attribute: on the current span"},
    {"put_context", (PyCFunction)(void (*)(void))put_context, METH_FASTCALL,
     "tracing.put_context: a Root's or its open_call's traceparent into a request's traceparent field"},
    {"clear_context", (PyCFunction)(void (*)(void))clear_context, METH_FASTCALL,
     "tracing.clear_context: what put_context wrote into a request, emptied"},
    {"bind", bind, METH_VARARGS,
     "bind(server_span, put_context, set_attribute, clear_context, propagate): tracing's Python helpers, for what C does not handle"},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL, "take(most=all) -> (count, bytes): the spans of the oldest records, at most `most` of them (at least one record), as ScopeSpans.spans fields"},
    {"dropped", dropped, METH_NOARGS, "records dropped so far (the buffer was full)"},
    {"waiting", waiting, METH_NOARGS, "records in the buffer"},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(current, bound, finish_error, close_call, leaf, attributes, sink=None)"},
    {"set_buffer", set_buffer, METH_VARARGS, "set_buffer(limit, batch, wake): the buffer's bound and batch (in spans) and its wake-up"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_spanrec",
                                        "The native span recorder (see radixmesh/services/common/_spanrec.c).", -1,
                                        module_methods};

static void reseed_in_child(void) { /* a forked child: ids of its own, nothing of its parent's half-written */
    seed_ids();
    if (swapped) { /* the fork came while a Root's buffer stood in for the global one: that one is not ours */
        buf = NULL;
        buf_cap = 0;
    }
    buf_len = buf_count = rec_n = 0;
    writing = swapped = 0;
}

PyMODINIT_FUNC PyInit__spanrec(void) {
    seed_ids();
    pthread_atfork(NULL, NULL, reseed_in_child);
    for (int b = 0; b < 256; b++) {
        hex_pairs[2 * b] = "0123456789abcdef"[b >> 4];
        hex_pairs[2 * b + 1] = "0123456789abcdef"[b & 0xf];
    }
    zero = PyLong_FromLong(0);
    str_traceparent = PyUnicode_InternFromString("traceparent");
    empty_str = PyUnicode_New(0, 0);
    str_request_id = PyUnicode_InternFromString("request_id");
    if (zero == NULL || str_traceparent == NULL || empty_str == NULL || str_request_id == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    RootType = (PyTypeObject *)PyType_FromSpec(&root_spec);
    if (RootType == NULL || PyModule_AddObjectRef(m, "Root", (PyObject *)RootType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
