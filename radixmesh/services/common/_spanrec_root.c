/* The native span recorder's Root, the server span of a request whose trace begins here. A part of
 * radixmesh/services/common/_spanrec.c, which #includes it after the OTLP writer (_spanrec_otlp.c); not compiled on its own. */

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
