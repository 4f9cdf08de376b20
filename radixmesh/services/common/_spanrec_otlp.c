/* The native span recorder's OTLP writer: the buffer of encoded spans and the encoders of ids, attributes, events
 * and status. A part of radixmesh/services/common/_spanrec.c, which #includes it where it stands (one translation unit, so the
 * compiler sees every static function at once); not compiled on its own. */

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
