/* The daemon's native frame loop (hicache/rpc/native_conn.py loads it): a CPython extension
   module `hicache.rpc._native_conn`.

   `NativeConn(fd, handle, turn_end, closed, max_frame_bytes, frames_per_turn, flush_at, turn_s=0)`
   is one connection, installed as the event loop's reader callback (`loop.add_reader(fd, conn)`).
   A call receives once, then `run()`s a turn: each whole frame's body (bytes) goes to
   `handle(body)`, at most `frames_per_turn` of them, for at most `turn_s` seconds (0: no limit;
   the frame running when it passes finishes) and none while `paused`; the replies the
   handlers queued (`send_body`, `write`) go out with one send at the turn's end. Python hears
   of a turn only when there is something to do: `turn_end(more, pending, buffered)` when frames
   remain for another turn, output is left unsent, or the bytes of partial frames held changed;
   `closed(reason, value)` at end of stream (CLOSED_EOF, errno or 0) or on a length over the cap
   (CLOSED_OVERSIZED, the length). Python owns the policy (caps, pausing, watching the
   descriptor); C owns the descriptor, closed once by `close()` or at collection.

   With `fast` set, a `match` or `release` frame of the client's shape goes to `fast(kind, id,
   arg, keys)` instead (native_fast_parse.h), and its answer is encoded here
   (native_fast_reply.h); None from it sends the frame to `handle` after all.

   The framing (buffers, recv, flush, frame splitting) is native_frames.h.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

#include "hicache/kernels/native_build.h"
#include "hicache/rpc/native_fast_parse.h"
#include "hicache/rpc/native_fast_reply.h"
#include "hicache/rpc/native_frames.h"

#define KEEP_BYTES (1u << 20)  /* an empty buffer larger than this is given back */
enum { CLOSED_EOF = 0, CLOSED_OVERSIZED = 1 };

typedef struct {
    PyObject_HEAD
    int fd;
    char in_turn;   /* handlers are running: replies wait for the turn's single send */
    char paused;    /* set by Python while output is over the high-water mark */
    char broken;    /* a send failed: the peer is gone */
    uint32_t max;
    int frames_per_turn;
    int64_t turn_ns;      /* a turn's time: frames past it wait for a later turn (0: no limit) */
    Py_ssize_t flush_at;  /* queued output that is sent at once, even within a turn */
    size_t accounted;     /* partial-frame bytes last reported to Python */
    buf_t in, out;
    PyObject *handle, *turn_end, *closed;
    PyObject *fast;  /* fast(kind, id, arg, keys) for match/release frames, or NULL/None: all go to handle */
} NativeConn;

static void trim(buf_t *b) { if (b->start == b->end && b->cap > KEEP_BYTES) buf_free(b); }

/* Unsent bytes after a send attempt, or -1 once the peer is gone. */
static Py_ssize_t flush_out(NativeConn *c) {
    if (c->broken) return -1;
    if (c->fd >= 0 && conn_flush(c->fd, &c->out) == IO_CLOSED) { c->broken = 1; return -1; }
    trim(&c->out);
    return (Py_ssize_t)(c->out.end - c->out.start);
}

static PyObject *report_closed(NativeConn *c, int reason, long value) {
    PyObject *cb = c->closed;
    if (!cb) Py_RETURN_NONE;
    Py_INCREF(cb);
    PyObject *r = PyObject_CallFunction(cb, "il", reason, value);
    Py_DECREF(cb);
    return r;
}

/* A match or release frame through `fast(kind, id, arg, keys)` (native_fast_parse.h):
   1 answered (the reply queued here, or Python answered an error itself), 0 the fast
   handler declined before changing anything (the frame goes to `handle`), -1 raised. */
static int run_fast(NativeConn *c, const fast_req_t *q) {
    PyObject *args[4] = {NULL, NULL, NULL, NULL};
    args[0] = PyLong_FromLong(q->kind);
    args[1] = PyLong_FromUnsignedLongLong(q->id);
    args[2] = PyLong_FromUnsignedLongLong(q->arg);
    args[3] = q->kind == FAST_MATCH ? PyBytes_FromStringAndSize(q->blob, q->blob_len) : (Py_INCREF(Py_None), Py_None);
    PyObject *res = NULL, *fast = c->fast;
    if (args[0] && args[1] && args[2] && args[3]) {
        Py_INCREF(fast);  /* held: the handler may drop it */
        res = PyObject_Vectorcall(fast, args, 4, NULL);
        Py_DECREF(fast);
    }
    for (int i = 0; i < 4; i++) Py_XDECREF(args[i]);
    if (!res) return -1;
    int r = 1;
    if (res == Py_None) r = 0;
    else if (res == Py_False || q->quiet || c->fd < 0) r = 1;  /* answered by Python, or nothing to say */
    else if (res == Py_True) r = fast_encode_true(&c->out, q->id) ? -1 : 1;
    else r = fast_encode_match(&c->out, q->id, res) ? -1 : 1;
    Py_DECREF(res);
    return r;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static PyObject *run_turn(NativeConn *c) {
    const char *body;
    uint32_t n;
    int r = 0, done = 0, stopped = 0;
    fast_req_t q;
    int64_t end = c->turn_ns ? now_ns() + c->turn_ns : 0;
    c->in_turn = 1;
    while (c->fd >= 0 && !c->paused && done < c->frames_per_turn) {
        if (end && done && now_ns() >= end) {  /* the turn's time is up: the rest after other callbacks */
            stopped = 1;
            break;
        }
        if ((r = next_frame(&c->in, c->max, &body, &n)) != 1) break;
        done++;
        if (c->fast && c->fast != Py_None && fast_parse(body, n, &q) != FAST_NONE) {
            int k = run_fast(c, &q);
            if (k < 0) { c->in_turn = 0; return NULL; }
            if (c->fd < 0) break;  /* closed under the call: `body` is gone with the buffer */
            if (k > 0) {
                /* as queue(): past flush_at, send now; what the socket refuses ends the
                   turn, so that Python hears of it (turn_end) before the next frame */
                if ((Py_ssize_t)(c->out.end - c->out.start) >= c->flush_at && flush_out(c) != 0) {
                    stopped = 1;
                    break;
                }
                continue;
            }
        }
        PyObject *arg = PyBytes_FromStringAndSize(body, n);
        if (!arg) { c->in_turn = 0; return NULL; }
        PyObject *handle = c->handle;  /* held: a handler may close the connection */
        Py_INCREF(handle);
        PyObject *res = PyObject_CallOneArg(handle, arg);
        Py_DECREF(handle);
        Py_DECREF(arg);
        if (!res) { c->in_turn = 0; return NULL; }
        Py_DECREF(res);
    }
    c->in_turn = 0;
    if (c->fd < 0) Py_RETURN_NONE;  /* closed by a handler */
    if (r < 0) return report_closed(c, CLOSED_OVERSIZED, (long)be32(c->in.p + c->in.start));
    Py_ssize_t pending = flush_out(c);
    size_t buffered = c->in.end - c->in.start;
    int more = (stopped || done == c->frames_per_turn) && buffered >= 4;
    if (!buffered) trim(&c->in);
    if (!more && pending == 0 && buffered == c->accounted) Py_RETURN_NONE;
    c->accounted = buffered;
    PyObject *cb = c->turn_end;
    if (!cb) Py_RETURN_NONE;
    Py_INCREF(cb);
    PyObject *res = PyObject_CallFunction(cb, "inn", more, pending, (Py_ssize_t)buffered);
    Py_DECREF(cb);
    return res;
}

/* The reader callback: the loop calls it with no arguments when fd is readable. */
static PyObject *conn_readable(PyObject *self, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kw)) {
    NativeConn *c = (NativeConn *)self;
    if (c->fd < 0 || c->paused) Py_RETURN_NONE;
    int err;
    if (conn_recv(c->fd, &c->in, c->max, &err) == IO_CLOSED) return report_closed(c, CLOSED_EOF, err);
    return run_turn(c);
}

static PyObject *conn_run(PyObject *self, PyObject *Py_UNUSED(unused)) {
    NativeConn *c = (NativeConn *)self;
    if (c->fd < 0) Py_RETURN_NONE;
    return run_turn(c);
}

/* Queue bytes; sent now unless a turn is running (then at its end, or now once
   flush_at bytes are queued). Returns the bytes the socket refused (0 while they only
   wait for the turn's end), -1 once the peer is gone. */
static PyObject *queue(NativeConn *c, PyObject *arg, int framed) {
    if (c->fd < 0) return PyLong_FromLong(0);
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE)) return NULL;
    int bad = framed ? buf_put_frame(&c->out, view.buf, (size_t)view.len)
                     : buf_put(&c->out, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    if (bad) return PyErr_NoMemory();
    if (c->in_turn && (Py_ssize_t)(c->out.end - c->out.start) < c->flush_at) return PyLong_FromLong(0);
    return PyLong_FromSsize_t(flush_out(c));
}

static PyObject *conn_send_body(PyObject *self, PyObject *body) { return queue((NativeConn *)self, body, 1); }
static PyObject *conn_write(PyObject *self, PyObject *data) { return queue((NativeConn *)self, data, 0); }
static PyObject *conn_flush_py(PyObject *self, PyObject *Py_UNUSED(unused)) {
    return PyLong_FromSsize_t(flush_out((NativeConn *)self));
}

/* Close the descriptor (once) and drop buffers and callbacks; the caller has stopped
   watching it. Safe from within a handler: the turn stops after that frame. */
static PyObject *conn_close(PyObject *self, PyObject *Py_UNUSED(unused)) {
    NativeConn *c = (NativeConn *)self;
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    buf_free(&c->in);
    buf_free(&c->out);
    Py_CLEAR(c->handle);
    Py_CLEAR(c->turn_end);
    Py_CLEAR(c->closed);
    Py_CLEAR(c->fast);
    Py_RETURN_NONE;
}

static PyObject *conn_fd(PyObject *self, void *Py_UNUSED(unused)) { return PyLong_FromLong(((NativeConn *)self)->fd); }
static PyObject *conn_pending(PyObject *self, void *Py_UNUSED(unused)) {
    NativeConn *c = (NativeConn *)self;
    return PyLong_FromSize_t(c->out.end - c->out.start);
}
static PyObject *conn_buffered(PyObject *self, void *Py_UNUSED(unused)) {
    NativeConn *c = (NativeConn *)self;
    return PyLong_FromSize_t(c->in.end - c->in.start);
}

static int conn_init(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"fd", "handle", "turn_end", "closed", "max_frame_bytes", "frames_per_turn",
                            "flush_at", "turn_s", NULL};
    NativeConn *c = (NativeConn *)self;
    PyObject *handle, *turn_end, *closed;
    int fd, fpt;
    unsigned int max;
    Py_ssize_t flush_at;
    double turn_s = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOOIin|d", names, &fd, &handle, &turn_end, &closed, &max,
                                     &fpt, &flush_at, &turn_s)) return -1;
    if (!(turn_s >= 0.0 && turn_s < 3600.0)) {
        PyErr_SetString(PyExc_ValueError, "turn_s must be in [0, 3600)");
        return -1;
    }
    if (!PyCallable_Check(handle) || !PyCallable_Check(turn_end) || !PyCallable_Check(closed)) {
        PyErr_SetString(PyExc_TypeError, "handle, turn_end and closed must be callable");
        return -1;
    }
    if (fd < 0 || fpt < 1 || flush_at < 1 || c->fd >= 0) {
        PyErr_SetString(PyExc_ValueError, "needs an open descriptor, frames_per_turn >= 1, flush_at >= 1");
        return -1;
    }
    Py_INCREF(handle);
    Py_INCREF(turn_end);
    Py_INCREF(closed);
    Py_XSETREF(c->handle, handle);
    Py_XSETREF(c->turn_end, turn_end);
    Py_XSETREF(c->closed, closed);
    c->fd = fd;  /* owned from here: closed by close() or at collection */
    c->max = max;
    c->frames_per_turn = fpt;
    c->turn_ns = (int64_t)(turn_s * 1e9);
    c->flush_at = flush_at;
    return 0;
}

static PyObject *conn_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kw)) {
    NativeConn *c = (NativeConn *)type->tp_alloc(type, 0);
    if (c) c->fd = -1;
    return (PyObject *)c;
}

static int conn_traverse(PyObject *self, visitproc visit, void *arg) {
    NativeConn *c = (NativeConn *)self;
    Py_VISIT(c->handle);
    Py_VISIT(c->turn_end);
    Py_VISIT(c->closed);
    Py_VISIT(c->fast);
    return 0;
}

static int conn_clear(PyObject *self) {
    NativeConn *c = (NativeConn *)self;
    Py_CLEAR(c->handle);
    Py_CLEAR(c->turn_end);
    Py_CLEAR(c->closed);
    Py_CLEAR(c->fast);
    return 0;
}

static void conn_dealloc(PyObject *self) {
    NativeConn *c = (NativeConn *)self;
    PyObject_GC_UnTrack(self);
    if (c->fd >= 0) close(c->fd);  /* the loop may be gone: no unwatching here */
    buf_free(&c->in);
    buf_free(&c->out);
    conn_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyMethodDef conn_methods[] = {
    {"run", conn_run, METH_NOARGS, "run one turn over the frames already buffered"},
    {"send_body", conn_send_body, METH_O, "queue one frame (the length is added); returns refused bytes"},
    {"write", conn_write, METH_O, "queue bytes that are already frames; returns refused bytes"},
    {"flush", conn_flush_py, METH_NOARGS, "send what is queued; returns the bytes left, -1 if the peer is gone"},
    {"close", conn_close, METH_NOARGS, "close the descriptor (stop watching it first)"},
    {NULL}
};
static PyMemberDef conn_members[] = {
    {"paused", T_BOOL, offsetof(NativeConn, paused), 0, "no frames are handled (nor read) while set"},
    {"fast", T_OBJECT, offsetof(NativeConn, fast), 0,
     "fast(kind, id, arg, keys): answers match/release frames of the client's shape (None: handle all)"},
    {NULL}
};
static PyGetSetDef conn_getset[] = {
    {"fd", conn_fd, NULL, "the descriptor, -1 once closed", NULL},
    {"pending", conn_pending, NULL, "bytes of output not sent yet", NULL},
    {"buffered", conn_buffered, NULL, "bytes of input not handled yet (partial frames)", NULL},
    {NULL}
};

static PyTypeObject NativeConnType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache.rpc._native_conn.NativeConn",
    .tp_basicsize = sizeof(NativeConn),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "NativeConn(fd, handle, turn_end, closed, max_frame_bytes, frames_per_turn, flush_at, turn_s=0)",
    .tp_new = conn_new,
    .tp_init = conn_init,
    .tp_call = conn_readable,
    .tp_dealloc = conn_dealloc,
    .tp_traverse = conn_traverse,
    .tp_clear = conn_clear,
    .tp_methods = conn_methods,
    .tp_members = conn_members,
    .tp_getset = conn_getset,
};

static struct PyModuleDef mod_def = {PyModuleDef_HEAD_INIT, .m_name = "hicache.rpc._native_conn", .m_size = -1};

HICACHE_BUILD_INFO_SYMBOL;

PyMODINIT_FUNC PyInit__native_conn(void) {
    if (PyType_Ready(&NativeConnType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod_def);
    if (!m) return NULL;
    Py_INCREF(&NativeConnType);
    if (PyModule_AddObject(m, "NativeConn", (PyObject *)&NativeConnType) < 0
            || PyModule_AddIntConstant(m, "CLOSED_EOF", CLOSED_EOF)
            || PyModule_AddIntConstant(m, "CLOSED_OVERSIZED", CLOSED_OVERSIZED)
            || PyModule_AddIntConstant(m, "FAST_MATCH", FAST_MATCH)
            || PyModule_AddIntConstant(m, "FAST_RELEASE", FAST_RELEASE)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
