"""C of the native frame loop's fast path (part of hicache/rpc/native_conn_source.py's
extension): `match` and `release` frames read and answered without msgpack's Python
objects, the request dict, the reply dict or the packer.

`fast_parse` recognises one request shape only, the one the client sends (BlobRequest
and `post`): a fixmap of "id" (an int >= 0), "method" ("match" or "release"), "params"
and optionally "noreply" (true or false), each key once, in any order, and nothing after
the map; params a fixmap of exactly {"engine": int >= 0, "keys": bin} (match) or {"pin":
int >= 0} (release). Anything else, however valid, takes the Python path unchanged
(`Connection._handle`): C never answers what it did not fully understand.

The `fast_encode_*` functions write the reply frame byte for byte as msgpack-python's
Packer(use_bin_type=True) writes the reply dict the Python handlers build
(tests/rpc/test_fast_path.py compares both): the same key order, the smallest int
format, bin for the page ids (int64 in the index, int32 little-endian on the wire, as
framing.ids_to_bytes).
"""

from __future__ import annotations

FAST_C = r"""
enum { FAST_NONE = 0, FAST_MATCH = 1, FAST_RELEASE = 2 };

typedef struct {
    int kind;
    int quiet;                 /* noreply: true */
    unsigned long long id, arg;  /* the request id; the engine (match) or pin (release) */
    const char *blob;          /* match: the keys */
    uint32_t blob_len;
} fast_req_t;

typedef struct { const unsigned char *p, *end; } rd_t;

static int rd_uint(rd_t *r, unsigned long long *v) {
    if (r->p >= r->end) return -1;
    unsigned char t = *r->p++;
    int w;
    if (t < 0x80) { *v = t; return 0; }
    if (t == 0xcc) w = 1; else if (t == 0xcd) w = 2; else if (t == 0xce) w = 4; else if (t == 0xcf) w = 8;
    else return -1;  /* negative, float, anything else: the Python path */
    if (r->end - r->p < w) return -1;
    unsigned long long x = 0;
    for (int i = 0; i < w; i++) x = (x << 8) | r->p[i];
    r->p += w;
    *v = x;
    return 0;
}

/* A fixstr; returns its length and sets *s, or -1. */
static int rd_fixstr(rd_t *r, const char **s) {
    if (r->p >= r->end || (*r->p & 0xe0) != 0xa0) return -1;
    int n = *r->p++ & 0x1f;
    if (r->end - r->p < n) return -1;
    *s = (const char *)r->p;
    r->p += n;
    return n;
}

static int str_is(const char *s, int n, const char *lit) { return (int)strlen(lit) == n && !memcmp(s, lit, n); }

static int rd_bin(rd_t *r, const char **s, uint32_t *n) {
    if (r->p >= r->end) return -1;
    unsigned char t = *r->p++;
    int w = t == 0xc4 ? 1 : t == 0xc5 ? 2 : t == 0xc6 ? 4 : 0;
    if (!w || r->end - r->p < w) return -1;
    uint32_t x = 0;
    for (int i = 0; i < w; i++) x = (x << 8) | r->p[i];
    r->p += w;
    if ((uint32_t)(r->end - r->p) < x) return -1;
    *s = (const char *)r->p;
    *n = x;
    r->p += x;
    return 0;
}

static int rd_params(rd_t *r, int kind, fast_req_t *q) {
    if (r->p >= r->end || (*r->p & 0xf0) != 0x80) return -1;
    int n = *r->p++ & 0x0f, got_engine = 0, got_keys = 0, got_pin = 0;
    if (n != (kind == FAST_MATCH ? 2 : 1)) return -1;
    for (int i = 0; i < n; i++) {
        const char *k;
        int kn = rd_fixstr(r, &k);
        if (kn < 0) return -1;
        if (kind == FAST_MATCH && !got_engine && str_is(k, kn, "engine")) {
            if (rd_uint(r, &q->arg)) return -1;
            got_engine = 1;
        } else if (kind == FAST_MATCH && !got_keys && str_is(k, kn, "keys")) {
            if (rd_bin(r, &q->blob, &q->blob_len)) return -1;
            got_keys = 1;
        } else if (kind == FAST_RELEASE && !got_pin && str_is(k, kn, "pin")) {
            if (rd_uint(r, &q->arg)) return -1;
            got_pin = 1;
        } else return -1;
    }
    return 0;
}

/* The request in `body`, or FAST_NONE for anything the Python path must see. Params are
   read after the whole map is seen: "params" may come before "method". */
static int fast_parse(const char *body, uint32_t len, fast_req_t *q) {
    rd_t r = {(const unsigned char *)body, (const unsigned char *)body + len};
    memset(q, 0, sizeof *q);
    if (r.p >= r.end) return FAST_NONE;
    unsigned char h = *r.p++;
    if (h != 0x83 && h != 0x84) return FAST_NONE;
    int got_id = 0, got_noreply = 0, kind = FAST_NONE;
    rd_t params = {NULL, NULL};
    for (int i = 0; i < (h & 0x0f); i++) {
        const char *k;
        int kn = rd_fixstr(&r, &k);
        if (kn < 0) return FAST_NONE;
        if (!got_id && str_is(k, kn, "id")) {
            if (rd_uint(&r, &q->id)) return FAST_NONE;
            got_id = 1;
        } else if (kind == FAST_NONE && str_is(k, kn, "method")) {
            const char *m;
            int mn = rd_fixstr(&r, &m);
            if (mn < 0) return FAST_NONE;
            kind = str_is(m, mn, "match") ? FAST_MATCH : str_is(m, mn, "release") ? FAST_RELEASE : -1;
            if (kind < 0) return FAST_NONE;
        } else if (!params.p && str_is(k, kn, "params")) {
            params.p = r.p;  /* skipped for now: a fixmap of at most 2 entries, checked below */
            if (r.p >= r.end || (*r.p & 0xf0) != 0x80) return FAST_NONE;
            int pn = *r.p++ & 0x0f;
            for (int j = 0; j < pn; j++) {
                const char *pk, *pv;
                uint32_t pvn;
                unsigned long long x;
                if (rd_fixstr(&r, &pk) < 0) return FAST_NONE;
                if (r.p < r.end && (*r.p == 0xc4 || *r.p == 0xc5 || *r.p == 0xc6)) {
                    if (rd_bin(&r, &pv, &pvn)) return FAST_NONE;
                } else if (rd_uint(&r, &x)) return FAST_NONE;
            }
            params.end = r.p;
        } else if (!got_noreply && str_is(k, kn, "noreply")) {
            if (r.p >= r.end || (*r.p != 0xc3 && *r.p != 0xc2)) return FAST_NONE;
            q->quiet = *r.p++ == 0xc3;
            got_noreply = 1;
        } else return FAST_NONE;
    }
    if (r.p != r.end || !got_id || kind == FAST_NONE || !params.p) return FAST_NONE;
    if ((h == 0x84) != got_noreply) return FAST_NONE;
    if (rd_params(&params, kind, q) || params.p != params.end) return FAST_NONE;
    q->kind = kind;
    return kind;
}

/* -- the reply, as msgpack-python packs it --------------------------------------- */
static unsigned char *wr_int(unsigned char *w, long long x) {
    if (x < -(1LL << 5)) {
        if (x < -(1LL << 15)) {
            if (x < -(1LL << 31)) { *w++ = 0xd3; for (int i = 7; i >= 0; i--) *w++ = (unsigned char)(x >> (8 * i)); }
            else { *w++ = 0xd2; for (int i = 3; i >= 0; i--) *w++ = (unsigned char)(x >> (8 * i)); }
        } else if (x < -(1LL << 7)) { *w++ = 0xd1; *w++ = (unsigned char)(x >> 8); *w++ = (unsigned char)x; }
        else { *w++ = 0xd0; *w++ = (unsigned char)x; }
    } else if (x < 0x80) *w++ = (unsigned char)x;
    else if (x < 0x100) { *w++ = 0xcc; *w++ = (unsigned char)x; }
    else if (x < 0x10000) { *w++ = 0xcd; *w++ = (unsigned char)(x >> 8); *w++ = (unsigned char)x; }
    else if (x < 0x100000000LL) { *w++ = 0xce; for (int i = 3; i >= 0; i--) *w++ = (unsigned char)(x >> (8 * i)); }
    else { *w++ = 0xcf; for (int i = 7; i >= 0; i--) *w++ = (unsigned char)(x >> (8 * i)); }
    return w;
}

static unsigned char *wr_uint(unsigned char *w, unsigned long long x) {
    if (x <= 0x7fffffffffffffffULL) return wr_int(w, (long long)x);
    *w++ = 0xcf;
    for (int i = 7; i >= 0; i--) *w++ = (unsigned char)(x >> (8 * i));
    return w;
}

static unsigned char *wr_str(unsigned char *w, const char *s) {
    size_t n = strlen(s);  /* keys under 32 bytes: fixstr */
    *w++ = (unsigned char)(0xa0 | n);
    memcpy(w, s, n);
    return w + n;
}

static unsigned char *wr_bin_header(unsigned char *w, size_t n) {
    if (n < 0x100) { *w++ = 0xc4; *w++ = (unsigned char)n; }
    else if (n < 0x10000) { *w++ = 0xc5; *w++ = (unsigned char)(n >> 8); *w++ = (unsigned char)n; }
    else { *w++ = 0xc6; for (int i = 3; i >= 0; i--) *w++ = (unsigned char)(n >> (8 * i)); }
    return w;
}

/* Room for a reply frame of at most `most` bytes at the end of `out`; returns where its
   body starts (after the 4-byte length), or NULL without memory. */
static unsigned char *frame_begin(buf_t *out, size_t most) {
    if (buf_room(out, most + 4)) return NULL;
    return (unsigned char *)out->p + out->end + 4;
}

static void frame_end(buf_t *out, unsigned char *w) {
    unsigned char *h = (unsigned char *)out->p + out->end;
    size_t n = (size_t)(w - h) - 4;
    h[0] = (unsigned char)(n >> 24); h[1] = (unsigned char)(n >> 16);
    h[2] = (unsigned char)(n >> 8); h[3] = (unsigned char)n;
    out->end += n + 4;
}

/* {"id": id, "result": True} */
static int fast_encode_true(buf_t *out, unsigned long long id) {
    unsigned char *w = frame_begin(out, 32);
    if (!w) return -1;
    *w++ = 0x82;
    w = wr_str(w, "id");
    w = wr_uint(w, id);
    w = wr_str(w, "result");
    *w++ = 0xc3;
    frame_end(out, w);
    return 0;
}

/* A page-id array as int64 (C-contiguous, native little-endian): the index's arrays are,
   anything else goes through its astype("int64") first (a new reference in *held). */
static int ids_view(PyObject *arr, Py_buffer *v, PyObject **held) {
    *held = NULL;
    if (!PyObject_GetBuffer(arr, v, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)) {
        const char *f = v->format ? v->format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        if (v->itemsize == 8 && (!strcmp(f, "l") || !strcmp(f, "q"))) return 0;
        PyBuffer_Release(v);
    } else PyErr_Clear();
    *held = PyObject_CallMethod(arr, "astype", "s", "int64");
    if (!*held) return -1;
    if (PyObject_GetBuffer(*held, v, PyBUF_C_CONTIGUOUS)) { Py_CLEAR(*held); return -1; }
    return 0;
}

static unsigned char *wr_ids(unsigned char *w, Py_buffer *v) {
    Py_ssize_t n = v->len / 8;
    const int64_t *src = (const int64_t *)v->buf;
    w = wr_bin_header(w, (size_t)n * 4);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t x = (uint32_t)src[i];  /* astype("<i4"): wraps as C does */
        w[0] = (unsigned char)x; w[1] = (unsigned char)(x >> 8);
        w[2] = (unsigned char)(x >> 16); w[3] = (unsigned char)(x >> 24);
        w += 4;
    }
    return w;
}

/* {"id": id, "result": {"pin", "device_pages", "host_pages", "disk_len", "slabs"}} from
   the fast handler's (pin, device_pages, host_pages, disk_len, slabs). */
static int fast_encode_match(buf_t *out, unsigned long long id, PyObject *res) {
    if (!PyTuple_CheckExact(res) || PyTuple_GET_SIZE(res) != 5) {
        PyErr_SetString(PyExc_TypeError, "a fast match answers (pin, device_pages, host_pages, disk_len, slabs)");
        return -1;
    }
    long long pin = PyLong_AsLongLong(PyTuple_GET_ITEM(res, 0));
    long long disk_len = PyLong_AsLongLong(PyTuple_GET_ITEM(res, 3));
    long long slabs = PyLong_AsLongLong(PyTuple_GET_ITEM(res, 4));
    if (PyErr_Occurred()) return -1;
    Py_buffer dev, host;
    PyObject *dev_held, *host_held;
    if (ids_view(PyTuple_GET_ITEM(res, 1), &dev, &dev_held)) return -1;
    if (ids_view(PyTuple_GET_ITEM(res, 2), &host, &host_held)) {
        PyBuffer_Release(&dev);
        Py_XDECREF(dev_held);
        return -1;
    }
    unsigned char *w = frame_begin(out, 160 + (size_t)(dev.len + host.len) / 2);
    if (w) {
        *w++ = 0x82;
        w = wr_str(w, "id");
        w = wr_uint(w, id);
        w = wr_str(w, "result");
        *w++ = 0x85;
        w = wr_str(w, "pin");
        w = wr_int(w, pin);
        w = wr_str(w, "device_pages");
        w = wr_ids(w, &dev);
        w = wr_str(w, "host_pages");
        w = wr_ids(w, &host);
        w = wr_str(w, "disk_len");
        w = wr_int(w, disk_len);
        w = wr_str(w, "slabs");
        w = wr_int(w, slabs);
        frame_end(out, w);
    }
    PyBuffer_Release(&dev);
    PyBuffer_Release(&host);
    Py_XDECREF(dev_held);
    Py_XDECREF(host_held);
    if (!w) { PyErr_NoMemory(); return -1; }
    return 0;
}
"""
