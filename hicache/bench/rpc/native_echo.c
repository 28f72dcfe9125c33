/* The native echo servers of `hicache bench rpc --servers` (hicache/bench/rpc/native_echo.py loads
   them): a CPython extension module `hicache.bench.rpc._native_echo` with

   - `serve_epoll(listen_fd, max_frame_bytes)`: a single-threaded epoll loop, GIL released,
     answering every frame with the same bytes until an error or a Python signal handler
     raises;
   - `FrameConn(loop, fd, handler=None, max_frame_bytes)`: one connection, installed as the
     event loop's reader callback (`loop.add_reader(fd, conn)`). A call receives once,
     answers every whole frame (in C, or with `handler(body)`'s bytes; None answers
     nothing) and sends; while a reply cannot all be sent it swaps its reader for a writer
     (`on_writable`) and reads again once it has drained. End of stream, an oversized frame
     or a handler that raises closes the connection (the exception goes to the loop).

   Frames are hicache's: a 4-byte big-endian length, then the body (hicache/rpc/framing.py);
   the buffers, recv, flush and frame splitting are the daemon's own (hicache/rpc/native_frames.h).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sys/epoll.h>

#include "hicache/kernels/native_build.h"
#include "hicache/rpc/native_frames.h"

static int echo_frames(buf_t *in, buf_t *out, uint32_t max) {
    const char *body;
    uint32_t n;
    int r;
    while ((r = next_frame(in, max, &body, &n)) == 1)
        if (buf_put_frame(out, body, n)) return IO_CLOSED;
    return r < 0 ? IO_CLOSED : IO_OK;
}

/* ---- (a) a plain epoll loop, answering in C ------------------------------------- */
typedef struct { int fd; buf_t in, out; } econn_t;

static void econn_close(int ep, econn_t *c) {
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    buf_free(&c->in);
    buf_free(&c->out);
    free(c);
}

static void econn_watch(int ep, econn_t *c, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
}

static PyObject *serve_epoll(PyObject *Py_UNUSED(mod), PyObject *args) {
    int lfd;
    unsigned int max;
    if (!PyArg_ParseTuple(args, "iI", &lfd, &max)) return NULL;
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) return PyErr_SetFromErrno(PyExc_OSError);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev)) {
        close(ep);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    int err = 0;
    struct epoll_event evs[64];
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        int k = epoll_wait(ep, evs, 64, -1);
        if (k < 0) {
            if (errno != EINTR) { err = errno; break; }
            Py_BLOCK_THREADS  /* a signal: let Python's handler run (Ctrl-C stops the server) */
            int raised = PyErr_CheckSignals();
            Py_UNBLOCK_THREADS
            if (raised) { err = -1; break; }
            continue;
        }
        for (int i = 0; i < k; i++) {
            econn_t *c = evs[i].data.ptr;
            if (!c) {  /* the listener */
                int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (fd < 0) continue;
                c = calloc(1, sizeof *c);
                struct epoll_event cev = {.events = EPOLLIN, .data.ptr = c};
                if (!c || epoll_ctl(ep, EPOLL_CTL_ADD, fd, &cev)) { close(fd); free(c); }
                else c->fd = fd;
                continue;
            }
            int r;
            if (evs[i].events & EPOLLOUT) {  /* only watched while a reply is pending */
                r = conn_flush(c->fd, &c->out);
                if (r == IO_OK) econn_watch(ep, c, EPOLLIN);
            } else {
                int err;
                r = conn_recv(c->fd, &c->in, max, &err);
                if (r == IO_OK) r = echo_frames(&c->in, &c->out, max);
                if (r == IO_OK) r = conn_flush(c->fd, &c->out);
                if (r == IO_PENDING) econn_watch(ep, c, EPOLLOUT);  /* stop reading until it drains */
            }
            if (r == IO_CLOSED) econn_close(ep, c);
        }
    }
    Py_END_ALLOW_THREADS
    close(ep);
    if (err < 0) return NULL;
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* ---- (b) a C reader callback per connection on the Python event loop ------------ */
typedef struct {
    PyObject_HEAD
    int fd;
    int writing;  /* a reply is pending: the reader is off, the writer on */
    uint32_t max;
    buf_t in, out;
    PyObject *loop;
    PyObject *handler;  /* None: answer in C */
} FrameConn;

static int loop_call(FrameConn *c, const char *method, PyObject *cb) {
    PyObject *r = cb ? PyObject_CallMethod(c->loop, method, "iO", c->fd, cb)
                     : PyObject_CallMethod(c->loop, method, "i", c->fd);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* Unwatch and close; an exception already set (a handler's) is kept. */
static void conn_close(FrameConn *c) {
    if (c->fd < 0) return;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (loop_call(c, c->writing ? "remove_writer" : "remove_reader", NULL)) PyErr_WriteUnraisable((PyObject *)c);
    close(c->fd);
    c->fd = -1;
    buf_free(&c->in);
    buf_free(&c->out);
    PyErr_Restore(t, v, tb);
}

static int call_frames(FrameConn *c) {
    const char *body;
    uint32_t n;
    int r;
    while ((r = next_frame(&c->in, c->max, &body, &n)) == 1) {
        PyObject *arg = PyBytes_FromStringAndSize(body, n);
        if (!arg) return IO_RAISED;
        PyObject *res = PyObject_CallOneArg(c->handler, arg);
        Py_DECREF(arg);
        if (!res) return IO_RAISED;
        if (res != Py_None) {  /* None: no reply */
            Py_buffer view;
            if (PyObject_GetBuffer(res, &view, PyBUF_SIMPLE)) { Py_DECREF(res); return IO_RAISED; }
            int bad = buf_put_frame(&c->out, view.buf, (size_t)view.len);
            PyBuffer_Release(&view);
            Py_DECREF(res);
            if (bad) { PyErr_NoMemory(); return IO_RAISED; }
        }
    }
    return r < 0 ? IO_CLOSED : IO_OK;
}

static PyObject *conn_after(FrameConn *c, int r) {
    if (r == IO_PENDING && !c->writing) {
        PyObject *cb = PyObject_GetAttrString((PyObject *)c, "on_writable");
        int bad = !cb || loop_call(c, "remove_reader", NULL);
        c->writing = !bad;
        bad = bad || loop_call(c, "add_writer", cb);
        Py_XDECREF(cb);
        if (bad) r = IO_RAISED;
    }
    if (r == IO_CLOSED || r == IO_RAISED) conn_close(c);
    if (r == IO_RAISED) return NULL;
    Py_RETURN_NONE;
}

/* The reader callback: FrameConn objects are called by the loop with no arguments. */
static PyObject *conn_readable(PyObject *self, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kw)) {
    FrameConn *c = (FrameConn *)self;
    if (c->fd < 0 || c->writing) Py_RETURN_NONE;
    int err, r = conn_recv(c->fd, &c->in, c->max, &err);
    if (r == IO_OK) r = c->handler == Py_None ? echo_frames(&c->in, &c->out, c->max) : call_frames(c);
    if (r == IO_OK) r = conn_flush(c->fd, &c->out);
    return conn_after(c, r);
}

static PyObject *conn_writable(PyObject *self, PyObject *Py_UNUSED(unused)) {
    FrameConn *c = (FrameConn *)self;
    if (c->fd < 0 || !c->writing) Py_RETURN_NONE;
    int r = conn_flush(c->fd, &c->out);
    if (r == IO_OK) {  /* drained: read again */
        c->writing = 0;
        if (loop_call(c, "remove_writer", NULL) || loop_call(c, "add_reader", self)) r = IO_RAISED;
    }
    return conn_after(c, r);
}

static PyObject *conn_close_py(PyObject *self, PyObject *Py_UNUSED(unused)) {
    conn_close((FrameConn *)self);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *conn_fd(PyObject *self, void *Py_UNUSED(unused)) { return PyLong_FromLong(((FrameConn *)self)->fd); }

static int conn_init(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"loop", "fd", "handler", "max_frame_bytes", NULL};
    FrameConn *c = (FrameConn *)self;
    PyObject *loop, *handler = Py_None;
    int fd;
    unsigned int max = 64u << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oi|OI", names, &loop, &fd, &handler, &max)) return -1;
    if (handler != Py_None && !PyCallable_Check(handler)) {
        PyErr_SetString(PyExc_TypeError, "handler must be callable or None");
        return -1;
    }
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "fd must be an open descriptor");
        return -1;
    }
    Py_INCREF(loop);
    Py_INCREF(handler);
    Py_XSETREF(c->loop, loop);
    Py_XSETREF(c->handler, handler);
    c->fd = fd;  /* owned from here: closed at end of stream, close(), or collection */
    c->max = max;
    return 0;
}

static PyObject *conn_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kw)) {
    FrameConn *c = (FrameConn *)type->tp_alloc(type, 0);
    if (c) c->fd = -1;
    return (PyObject *)c;
}

static int conn_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(((FrameConn *)self)->loop);
    Py_VISIT(((FrameConn *)self)->handler);
    return 0;
}

static int conn_clear(PyObject *self) {
    Py_CLEAR(((FrameConn *)self)->loop);
    Py_CLEAR(((FrameConn *)self)->handler);
    return 0;
}

static void conn_dealloc(PyObject *self) {
    FrameConn *c = (FrameConn *)self;
    PyObject_GC_UnTrack(self);
    if (c->fd >= 0) close(c->fd);  /* the loop may be gone: no unwatching here */
    buf_free(&c->in);
    buf_free(&c->out);
    conn_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyMethodDef conn_methods[] = {
    {"on_writable", conn_writable, METH_NOARGS, "writer callback while a reply is pending"},
    {"close", conn_close_py, METH_NOARGS, "unwatch and close the connection"},
    {NULL}
};
static PyGetSetDef conn_getset[] = {{"fd", conn_fd, NULL, "the descriptor, -1 once closed", NULL}, {NULL}};

static PyTypeObject FrameConnType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache.bench.rpc._native_echo.FrameConn",
    .tp_basicsize = sizeof(FrameConn),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "FrameConn(loop, fd, handler=None, max_frame_bytes=64 MiB): call it when fd is readable",
    .tp_new = conn_new,
    .tp_init = conn_init,
    .tp_call = conn_readable,
    .tp_dealloc = conn_dealloc,
    .tp_traverse = conn_traverse,
    .tp_clear = conn_clear,
    .tp_methods = conn_methods,
    .tp_getset = conn_getset,
};

static PyMethodDef mod_methods[] = {
    {"serve_epoll", serve_epoll, METH_VARARGS, "serve_epoll(listen_fd, max_frame_bytes): echo frames forever"},
    {NULL}
};
static struct PyModuleDef mod_def = {
    PyModuleDef_HEAD_INIT, .m_name = "hicache.bench.rpc._native_echo", .m_size = -1, .m_methods = mod_methods,
};

HICACHE_BUILD_INFO_SYMBOL;

PyMODINIT_FUNC PyInit__native_echo(void) {
    if (PyType_Ready(&FrameConnType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod_def);
    if (!m) return NULL;
    Py_INCREF(&FrameConnType);
    if (PyModule_AddObject(m, "FrameConn", (PyObject *)&FrameConnType) < 0) {
        Py_DECREF(&FrameConnType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
