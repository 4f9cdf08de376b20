/* The native span recorder: the router's per-request spans in C (services.common.trace_recorder uses it where it is
 * built; `make` builds it, scripts/build_native.py).
 *
 * What a traced request costs the serving process is its spans: their ids, clock readings, the current-span
 * ContextVar, the record of each and its encoding for the exporter process. In Python that is 40-60k instructions
 * per request, and twice that share of the router's time natively (benchmarks/results/NOTES.md, 2026-11-29). Here
 * the same operations are single C calls:
 *
 *   root()                          a new trace's server span (`Root`), made current
 *   Root.finish(name, names, values, error=None)
 *                                   restores the span before it and records it, with its children
 *   open_call() / close_call(...)   a client span whose context goes with a call, ended into its parent's record
 *   leaf(...)                       a finished child of the current span (a routing decision)
 *   call_traceparent(opened)        the W3C traceparent of an open_call
 *   traceparent(trace_id, span_id, sampled)
 *   add(record)                     any other finished span, a Record tuple (trace_recorder.Span, Child)
 *   take()                          (count, bytes): the records written since the last take
 *
 * Records are written, as they end, straight into one buffer in marshal's format (version 2: no references), each
 * a Record tuple as trace_recorder defines it; the pipe's writer thread takes the buffer whole and frames it as a
 * marshalled list, so the exporter process reads it as it reads the Python recorder's batches. Values marshal
 * cannot write go as their str(), as trace_recorder.plain does. With a Python callable as the sink instead (tests),
 * each record is handed to it as a tuple.
 *
 * Everything here runs under the GIL, which guards the buffer and the id generator (xoshiro256**, seeded from the
 * kernel and reseeded in a forked child, so two processes never share a sequence). Rare paths (a span that ends with
 * an error, a parent that is not a Root) call back into trace_recorder's Python functions. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <marshal.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#define SERVER 2
#define MAX_DEPTH 32

/* ---- ids ---- */

static uint64_t rng[4];

static void seed_ids(void) {
    if (getrandom(rng, sizeof rng, 0) != (ssize_t)sizeof rng) {
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
static PyObject *wake;         /* called when `batch` records wait in the buffer */
static uint64_t bound;         /* roots whose trace id's low 64 bits are below it are sampled... */
static int bound_all = 1;      /* ...or all of them (always_on) */
static PyTypeObject *RootType;

/* ---- the buffer, in marshal's format ---- */

static char *buf;
static Py_ssize_t buf_len, buf_cap, buf_count, buf_limit, buf_batch = 512;
static unsigned long long buf_dropped;
static int swapped; /* the buffer is a Root's while its child is written (write_child) */

static int grow(Py_ssize_t n) {
    Py_ssize_t cap = buf_cap ? buf_cap : swapped ? 256 : 65536;
    while (cap < buf_len + n)
        cap *= 2;
    char *p = PyMem_Realloc(buf, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    buf = p;
    buf_cap = cap;
    return 0;
}

static inline int reserve(Py_ssize_t n) { return (buf_len + n <= buf_cap) ? 0 : grow(n); }

static inline int w_byte(char c) {
    if (reserve(1) < 0)
        return -1;
    buf[buf_len++] = c;
    return 0;
}

static inline void put_i32(int32_t v) { /* after a reserve */
    uint32_t u = (uint32_t)v;
    buf[buf_len++] = (char)(u & 0xff);
    buf[buf_len++] = (char)((u >> 8) & 0xff);
    buf[buf_len++] = (char)((u >> 16) & 0xff);
    buf[buf_len++] = (char)((u >> 24) & 0xff);
}

static int w_bytes(char type, const char *data, Py_ssize_t n) {
    if (n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a value too large to record");
        return -1;
    }
    if (reserve(5 + n) < 0)
        return -1;
    buf[buf_len++] = type;
    put_i32((int32_t)n);
    memcpy(buf + buf_len, data, (size_t)n);
    buf_len += n;
    return 0;
}

/* an unsigned integer of up to 128 bits: 'i' when it fits, else 'l' with 15-bit digits, least significant first */
static inline int w_u64(uint64_t v) {
    if (v <= INT32_MAX) {
        if (reserve(5) < 0)
            return -1;
        buf[buf_len++] = 'i';
        put_i32((int32_t)v);
        return 0;
    }
    int n = (64 - __builtin_clzll(v) + 14) / 15;
    if (reserve(5 + 2 * n) < 0)
        return -1;
    buf[buf_len++] = 'l';
    put_i32(n);
    for (int i = 0; i < n; i++, v >>= 15) {
        buf[buf_len++] = (char)(v & 0xff);
        buf[buf_len++] = (char)((v >> 8) & 0x7f);
    }
    return 0;
}

static int w_u128(unsigned __int128 v) {
    if (!(v >> 64))
        return w_u64((uint64_t)v);
    uint16_t digits[9];
    int n = 0;
    while (v) {
        digits[n++] = (uint16_t)(v & 0x7fff);
        v >>= 15;
    }
    if (reserve(5 + 2 * n) < 0)
        return -1;
    buf[buf_len++] = 'l';
    put_i32(n);
    for (int i = 0; i < n; i++) {
        buf[buf_len++] = (char)(digits[i] & 0xff);
        buf[buf_len++] = (char)(digits[i] >> 8);
    }
    return 0;
}

static inline int w_i64(long long v) {
    if (v >= 0)
        return w_u64((uint64_t)v);
    if (v >= INT32_MIN) {
        if (reserve(5) < 0)
            return -1;
        buf[buf_len++] = 'i';
        put_i32((int32_t)v);
        return 0;
    }
    /* negative and large: marshal writes the sign in the digit count */
    Py_ssize_t mark = buf_len;
    if (w_u64((uint64_t)(-(v + 1)) + 1) < 0)
        return -1;
    int32_t n;
    memcpy(&n, buf + mark + 1, 4); /* little-endian host (x86-64, aarch64) */
    n = -n;
    memcpy(buf + mark + 1, &n, 4);
    return 0;
}

static inline int w_str(PyObject *s) {
    if (PyUnicode_IS_COMPACT_ASCII(s)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(s);
        const char *data = (const char *)PyUnicode_DATA(s);
        if (n < 256) {
            if (reserve(2 + n) < 0)
                return -1;
            buf[buf_len++] = 'z';
            buf[buf_len++] = (char)n;
            memcpy(buf + buf_len, data, (size_t)n);
            buf_len += n;
            return 0;
        }
        return w_bytes('a', data, n);
    }
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(s, &n);
    if (utf8 != NULL)
        return w_bytes('u', utf8, n);
    /* lone surrogates: marshal's own writer (surrogatepass) */
    PyErr_Clear();
    PyObject *data = PyMarshal_WriteObjectToString(s, 2);
    if (data == NULL)
        return -1;
    int rc = reserve(PyBytes_GET_SIZE(data));
    if (rc == 0) {
        memcpy(buf + buf_len, PyBytes_AS_STRING(data), (size_t)PyBytes_GET_SIZE(data));
        buf_len += PyBytes_GET_SIZE(data);
    }
    Py_DECREF(data);
    return rc;
}

static int w_object(PyObject *o, int depth);

static int w_sequence(char small, char large, PyObject *const *items, Py_ssize_t n, int depth) {
    if (n < 256 && small) {
        if (reserve(2) < 0)
            return -1;
        buf[buf_len++] = small;
        buf[buf_len++] = (char)n;
    } else {
        if (reserve(5) < 0)
            return -1;
        buf[buf_len++] = large;
        put_i32((int32_t)n);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (w_object(items[i], depth + 1) < 0)
            return -1;
    return 0;
}

static int w_as_str(PyObject *o) {
    PyObject *s = PyObject_Str(o);
    if (s == NULL)
        return -1;
    int rc = w_str(s);
    Py_DECREF(s);
    return rc;
}

/* any value: None, bools, ints, floats, str, bytes, tuples, lists and dicts as marshal writes them; anything else
 * (and anything nested deeper than MAX_DEPTH) as its str() */
static int w_object(PyObject *o, int depth) {
    if (o == Py_None)
        return w_byte('N');
    if (o == Py_True)
        return w_byte('T');
    if (o == Py_False)
        return w_byte('F');
    if (depth > MAX_DEPTH)
        return w_as_str(o);
    if (PyUnicode_Check(o))
        return w_str(o);
    if (PyLong_Check(o)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (!overflow)
            return w_i64(v);
        PyObject *exact = PyNumber_Index(o);
        if (exact == NULL)
            return -1;
        PyObject *data = PyMarshal_WriteObjectToString(exact, 2);
        Py_DECREF(exact);
        if (data == NULL)
            return -1;
        int rc = reserve(PyBytes_GET_SIZE(data));
        if (rc == 0) {
            memcpy(buf + buf_len, PyBytes_AS_STRING(data), (size_t)PyBytes_GET_SIZE(data));
            buf_len += PyBytes_GET_SIZE(data);
        }
        Py_DECREF(data);
        return rc;
    }
    if (PyFloat_Check(o)) {
        double d = PyFloat_AS_DOUBLE(o);
        if (reserve(9) < 0)
            return -1;
        buf[buf_len++] = 'g';
        memcpy(buf + buf_len, &d, 8); /* little-endian IEEE 754, as marshal writes it on these hosts */
        buf_len += 8;
        return 0;
    }
    if (PyTuple_Check(o))
        return w_sequence(')', '(', &PyTuple_GET_ITEM(o, 0), PyTuple_GET_SIZE(o), depth);
    if (PyList_Check(o))
        return w_sequence(0, '[', &PyList_GET_ITEM(o, 0), PyList_GET_SIZE(o), depth);
    if (PyDict_Check(o)) {
        if (w_byte('{') < 0)
            return -1;
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(o, &pos, &k, &v))
            if (w_object(k, depth + 1) < 0 || w_object(v, depth + 1) < 0)
                return -1;
        return w_byte('0');
    }
    if (PyBytes_Check(o))
        return w_bytes('s', PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o));
    return w_as_str(o);
}

/* Attribute names come as a constant tuple per call site (tracing.leaf, close_call, Root.finish): each is encoded
 * once and its bytes copied after. The cache holds the tuple (so its address cannot be reused by another object). */
#define NAMES_SLOTS 64
static struct {
    PyObject *key;
    char *data;
    Py_ssize_t n;
} names_cache[NAMES_SLOTS];

static int w_names(PyObject *names) {
    if (!PyTuple_CheckExact(names))
        return w_object(names, 1);
    size_t slot = ((uintptr_t)names >> 4) % NAMES_SLOTS;
    if (names_cache[slot].key != names) {
        Py_ssize_t mark = buf_len;
        if (w_object(names, 1) < 0)
            return -1;
        char *copy = PyMem_Malloc((size_t)(buf_len - mark));
        if (copy == NULL)
            return 0; /* written, just not cached */
        memcpy(copy, buf + mark, (size_t)(buf_len - mark));
        Py_XDECREF(names_cache[slot].key);
        PyMem_Free(names_cache[slot].data);
        Py_INCREF(names);
        names_cache[slot].key = names;
        names_cache[slot].data = copy;
        names_cache[slot].n = buf_len - mark;
        return 0;
    }
    if (reserve(names_cache[slot].n) < 0)
        return -1;
    memcpy(buf + buf_len, names_cache[slot].data, (size_t)names_cache[slot].n);
    buf_len += names_cache[slot].n;
    return 0;
}

/* attributes as the recorder keeps them: a dict, or (names, values) / (names, values, dict) */
static int w_attrs(PyObject *attrs) {
    if (PyTuple_CheckExact(attrs) && (PyTuple_GET_SIZE(attrs) == 2 || PyTuple_GET_SIZE(attrs) == 3)) {
        if (reserve(2) < 0)
            return -1;
        buf[buf_len++] = ')';
        buf[buf_len++] = (char)PyTuple_GET_SIZE(attrs);
        if (w_names(PyTuple_GET_ITEM(attrs, 0)) < 0 || w_object(PyTuple_GET_ITEM(attrs, 1), 2) < 0)
            return -1;
        return PyTuple_GET_SIZE(attrs) == 3 ? w_object(PyTuple_GET_ITEM(attrs, 2), 2) : 0;
    }
    return w_object(attrs, 1);
}

/* a Root's children: entries (span id, name, kind, start, end, attributes, events, status) */
static int w_children(PyObject *children) {
    if (!PyList_CheckExact(children))
        return w_object(children, 1);
    Py_ssize_t n = PyList_GET_SIZE(children);
    if (reserve(5) < 0)
        return -1;
    buf[buf_len++] = '[';
    put_i32((int32_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(children, i);
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 8) {
            if (w_object(e, 2) < 0)
                return -1;
            continue;
        }
        if (reserve(2) < 0)
            return -1;
        buf[buf_len++] = ')';
        buf[buf_len++] = 8;
        for (int k = 0; k < 8; k++)
            if ((k == 5 ? w_attrs(PyTuple_GET_ITEM(e, 5)) : w_object(PyTuple_GET_ITEM(e, k), 2)) < 0)
                return -1;
    }
    return 0;
}

/* called once a record is written (or failed: then it is rolled back and counted as dropped) */
static void written(Py_ssize_t mark, int rc) {
    if (rc < 0) {
        buf_len = mark;
        PyErr_Clear();
        buf_dropped++;
        return;
    }
    if (++buf_count == buf_batch && wake != NULL) {
        PyObject *r = PyObject_CallNoArgs(wake);
        if (r == NULL)
            PyErr_Clear();
        Py_XDECREF(r);
    }
}

static int hand_to_sink(PyObject *record) { /* a Python sink: the record as a tuple */
    if (record == NULL)
        return -1;
    PyObject *r = PyObject_CallOneArg(sink, record);
    Py_DECREF(record);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* a Record tuple from Python (trace_recorder.Span, Child): its attributes and children as a Root's are written */
static int w_record(PyObject *r) {
    if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 13)
        return w_object(r, 0);
    if (reserve(2) < 0)
        return -1;
    buf[buf_len++] = ')';
    buf[buf_len++] = 13;
    for (int k = 0; k < 13; k++) {
        PyObject *v = PyTuple_GET_ITEM(r, k);
        int rc = k == 8 ? w_attrs(v) : (k == 12 && v != Py_None) ? w_children(v) : w_object(v, 1);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* ---- Root: the server span of a request whose trace begins here ---- */

typedef struct {
    PyObject_HEAD
    uint64_t hi, lo, span_id;
    long long start_ns;
    char sampled, recording;
    PyObject *attributes, *events, *status, *children, *token;
    /* children ended through close_call / leaf while it was open, already written (buffer mode): `cn` entries in
     * `cbuf` [0, clen); those Python code ended go into `children` */
    char *cbuf;
    Py_ssize_t clen, ccap, cn;
} Root;

static inline PyObject *or_none(PyObject *o) { return (o == NULL) ? Py_None : o; }

static PyObject *u128_object(uint64_t hi, uint64_t lo) {
    if (!hi)
        return PyLong_FromUnsignedLongLong(lo);
    PyObject *h = PyLong_FromUnsignedLongLong(hi), *l = PyLong_FromUnsignedLongLong(lo), *shift = PyLong_FromLong(64);
    PyObject *out = NULL, *shifted = NULL;
    if (h && l && shift && (shifted = PyNumber_Lshift(h, shift)))
        out = PyNumber_Or(shifted, l);
    Py_XDECREF(h);
    Py_XDECREF(l);
    Py_XDECREF(shift);
    Py_XDECREF(shifted);
    return out;
}

static PyObject *root_new(PyObject *module, PyObject *unused) {
    Root *r = PyObject_GC_New(Root, RootType);
    if (r == NULL)
        return NULL;
    r->span_id = new_id();
    r->hi = next64();
    r->lo = next64();
    if (!(r->hi | r->lo))
        r->lo = 1;
    r->sampled = r->recording = bound_all || r->lo < bound;
    r->start_ns = now_ns();
    r->attributes = r->events = r->status = r->children = NULL;
    r->token = NULL;
    r->cbuf = NULL;
    r->clen = r->ccap = r->cn = 0;
    PyObject_GC_Track(r);
    r->token = PyContextVar_Set(current_var, (PyObject *)r);
    if (r->token == NULL) {
        Py_DECREF(r);
        return NULL;
    }
    return (PyObject *)r;
}

static int root_traverse(Root *r, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(r));
    Py_VISIT(r->attributes);
    Py_VISIT(r->events);
    Py_VISIT(r->status);
    Py_VISIT(r->children);
    Py_VISIT(r->token);
    return 0;
}

static int root_clear(Root *r) {
    Py_CLEAR(r->attributes);
    Py_CLEAR(r->events);
    Py_CLEAR(r->status);
    Py_CLEAR(r->children);
    Py_CLEAR(r->token);
    return 0;
}

static void root_dealloc(Root *r) {
    PyTypeObject *type = Py_TYPE(r);
    PyObject_GC_UnTrack(r);
    root_clear(r);
    PyMem_Free(r->cbuf);
    PyObject_GC_Del(r);
    Py_DECREF(type);
}

/* the record of a finished Root: trace_recorder.Record's fields, in order */
static int w_root(Root *r, PyObject *name, PyObject *attrs, long long end) {
    if (reserve(2) < 0)
        return -1;
    buf[buf_len++] = ')';
    buf[buf_len++] = 13;
    if (w_u128(((unsigned __int128)r->hi << 64) | r->lo) < 0 || w_u64(r->span_id) < 0 || w_u64(0) < 0 ||
        w_byte('F') < 0 || w_object(name, 1) < 0 || w_u64(SERVER) < 0 || w_i64(r->start_ns) < 0 || w_i64(end) < 0 ||
        w_attrs(attrs) < 0 || w_object(or_none(r->events), 1) < 0 || w_object(or_none(r->status), 1) < 0 ||
        reserve(2) < 0)
        return -1;
    buf[buf_len++] = 'z'; /* tracestate: "" for a trace begun here */
    buf[buf_len++] = 0;
    PyObject *children = or_none(r->children);
    if (children != Py_None && PyList_Check(children) && PyList_GET_SIZE(children) == 0)
        children = Py_None; /* as the Python recorder: an empty list is no children */
    if (r->cn == 0)
        return children == Py_None ? w_byte('N') : w_children(children);
    /* the entries written as they ended, then those in `children` */
    Py_ssize_t more = (children != Py_None && PyList_CheckExact(children)) ? PyList_GET_SIZE(children) : 0;
    if (children != Py_None && !PyList_CheckExact(children)) {
        PyErr_SetString(PyExc_TypeError, "a Root's children must be a list");
        return -1;
    }
    if (reserve(5 + r->clen) < 0)
        return -1;
    buf[buf_len++] = '[';
    put_i32((int32_t)(r->cn + more));
    memcpy(buf + buf_len, r->cbuf, (size_t)r->clen);
    buf_len += r->clen;
    if (more == 0)
        return 0;
    Py_ssize_t mark = buf_len;
    if (w_children(children) < 0)
        return -1;
    memmove(buf + mark, buf + mark + 5, (size_t)(buf_len - mark - 5)); /* drop w_children's own list header */
    buf_len -= 5;
    return 0;
}

static void record_root(Root *r, PyObject *name, PyObject *names, PyObject *values, long long end) {
    PyObject *attrs = (r->attributes == NULL || r->attributes == Py_None) ? PyTuple_Pack(2, names, values)
                                                                           : PyTuple_Pack(3, names, values, r->attributes);
    if (attrs == NULL) {
        PyErr_Clear();
        buf_dropped++;
        return;
    }
    if (sink != NULL) {
        PyObject *trace_id = u128_object(r->hi, r->lo);
        PyObject *record = trace_id == NULL ? NULL : Py_BuildValue(
            "(NKiOOiLLOOOsO)", trace_id, (unsigned long long)r->span_id, 0, Py_False, name, SERVER, r->start_ns, end,
            attrs, or_none(r->events), or_none(r->status), "", or_none(r->children));
        if (hand_to_sink(record) < 0)
            PyErr_WriteUnraisable(NULL);
    } else if (buf_count >= buf_limit || swapped) {
        buf_dropped++;
    } else {
        Py_ssize_t mark = buf_len;
        written(mark, w_root(r, name, attrs, end));
    }
    Py_DECREF(attrs);
}

static PyObject *root_finish(Root *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "finish(name, names, values, error=None)");
        return NULL;
    }
    if (self->token != NULL) {
        if (PyContextVar_Reset(current_var, self->token) < 0)
            PyErr_Clear(); /* ended in another context than it began in */
        Py_CLEAR(self->token);
    }
    if (!self->recording)
        Py_RETURN_NONE;
    if (nargs == 4 && args[3] != Py_None) {
        PyObject *r = PyObject_CallFunctionObjArgs(finish_error, (PyObject *)self, args[3], NULL);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    self->recording = 0;
    record_root(self, args[0], args[1], args[2], now_ns());
    Py_RETURN_NONE;
}

static PyObject *root_set_attribute(Root *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_attribute(key, value)");
        return NULL;
    }
    if (self->attributes == NULL || self->attributes == Py_None) {
        PyObject *d = PyDict_New();
        if (d == NULL)
            return NULL;
        Py_XSETREF(self->attributes, d);
    }
    if (PyObject_SetItem(self->attributes, args[0], args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *format_traceparent(uint64_t hi, uint64_t lo, uint64_t span_id, int sampled) {
    static const char hex[] = "0123456789abcdef";
    PyObject *s = PyUnicode_New(55, 127);
    if (s == NULL)
        return NULL;
    Py_UCS1 *p = PyUnicode_1BYTE_DATA(s);
    memcpy(p, "00-", 3);
    for (int i = 0; i < 16; i++) {
        p[3 + i] = hex[(hi >> (60 - 4 * i)) & 0xf];
        p[19 + i] = hex[(lo >> (60 - 4 * i)) & 0xf];
        p[36 + i] = hex[(span_id >> (60 - 4 * i)) & 0xf];
    }
    p[35] = p[52] = '-';
    p[53] = '0';
    p[54] = sampled ? '1' : '0';
    return s;
}

static PyObject *root_traceparent(Root *self, PyObject *unused) {
    return format_traceparent(self->hi, self->lo, self->span_id, self->sampled);
}

static PyObject *root_get_trace_id(Root *self, void *c) { return u128_object(self->hi, self->lo); }
static PyObject *root_get_span_id(Root *self, void *c) { return PyLong_FromUnsignedLongLong(self->span_id); }

static PyObject *root_get_trace_id_hex(Root *self, void *c) {
    PyObject *tp = format_traceparent(self->hi, self->lo, 0, 0);
    if (tp == NULL)
        return NULL;
    PyObject *out = PyUnicode_Substring(tp, 3, 35);
    Py_DECREF(tp);
    return out;
}

static PyMethodDef root_methods[] = {
    {"finish", (PyCFunction)(void (*)(void))root_finish, METH_FASTCALL,
     "finish(name, names, values, error=None): end the span (once), restore the span current before it and record it"},
    {"set_attribute", (PyCFunction)(void (*)(void))root_set_attribute, METH_FASTCALL, "set one attribute"},
    {"traceparent", (PyCFunction)root_traceparent, METH_NOARGS, "the span's W3C traceparent"},
    {NULL}};

static PyMemberDef root_members[] = {
    {"sampled", T_BOOL, offsetof(Root, sampled), READONLY, NULL},
    {"recording", T_BOOL, offsetof(Root, recording), 0, NULL},
    {"start_ns", T_LONGLONG, offsetof(Root, start_ns), 0, NULL},
    {"attributes", T_OBJECT, offsetof(Root, attributes), 0, NULL},
    {"events", T_OBJECT, offsetof(Root, events), 0, NULL},
    {"status", T_OBJECT, offsetof(Root, status), 0, NULL},
    {"children", T_OBJECT, offsetof(Root, children), 0, NULL},
    {NULL}};

static PyGetSetDef root_getset[] = {
    {"trace_id", (getter)root_get_trace_id, NULL, NULL, NULL},
    {"span_id", (getter)root_get_span_id, NULL, NULL, NULL},
    {"trace_id_hex", (getter)root_get_trace_id_hex, NULL, NULL, NULL},
    {NULL}};

static PyType_Slot root_slots[] = {
    {Py_tp_doc, "The server span of a request whose trace begins here (made by root(); see trace_recorder.Root)."},
    {Py_tp_dealloc, root_dealloc},
    {Py_tp_traverse, root_traverse},
    {Py_tp_clear, root_clear},
    {Py_tp_methods, root_methods},
    {Py_tp_members, root_members},
    {Py_tp_getset, root_getset},
    {0, NULL}};

static PyType_Spec root_spec = {"services.common._spanrec.Root", sizeof(Root), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
                                root_slots};

/* ---- children of a Root: calls and leaves ---- */

/* (buffer mode) a child entry written into its Root's own buffer, which stands in for the global one meanwhile */
static int write_child(Root *p, uint64_t span_id, PyObject *name, PyObject *kind, PyObject *start, PyObject *names,
                       PyObject *values) {
    long long end = now_ns();
    char *saved = buf;
    Py_ssize_t saved_len = buf_len, saved_cap = buf_cap;
    buf = p->cbuf, buf_len = p->clen, buf_cap = p->ccap;
    swapped = 1;
    int rc = reserve(2);
    if (rc == 0) {
        buf[buf_len++] = ')';
        buf[buf_len++] = 8;
        rc = (w_u64(span_id) < 0 || w_object(name, 1) < 0 || w_object(kind, 1) < 0 || w_object(start, 1) < 0 ||
              w_i64(end) < 0 || reserve(2) < 0) ? -1 : 0;
    }
    if (rc == 0) {
        buf[buf_len++] = ')';
        buf[buf_len++] = 2;
        rc = (w_names(names) < 0 || w_object(values, 2) < 0 || reserve(2) < 0) ? -1 : 0;
    }
    if (rc == 0) {
        buf[buf_len++] = 'N'; /* events */
        buf[buf_len++] = 'N'; /* status */
        p->clen = buf_len;
        p->cn++;
    }
    p->cbuf = buf, p->ccap = buf_cap; /* it may have grown; a failed entry is left out (clen unchanged) */
    buf = saved, buf_len = saved_len, buf_cap = saved_cap;
    swapped = 0;
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
    if (PyContextVar_Get(current_var, Py_None, &p) < 0)
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
                         args[3], args[4]) < 0)
            return NULL;
        Py_RETURN_NONE;
    }
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
        int rc = append_child((Root *)p, zero, args[0], args[1], args[2], args[3], args[4]);
        Py_DECREF(p);
        if (rc < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    Py_DECREF(p);
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

static PyObject *py_server_span, *py_put_context, *py_set_attribute, *str_traceparent;
static int propagate = 1; /* OTEL_PROPAGATORS has tracecontext */

static PyObject *server_span(PyObject *module, PyObject *headers) {
    int has = PySequence_Contains(headers, str_traceparent);
    if (has < 0)
        return NULL;
    if (has) /* under a caller's span: tracing.server_span's Span */
        return PyObject_CallOneArg(py_server_span, headers);
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
    PyObject *out = Py_TYPE(p) == RootType ? root_set_attribute((Root *)p, args, nargs)
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
    if (PyTuple_CheckExact(opened) && PyTuple_GET_SIZE(opened) == 3 && Py_TYPE(PyTuple_GET_ITEM(opened, 0)) == RootType) {
        PyObject *tp = call_traceparent(module, opened); /* a Root's trace has no tracestate or baggage to pass on */
        if (tp == NULL)
            return NULL;
        int rc = PyObject_SetItem(args[0], str_traceparent, tp);
        Py_DECREF(tp);
        if (rc < 0)
            return NULL;
        Py_RETURN_TRUE;
    }
    return PyObject_Vectorcall(py_put_context, args, (size_t)nargs, NULL);
}

static PyObject *bind(PyObject *module, PyObject *args) {
    PyObject *ss, *pc, *sa;
    int prop;
    if (!PyArg_ParseTuple(args, "OOOp", &ss, &pc, &sa, &prop))
        return NULL;
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
    if (buf_count >= buf_limit || swapped) {
        buf_dropped++;
        Py_RETURN_NONE;
    }
    Py_ssize_t mark = buf_len;
    written(mark, w_record(record));
    Py_RETURN_NONE;
}

static PyObject *take(PyObject *module, PyObject *unused) {
    PyObject *data = PyBytes_FromStringAndSize(buf, buf_len);
    if (data == NULL)
        return NULL;
    PyObject *out = Py_BuildValue("(nN)", buf_count, data);
    if (out == NULL)
        return NULL;
    buf_len = buf_count = 0;
    if (buf_cap > (1 << 22)) { /* a burst grew it: give the memory back */
        PyMem_Free(buf);
        buf = NULL;
        buf_cap = 0;
    }
    return out;
}

static PyObject *dropped(PyObject *module, PyObject *unused) { return PyLong_FromUnsignedLongLong(buf_dropped); }

static PyObject *waiting(PyObject *module, PyObject *unused) { return PyLong_FromSsize_t(buf_count); }

static PyObject *configure(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"current", "bound", "finish_error", "close_call", "leaf", "sink", NULL};
    PyObject *var, *bound_obj, *fe, *cc, *lf, *sk = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|O", names, &var, &bound_obj, &fe, &cc, &lf, &sk))
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
     "tracing.put_context: an open_call's traceparent into a request's trace_context"},
    {"bind", bind, METH_VARARGS,
     "bind(server_span, put_context, set_attribute, propagate): tracing's Python helpers, for what C does not handle"},
    {"take", take, METH_NOARGS, "(count, bytes): the records written since the last take, in marshal's format"},
    {"dropped", dropped, METH_NOARGS, "records dropped so far (the buffer was full)"},
    {"waiting", waiting, METH_NOARGS, "records in the buffer"},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(current, bound, finish_error, close_call, leaf, sink=None)"},
    {"set_buffer", set_buffer, METH_VARARGS, "set_buffer(limit, batch, wake): the buffer's bound, batch and wake-up"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_spanrec",
                                        "The native span recorder (see services/common/_spanrec.c).", -1,
                                        module_methods};

static void reseed_in_child(void) { seed_ids(); }

PyMODINIT_FUNC PyInit__spanrec(void) {
    seed_ids();
    pthread_atfork(NULL, NULL, reseed_in_child);
    zero = PyLong_FromLong(0);
    str_traceparent = PyUnicode_InternFromString("traceparent");
    if (zero == NULL || str_traceparent == NULL)
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
