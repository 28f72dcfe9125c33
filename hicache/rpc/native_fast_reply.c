/* The fast path's replies (native_fast_reply.h), written byte for byte as msgpack-python's
   Packer(use_bin_type=True) writes the reply dict the Python handlers build
   (tests/rpc/test_fast_encoding.py compares both): the same key order, the smallest int
   format, bin for the page ids (int64 in the index, int32 little-endian on the wire, as
   framing.ids_to_bytes). */
#include "hicache/rpc/native_fast_reply.h"

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
int fast_encode_true(buf_t *out, unsigned long long id) {
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
int fast_encode_match(buf_t *out, unsigned long long id, PyObject *res) {
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
