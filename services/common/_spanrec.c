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

/* ---- the buffer: OTLP Span messages, each a ScopeSpans.spans field, as trace_otlp.span encodes them ---- */

static char *buf;
static Py_ssize_t buf_len, buf_cap, buf_count, buf_limit, buf_batch = 512; /* buf_count: spans */
static unsigned long long buf_dropped;
static int swapped; /* the buffer is a Root's while its child is written (write_child) */
/* A record is being written. Writing can call into Python (a value's str(), a key's hash): meanwhile another thread
 * may run, or the same one come back here. None of them may touch the buffer: their spans are dropped and counted,
 * and take() gives nothing until the write is done. */
static int writing;

static int grow(Py_ssize_t n) {
    Py_ssize_t cap = buf_cap ? buf_cap : swapped ? 512 : 65536;
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

static inline void put_varint(uint64_t v) { /* after a reserve of 10 */
    while (v >= 0x80) {
        buf[buf_len++] = (char)((v & 0x7f) | 0x80);
        v >>= 7;
    }
    buf[buf_len++] = (char)v;
}

static inline int w_raw(const char *p, Py_ssize_t n) {
    if (reserve(n) < 0)
        return -1;
    memcpy(buf + buf_len, p, (size_t)n);
    buf_len += n;
    return 0;
}

/* a length-delimited field with `n` bytes of payload */
static inline int w_field(char tag, const char *p, Py_ssize_t n) {
    if (reserve(11 + n) < 0)
        return -1;
    buf[buf_len++] = tag;
    put_varint((uint64_t)n);
    memcpy(buf + buf_len, p, (size_t)n);
    buf_len += n;
    return 0;
}

static inline int w_varint_field(char tag, uint64_t v) {
    if (reserve(11) < 0)
        return -1;
    buf[buf_len++] = tag;
    put_varint(v);
    return 0;
}

static inline int w_fixed64(char tag, uint64_t v) {
    if (reserve(9) < 0)
        return -1;
    buf[buf_len++] = tag;
    memcpy(buf + buf_len, &v, 8); /* little-endian host (x86-64, aarch64), as protobuf's fixed64 */
    buf_len += 8;
    return 0;
}

static inline void put_be64(uint64_t v) { /* after a reserve */
    v = __builtin_bswap64(v); /* big-endian, from a little-endian host */
    memcpy(buf + buf_len, &v, 8);
    buf_len += 8;
}

/* a length-delimited field whose length is known once its payload is written: open writes the tag and a one-byte
 * placeholder, close writes the length there (moving the payload when it takes more bytes) */
static inline int open_field(char tag, Py_ssize_t *mark) {
    if (reserve(2) < 0)
        return -1;
    buf[buf_len++] = tag;
    *mark = buf_len++;
    return 0;
}

/* the same with a two-byte placeholder, for a field whose payload is mostly 128 bytes to 16 KB (a Span) */
static inline int open_span_field(Py_ssize_t *mark) {
    if (reserve(3) < 0)
        return -1;
    buf[buf_len++] = 0x12;
    *mark = buf_len;
    buf_len += 2;
    return 0;
}

static int close_field(Py_ssize_t mark);

static int close_span_field(Py_ssize_t mark) {
    uint64_t n = (uint64_t)(buf_len - mark - 2);
    if (n >= 0x80 && n < 0x4000) {
        buf[mark] = (char)((n & 0x7f) | 0x80);
        buf[mark + 1] = (char)(n >> 7);
        return 0;
    }
    memmove(buf + mark + 1, buf + mark + 2, (size_t)n); /* back to a one-byte placeholder */
    buf_len--;
    return close_field(mark);
}

static int close_field(Py_ssize_t mark) {
    uint64_t n = (uint64_t)(buf_len - mark - 1);
    if (n < 0x80) {
        buf[mark] = (char)n;
        return 0;
    }
    int size = 1;
    for (uint64_t v = n; v >= 0x80; v >>= 7)
        size++;
    if (reserve(size - 1) < 0)
        return -1;
    memmove(buf + mark + size, buf + mark + 1, (size_t)n);
    Py_ssize_t end = buf_len + size - 1;
    buf_len = mark;
    put_varint(n);
    buf_len = end;
    return 0;
}

/* a str as a string field: its UTF-8 (text that is not valid Unicode has its lone surrogates replaced) */
static int w_str_field(char tag, PyObject *s) {
    if (PyUnicode_IS_COMPACT_ASCII(s))
        return w_field(tag, (const char *)PyUnicode_DATA(s), PyUnicode_GET_LENGTH(s));
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(s, &n);
    if (utf8 != NULL)
        return w_field(tag, utf8, n);
    PyErr_Clear();
    PyObject *b = PyUnicode_AsEncodedString(s, "utf-8", "replace");
    if (b == NULL)
        return -1;
    int rc = w_field(tag, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b));
    Py_DECREF(b);
    return rc;
}

static int w_text_field(char tag, PyObject *o) { /* any object as a string field: a str, else its str() */
    if (PyUnicode_Check(o))
        return w_str_field(tag, o);
    PyObject *s = PyObject_Str(o);
    if (s == NULL)
        return -1;
    int rc = w_str_field(tag, s);
    Py_DECREF(s);
    return rc;
}

/* an AnyValue message's fields (trace_otlp.any_value): str, bool, int64, float, bytes and lists of those; anything
 * else, ints beyond int64 and lists nested deeper than MAX_DEPTH as their str() */
static int w_any(PyObject *v, int depth) {
    if (PyUnicode_CheckExact(v))
        return w_str_field(0x0a, v);
    if (v == Py_True || v == Py_False)
        return w_varint_field(0x10, v == Py_True);
    if (PyLong_CheckExact(v)) {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred())
            return -1;
        if (!overflow)
            return w_varint_field(0x18, (uint64_t)x); /* int64: two's complement */
    } else if (PyFloat_CheckExact(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        return w_fixed64(0x21, bits);
    } else if (PyBytes_CheckExact(v)) {
        return w_field(0x3a, PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v));
    } else if ((PyList_CheckExact(v) || PyTuple_CheckExact(v)) && depth < MAX_DEPTH) {
        Py_ssize_t array;
        if (open_field(0x2a, &array) < 0)
            return -1;
        /* a list may change while an item's str() runs: its size is read again and each item held while used */
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(v); i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(v, i);
            Py_ssize_t value;
            Py_INCREF(item);
            int rc = (open_field(0x0a, &value) < 0 || w_any(item, depth + 1) < 0 || close_field(value) < 0) ? -1 : 0;
            Py_DECREF(item);
            if (rc < 0)
                return -1;
        }
        return close_field(array);
    }
    PyObject *text = PyObject_Str(v); /* as trace_otlp: anything else (str and int subclasses too) as its str() */
    if (text == NULL)
        return -1;
    int rc = w_str_field(0x0a, text);
    Py_DECREF(text);
    return rc;
}

/* A KeyValue's key field per attribute name, made once: `radixmesh.` before a bare name. The cache holds the name
 * (so that its address cannot be reused by another object meanwhile). */
#define KEY_SLOTS 512
static struct {
    PyObject *name;
    char *data;
    Py_ssize_t n;
} keys[KEY_SLOTS];

#define KEY_PROBES 8 /* slots a name may take, from its hash on: two names that share a slot both stay */

/* the encoded key field of attribute `name` (*data, *n), from the cache (made and kept on a miss) */
static int key_bytes(PyObject *name, const char **data, Py_ssize_t *n) {
    size_t home = ((uintptr_t)name >> 4) % KEY_SLOTS, slot = home;
    for (int i = 0; i < KEY_PROBES; i++) {
        size_t at = (home + (size_t)i) % KEY_SLOTS;
        if (keys[at].name == name) {
            *data = keys[at].data, *n = keys[at].n;
            return 0;
        }
        if (keys[at].name == NULL) { /* never taken: the name is not further on either */
            slot = at;
            break;
        }
    }
    PyObject *text = PyUnicode_Check(name) ? (Py_INCREF(name), name) : PyObject_Str(name);
    if (text == NULL)
        return -1;
    int dotted = PyUnicode_FindChar(text, '.', 0, PyUnicode_GET_LENGTH(text), 1) >= 0;
    PyObject *full = dotted ? (Py_INCREF(text), text) : PyUnicode_FromFormat("radixmesh.%U", text);
    Py_DECREF(text);
    if (full == NULL)
        return -1;
    /* encoded through the buffer's writer, after the buffer's end, then moved out */
    Py_ssize_t mark = buf_len;
    int rc = w_str_field(0x0a, full);
    Py_DECREF(full);
    if (rc < 0)
        return -1;
    Py_ssize_t size = buf_len - mark;
    buf_len = mark;
    char *copy = PyMem_Malloc((size_t)size);
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, buf + mark, (size_t)size);
    Py_XDECREF(keys[slot].name);
    PyMem_Free(keys[slot].data);
    Py_INCREF(name);
    keys[slot].name = name;
    keys[slot].data = copy;
    keys[slot].n = size;
    *data = copy, *n = size;
    return 0;
}

/* A KeyValue whose value is an ASCII str, an int64 or a bool and whose lengths all fit one byte, in one go: the
 * bytes w_attribute's general path writes for it. 1: written; 0: not that case. */
static int w_short_attribute(char tag, const char *key, Py_ssize_t kn, PyObject *value) {
    char scalar[11]; /* an int or bool value: its AnyValue field's tag and varint */
    const char *payload;
    Py_ssize_t pn; /* the AnyValue message's size */
    if (PyUnicode_CheckExact(value) && PyUnicode_IS_COMPACT_ASCII(value) && PyUnicode_GET_LENGTH(value) < 0x80) {
        payload = (const char *)PyUnicode_DATA(value);
        pn = 2 + PyUnicode_GET_LENGTH(value);
    } else if (value == Py_True || value == Py_False) {
        scalar[0] = 0x10, scalar[1] = value == Py_True;
        payload = scalar, pn = 2;
    } else if (PyLong_CheckExact(value)) {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        uint64_t v = (uint64_t)x;
        pn = 1;
        scalar[0] = 0x18;
        while (v >= 0x80) {
            scalar[pn++] = (char)((v & 0x7f) | 0x80);
            v >>= 7;
        }
        scalar[pn++] = (char)v;
        payload = scalar;
    } else {
        return 0;
    }
    Py_ssize_t kvn = kn + 2 + pn;
    if (kvn >= 0x80)
        return 0;
    if (reserve(2 + kvn) < 0)
        return -1;
    char *p = buf + buf_len;
    *p++ = tag;
    *p++ = (char)kvn;
    memcpy(p, key, (size_t)kn);
    p += kn;
    *p++ = 0x12;
    *p++ = (char)pn;
    if (payload == scalar) {
        memcpy(p, scalar, (size_t)pn);
    } else {
        *p++ = 0x0a;
        *p++ = (char)(pn - 2);
        memcpy(p, payload, (size_t)(pn - 2));
    }
    buf_len += 2 + kvn;
    return 1;
}

static int w_attribute(char tag, PyObject *name, PyObject *value) { /* a KeyValue; None values are left out */
    if (value == Py_None)
        return 0;
    const char *key;
    Py_ssize_t kn;
    if (key_bytes(name, &key, &kn) < 0)
        return -1;
    int done = w_short_attribute(tag, key, kn, value);
    if (done != 0)
        return done < 0 ? -1 : 0;
    Py_ssize_t kv, any;
    if (open_field(tag, &kv) < 0 || w_raw(key, kn) < 0 || open_field(0x12, &any) < 0 || w_any(value, 0) < 0 ||
        close_field(any) < 0)
        return -1;
    return close_field(kv);
}

static int w_dict_attributes(char tag, PyObject *d) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &pos, &k, &v)) {
        Py_INCREF(k); /* a value's str() may change the dict */
        Py_INCREF(v);
        int rc = w_attribute(tag, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        if (rc < 0)
            return -1;
    }
    return 0;
}

static PyObject *attributes_of; /* trace_recorder._attributes: any attributes as a dict */

/* Names tuples known to hold distinct str names (the call sites' constants), so zip(names, values) is the dict */
#define NAMES_SLOTS 64
static PyObject *distinct_names[NAMES_SLOTS];

static int names_distinct(PyObject *names) {
    size_t home = ((uintptr_t)names >> 4) % NAMES_SLOTS, slot = home;
    for (int i = 0; i < KEY_PROBES; i++) { /* probed as the keys are */
        size_t at = (home + (size_t)i) % NAMES_SLOTS;
        if (distinct_names[at] == names)
            return 1;
        if (distinct_names[at] == NULL) {
            slot = at;
            break;
        }
    }
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_CheckExact(a))
            return 0;
        for (Py_ssize_t j = 0; j < i; j++)
            if (PyUnicode_Compare(a, PyTuple_GET_ITEM(names, j)) == 0)
                return 0;
    }
    Py_INCREF(names);
    Py_XSETREF(distinct_names[slot], names);
    return 1;
}

static int w_named_attributes(char tag, PyObject *names, PyObject *values, PyObject *more);

static int w_via_python(char tag, PyObject *attrs) { /* any other shape, as trace_recorder._attributes reads it */
    if (attributes_of == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the span recorder is not configured");
        return -1;
    }
    PyObject *d = PyObject_CallOneArg(attributes_of, attrs);
    if (d == NULL)
        return -1;
    int rc = PyDict_Check(d) ? w_dict_attributes(tag, d) : 0;
    Py_DECREF(d);
    return rc;
}

/* attributes as the recorder keeps them: a dict, or (names, values) / (names, values, more as a dict), in the
 * order trace_recorder.expand makes them; shapes other than those (and repeated names) through its _attributes */
static int w_attributes(char tag, PyObject *attrs) {
    if (PyDict_CheckExact(attrs))
        return w_dict_attributes(tag, attrs);
    if (PyTuple_CheckExact(attrs) && (PyTuple_GET_SIZE(attrs) == 2 || PyTuple_GET_SIZE(attrs) == 3)) {
        Py_INCREF(attrs); /* holds names, values and more while values' str() run */
        int rc = w_named_attributes(tag, PyTuple_GET_ITEM(attrs, 0), PyTuple_GET_ITEM(attrs, 1),
                                    PyTuple_GET_SIZE(attrs) == 3 ? PyTuple_GET_ITEM(attrs, 2) : NULL);
        Py_DECREF(attrs);
        return rc;
    }
    return w_via_python(tag, attrs);
}

/* `values` under `names` (distinct str names: a call site's constant), then `more` (a dict, or NULL) where it
 * names others; the caller holds all three. Other shapes go through trace_recorder._attributes as one tuple. */
static int w_named_attributes(char tag, PyObject *names, PyObject *values, PyObject *more) {
    if (!PyTuple_CheckExact(names) || !PyTuple_CheckExact(values) || (more != NULL && !PyDict_CheckExact(more)) ||
        !names_distinct(names)) {
        PyObject *attrs = more == NULL ? PyTuple_Pack(2, names, values) : PyTuple_Pack(3, names, values, more);
        if (attrs == NULL)
            return -1;
        int rc = w_via_python(tag, attrs);
        Py_DECREF(attrs);
        return rc;
    }
    Py_ssize_t n = Py_MIN(PyTuple_GET_SIZE(names), PyTuple_GET_SIZE(values));
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i), *value = PyTuple_GET_ITEM(values, i);
        if (more != NULL) { /* the dict's value at the tuple's place (names are exact str: no Python runs here) */
            PyObject *over = PyDict_GetItemWithError(more, name);
            if (over != NULL)
                value = over;
            else if (PyErr_Occurred())
                rc = -1;
        }
        if (rc == 0) {
            Py_INCREF(value);
            rc = w_attribute(tag, name, value);
            Py_DECREF(value);
        }
    }
    if (rc == 0 && more != NULL) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (rc == 0 && PyDict_Next(more, &pos, &k, &v)) {
            Py_INCREF(k);
            Py_INCREF(v);
            int seen = 0;
            for (Py_ssize_t i = 0; i < n && seen == 0; i++)
                seen = PyObject_RichCompareBool(PyTuple_GET_ITEM(names, i), k, Py_EQ);
            rc = seen < 0 ? -1 : (!seen && w_attribute(tag, k, v) < 0) ? -1 : 0;
            Py_DECREF(k);
            Py_DECREF(v);
        }
    }
    return rc;
}

static int w_events(PyObject *events) { /* [(name, time ns, attributes dict)] */
    if (events == NULL || events == Py_None)
        return 0;
    PyObject *seq = PySequence_Fast(events, "events must be a sequence");
    if (seq == NULL)
        return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && rc == 0; i++) {
        PyObject *e = PySequence_Fast_GET_ITEM(seq, i), *fields = NULL;
        Py_INCREF(e);
        Py_ssize_t event;
        if ((PyTuple_Check(e) || PyList_Check(e)) && (fields = PySequence_Tuple(e)) != NULL &&
            PyTuple_GET_SIZE(fields) == 3) {
            uint64_t at = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(fields, 1));
            PyObject *attrs = PyTuple_GET_ITEM(fields, 2);
            rc = (at == (unsigned long long)-1 && PyErr_Occurred()) || open_field(0x5a, &event) < 0 ||
                         w_fixed64(0x09, at) < 0 || w_text_field(0x12, PyTuple_GET_ITEM(fields, 0)) < 0 ||
                         (PyDict_Check(attrs) && w_dict_attributes(0x1a, attrs) < 0) || close_field(event) < 0
                     ? -1
                     : 0;
        } else if (PyErr_Occurred()) {
            rc = -1;
        }
        Py_XDECREF(fields);
        Py_DECREF(e);
    }
    Py_DECREF(seq);
    return rc;
}

static int w_status(PyObject *status) { /* (code, description) */
    if (status == NULL || status == Py_None || !PyTuple_Check(status) || PyTuple_GET_SIZE(status) != 2)
        return 0;
    uint64_t code = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(status, 0));
    Py_ssize_t mark;
    if ((code == (unsigned long long)-1 && PyErr_Occurred()) || open_field(0x7a, &mark) < 0 ||
        w_text_field(0x12, PyTuple_GET_ITEM(status, 1)) < 0 || w_varint_field(0x18, code) < 0)
        return -1;
    return close_field(mark);
}

/* A span's attributes: `any` in a shape w_attributes takes (NULL or None: none); or a call site's `values` under
 * `names` (w_named_attributes), then, where `key` is set, one more: `key` = `value`. The caller holds them. */
typedef struct {
    PyObject *any, *names, *values, *key, *value;
} Attrs;

static int w_attrs(char tag, const Attrs *a) {
    if (a->names == NULL)
        return (a->any != NULL && a->any != Py_None) ? w_attributes(tag, a->any) : 0;
    if (w_named_attributes(tag, a->names, a->values, NULL) < 0)
        return -1;
    return a->key != NULL ? w_attribute(tag, a->key, a->value) : 0;
}

/* One span, as a ScopeSpans.spans field holding a Span message (trace_otlp.span's fields, in its order).
 * `tracestate` may be NULL (none); `events`, `status` NULL or None for none. */
static int w_span(uint64_t hi, uint64_t lo, uint64_t span_id, uint64_t parent_id, int remote, PyObject *tracestate,
                  PyObject *name, uint64_t kind, uint64_t start, uint64_t end, const Attrs *attrs,
                  PyObject *events, PyObject *status) {
    Py_ssize_t mark;
    if (open_span_field(&mark) < 0 || reserve(28) < 0)
        return -1;
    buf[buf_len++] = 0x0a;
    buf[buf_len++] = 16;
    put_be64(hi);
    put_be64(lo);
    buf[buf_len++] = 0x12;
    buf[buf_len++] = 8;
    put_be64(span_id);
    if (tracestate != NULL && PyUnicode_Check(tracestate) && PyUnicode_GET_LENGTH(tracestate) &&
        w_str_field(0x1a, tracestate) < 0)
        return -1;
    if (parent_id) {
        if (reserve(10) < 0)
            return -1;
        buf[buf_len++] = 0x22;
        buf[buf_len++] = 8;
        put_be64(parent_id);
    }
    if (w_text_field(0x2a, name) < 0 || w_varint_field(0x30, kind) < 0 || w_fixed64(0x39, start) < 0 ||
        w_fixed64(0x41, end) < 0 || w_attrs(0x4a, attrs) < 0 ||
        w_events(events) < 0 || w_status(status) < 0 || reserve(6) < 0)
        return -1;
    uint32_t flags = remote ? 0x301 : 0x101; /* sampled; bit 8: whether the parent is remote is known; bit 9: it is */
    buf[buf_len++] = (char)0x85;
    buf[buf_len++] = 0x01;
    memcpy(buf + buf_len, &flags, 4);
    buf_len += 4;
    return close_span_field(mark);
}

static int id_of(PyObject *v, uint64_t *out) {
    *out = PyLong_AsUnsignedLongLongMask(v);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int u128_of(PyObject *v, uint64_t *hi, uint64_t *lo);

/* the children of a record, entries (span id, name, kind, start, end, attributes, events, status): spans of their own
 * under the record's span, a leaf (span id 0) given an id here (trace_recorder.expand) */
static int w_children(PyObject *children, uint64_t hi, uint64_t lo, uint64_t parent_id, PyObject *tracestate,
                      Py_ssize_t *spans) {
    if (children == NULL || children == Py_None)
        return 0;
    PyObject *seq = PySequence_Fast(children, "a span's children must be a sequence");
    if (seq == NULL)
        return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && rc == 0; i++) {
        PyObject *e = PySequence_Fast_GET_ITEM(seq, i);
        uint64_t span_id, kind, start, end;
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 8) {
            PyErr_SetString(PyExc_TypeError, "a child entry has 8 fields");
            rc = -1;
            break;
        }
        Py_INCREF(e);
        Attrs attrs = {PyTuple_GET_ITEM(e, 5)};
        rc = (id_of(PyTuple_GET_ITEM(e, 0), &span_id) < 0 || id_of(PyTuple_GET_ITEM(e, 2), &kind) < 0 ||
              id_of(PyTuple_GET_ITEM(e, 3), &start) < 0 || id_of(PyTuple_GET_ITEM(e, 4), &end) < 0 ||
              w_span(hi, lo, span_id ? span_id : new_id(), parent_id, 0, tracestate, PyTuple_GET_ITEM(e, 1), kind,
                     start, end, &attrs, PyTuple_GET_ITEM(e, 6), PyTuple_GET_ITEM(e, 7)) < 0)
                 ? -1
                 : 0;
        Py_DECREF(e);
        if (rc == 0)
            (*spans)++;
    }
    Py_DECREF(seq);
    return rc;
}

/* a Record tuple (trace_recorder.Span, Child, and what Python code handed to `add`), with its children */
static int w_record(PyObject *r, Py_ssize_t *spans) {
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) < 12 || PyTuple_GET_SIZE(r) > 13) {
        PyErr_SetString(PyExc_TypeError, "a span record is a Record tuple (12 or 13 fields)");
        return -1;
    }
    PyObject *const *f = &PyTuple_GET_ITEM(r, 0);
    uint64_t hi, lo, span_id, parent_id, kind, start, end;
    Attrs attrs = {f[8]};
    int remote = PyObject_IsTrue(f[3]);
    if (remote < 0 || u128_of(f[0], &hi, &lo) < 0 || id_of(f[1], &span_id) < 0 || id_of(f[2], &parent_id) < 0 ||
        id_of(f[5], &kind) < 0 || id_of(f[6], &start) < 0 || id_of(f[7], &end) < 0 ||
        w_span(hi, lo, span_id, parent_id, remote, f[11], f[4], kind, start, end, &attrs, f[9], f[10]) < 0)
        return -1;
    (*spans)++;
    return PyTuple_GET_SIZE(r) == 13 ? w_children(f[12], hi, lo, span_id, f[11], spans) : 0;
}

/* called once a record's spans are written (or failed: then they are rolled back and counted as dropped) */
/* where each record's spans end in the buffer, and the spans up to there: take(most) cuts between records */
static Py_ssize_t *rec_end, *rec_spans, rec_n, rec_cap;

static void written(Py_ssize_t mark, int rc, Py_ssize_t spans) {
    if (rc == 0 && rec_n == rec_cap) {
        Py_ssize_t cap = rec_cap ? 2 * rec_cap : 1024;
        Py_ssize_t *e = PyMem_Realloc(rec_end, (size_t)cap * sizeof *e), *n = e ? PyMem_Realloc(rec_spans, (size_t)cap * sizeof *n) : NULL;
        if (e != NULL)
            rec_end = e;
        if (n != NULL) {
            rec_spans = n;
            rec_cap = cap;
        } else {
            PyErr_NoMemory();
            rc = -1;
        }
    }
    if (rc < 0) {
        buf_len = mark;
        PyErr_Clear();
        buf_dropped += spans ? spans : 1;
        return;
    }
    Py_ssize_t before = buf_count;
    buf_count += spans;
    rec_end[rec_n] = buf_len;
    rec_spans[rec_n++] = buf_count;
    if (before < buf_batch && buf_count >= buf_batch && wake != NULL) {
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

/* ---- Root: the server span of a request whose trace begins here ---- */

typedef struct {
    PyObject_HEAD
    uint64_t hi, lo, span_id;
    long long start_ns;
    char sampled, recording;
    PyObject *attributes, *events, *status, *children, *token;
    /* the value of attribute "request_id" while it is the only attribute set (every request sets it): kept here, not
     * in a dict made for it (`attributes` makes the dict when Python code asks for it, root_set_attribute when
     * another attribute comes) */
    PyObject *request_id;
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
    if (not_configured(current_var))
        return NULL;
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
    r->token = r->request_id = NULL;
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
    Py_VISIT(r->request_id);
    return 0;
}

static int root_clear(Root *r) {
    Py_CLEAR(r->attributes);
    Py_CLEAR(r->events);
    Py_CLEAR(r->status);
    Py_CLEAR(r->children);
    Py_CLEAR(r->token);
    Py_CLEAR(r->request_id);
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
/* a finished Root's spans: its own, then its children (those written as they ended, then those in `children`) */
static int w_root(Root *r, PyObject *name, const Attrs *attrs, long long end, Py_ssize_t *spans) {
    /* held while written: the span's fields can be set again by Python code that runs meanwhile */
    PyObject *events = r->events, *status = r->status, *children = r->children;
    Py_XINCREF(events);
    Py_XINCREF(status);
    Py_XINCREF(children);
    int rc = w_span(r->hi, r->lo, r->span_id, 0, 0, NULL, name, SERVER, (uint64_t)r->start_ns, (uint64_t)end, attrs,
                    events, status);
    if (rc == 0) {
        *spans = 1 + r->cn;
        rc = r->clen ? w_raw(r->cbuf, r->clen) : 0;
    }
    if (rc == 0)
        rc = w_children(children, r->hi, r->lo, r->span_id, NULL, spans);
    Py_XDECREF(events);
    Py_XDECREF(status);
    Py_XDECREF(children);
    return rc;
}

static Py_ssize_t children_of(PyObject *children) {
    return (children != NULL && children != Py_None && PyList_Check(children)) ? PyList_GET_SIZE(children) : 0;
}

static PyObject *str_request_id;

/* the request_id slot moved into the attributes dict (made for it), as Python code and other attributes expect */
static int root_materialize(Root *r) {
    if (r->request_id == NULL)
        return 0;
    PyObject *d = PyDict_New();
    if (d == NULL || PyDict_SetItem(d, str_request_id, r->request_id) < 0) {
        Py_XDECREF(d);
        return -1;
    }
    Py_XSETREF(r->attributes, d);
    Py_CLEAR(r->request_id);
    return 0;
}

static int names_hold(PyObject *names, PyObject *key) { /* whether the names tuple holds str `key` */
    for (Py_ssize_t i = 0; PyTuple_CheckExact(names) && i < PyTuple_GET_SIZE(names); i++) {
        PyObject *n = PyTuple_GET_ITEM(names, i);
        if (n == key || (PyUnicode_Check(n) && PyUnicode_GET_LENGTH(n) == PyUnicode_GET_LENGTH(key) &&
                         PyUnicode_Compare(n, key) == 0))
            return 1;
    }
    PyErr_Clear();
    return 0;
}

static void record_root(Root *r, PyObject *name, PyObject *names, PyObject *values, long long end) {
    /* the request_id slot goes after the names' attributes, where a dict holding only it would put it */
    if (r->request_id != NULL && (sink != NULL || names_hold(names, str_request_id)) && root_materialize(r) < 0) {
        PyErr_Clear();
        buf_dropped += 1 + r->cn + children_of(r->children);
        return;
    }
    int dict = r->attributes != NULL && r->attributes != Py_None; /* then the slot is empty */
    PyObject *attrs = NULL;
    if (dict || sink != NULL) {
        attrs = dict ? PyTuple_Pack(3, names, values, r->attributes) : PyTuple_Pack(2, names, values);
        if (attrs == NULL) {
            PyErr_Clear();
            buf_dropped += 1 + r->cn + children_of(r->children);
            return;
        }
    }
    Attrs general = {attrs}, fast = {NULL, names, values, r->request_id ? str_request_id : NULL, r->request_id};
    if (sink != NULL) {
        PyObject *trace_id = u128_object(r->hi, r->lo);
        PyObject *record = trace_id == NULL ? NULL : Py_BuildValue(
            "(NKiOOiLLOOOsO)", trace_id, (unsigned long long)r->span_id, 0, Py_False, name, SERVER, r->start_ns, end,
            attrs, or_none(r->events), or_none(r->status), "", or_none(r->children));
        if (hand_to_sink(record) < 0)
            PyErr_WriteUnraisable(NULL);
    } else if (buf_count >= buf_limit || writing) {
        buf_dropped += 1 + r->cn + children_of(r->children);
    } else {
        Py_ssize_t mark = buf_len, spans = 0;
        PyObject *rid = r->request_id; /* held while written: Python code may set it again meanwhile */
        Py_XINCREF(rid);
        writing++;
        int rc = w_root(r, name, attrs != NULL ? &general : &fast, end, &spans);
        writing--;
        Py_XDECREF(rid);
        if (rc < 0)
            spans = 1 + r->cn + children_of(r->children);
        written(mark, rc, spans);
    }
    Py_XDECREF(attrs);
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
        if (not_configured(finish_error))
            return NULL;
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
    int none = self->attributes == NULL || self->attributes == Py_None;
    if (none && args[0] == str_request_id) {
        Py_INCREF(args[1]);
        Py_XSETREF(self->request_id, args[1]);
        Py_RETURN_NONE;
    }
    if (root_materialize(self) < 0)
        return NULL;
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

static PyObject *root_get_attributes(Root *self, void *c) {
    if (root_materialize(self) < 0)
        return NULL;
    return Py_NewRef(or_none(self->attributes));
}

static int root_set_attributes(Root *self, PyObject *value, void *c) {
    Py_CLEAR(self->request_id); /* replaced with the rest */
    Py_XINCREF(value);
    Py_XSETREF(self->attributes, value);
    return 0;
}

static char hex_pairs[512]; /* byte b's two lowercase hex digits at 2 * b (made at import) */

static inline void put_hex64(Py_UCS1 *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        memcpy(p + 2 * i, hex_pairs + 2 * ((v >> (56 - 8 * i)) & 0xff), 2);
}

static PyObject *format_traceparent(uint64_t hi, uint64_t lo, uint64_t span_id, int sampled) {
    PyObject *s = PyUnicode_New(55, 127);
    if (s == NULL)
        return NULL;
    Py_UCS1 *p = PyUnicode_1BYTE_DATA(s);
    memcpy(p, "00-", 3);
    put_hex64(p + 3, hi);
    put_hex64(p + 19, lo);
    put_hex64(p + 36, span_id);
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
    {"events", T_OBJECT, offsetof(Root, events), 0, NULL},
    {"status", T_OBJECT, offsetof(Root, status), 0, NULL},
    {"children", T_OBJECT, offsetof(Root, children), 0, NULL},
    {NULL}};

static PyGetSetDef root_getset[] = {
    {"trace_id", (getter)root_get_trace_id, NULL, NULL, NULL},
    {"span_id", (getter)root_get_span_id, NULL, NULL, NULL},
    {"trace_id_hex", (getter)root_get_trace_id_hex, NULL, NULL, NULL},
    {"attributes", (getter)root_get_attributes, (setter)root_set_attributes, NULL, NULL},
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
                                        "The native span recorder (see services/common/_spanrec.c).", -1,
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
