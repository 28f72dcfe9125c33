/* KeyRun: the page keys of one radix node, packed in one object (hicache/index/keys.py's KeyRun
   is the same in Python, used where this module is not built; tests/index/test_key_run.py runs
   both). A tree node used to hold a list of 16-byte bytes objects: 72 bytes a page (a bytes
   object of 49 rounded to 64, and the list's pointer); packed, a page costs its 16 bytes and the
   node one object of 24 + 16 n bytes, which the cyclic GC never scans (it holds no references).

   A read-only sequence of 16-byte `bytes`: len, k[i] (a new bytes object), k[a:b] (a KeyRun; a
   step other than 1 gives a list), iteration, `in`, index(key), == and != against a KeyRun (the
   bytes) or a list or tuple (item by item), `blob` (the keys as one bytes object) and the buffer
   protocol (read-only, no copy). Built from a bytes-like blob: KeyRun(blob). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <string.h>

#include "hicache/index/native_keys.h"

#define KEY_BYTES 16

typedef struct {
    PyObject_VAR_HEAD
    char data[1];  /* ob_size keys of KEY_BYTES bytes */
} KeyRun;

static PyTypeObject KeyRunType;

static PyObject *run_new(const char *src, Py_ssize_t n) {
    KeyRun *k = PyObject_NewVar(KeyRun, &KeyRunType, n);
    if (!k) return NULL;
    if (n) memcpy(k->data, src, (size_t)(n * KEY_BYTES));
    return (PyObject *)k;
}

const char *hicache_key_run_data(PyObject *o, Py_ssize_t *n) {
    if (Py_TYPE(o) != &KeyRunType) return NULL;
    *n = Py_SIZE(o);
    return ((KeyRun *)o)->data;
}

static PyObject *run_tp_new(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwds) {
    Py_buffer b;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "KeyRun(blob) takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "y*:KeyRun", &b)) return NULL;
    PyObject *r = NULL;
    if (b.len % KEY_BYTES) PyErr_SetString(PyExc_ValueError, "keys must be packed 16-byte page keys");
    else r = run_new(b.buf, b.len / KEY_BYTES);
    PyBuffer_Release(&b);
    return r;
}

static Py_ssize_t run_len(PyObject *self) { return Py_SIZE(self); }

static PyObject *run_item(PyObject *self, Py_ssize_t i) {
    if (i < 0 || i >= Py_SIZE(self)) {
        PyErr_SetString(PyExc_IndexError, "page key index out of range");
        return NULL;
    }
    return PyBytes_FromStringAndSize(((KeyRun *)self)->data + i * KEY_BYTES, KEY_BYTES);
}

static PyObject *run_subscript(PyObject *self, PyObject *index) {
    Py_ssize_t n = Py_SIZE(self);
    if (PyIndex_Check(index)) {
        Py_ssize_t i = PyNumber_AsSsize_t(index, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        return run_item(self, i < 0 ? i + n : i);
    }
    if (!PySlice_Check(index)) {
        PyErr_Format(PyExc_TypeError, "KeyRun indices must be integers or slices, not %.200s", Py_TYPE(index)->tp_name);
        return NULL;
    }
    Py_ssize_t start, stop, step;
    if (PySlice_Unpack(index, &start, &stop, &step) < 0) return NULL;
    Py_ssize_t len = PySlice_AdjustIndices(n, &start, &stop, step);
    if (step == 1) return run_new(((KeyRun *)self)->data + start * KEY_BYTES, len);
    PyObject *out = PyList_New(len);
    for (Py_ssize_t j = 0; out && j < len; j++) {
        PyObject *k = run_item(self, start + j * step);
        if (!k) Py_CLEAR(out);
        else PyList_SET_ITEM(out, j, k);
    }
    return out;
}

/* The position of `key` (a 16-byte bytes-like), -1 if absent, -2 on error. */
static Py_ssize_t run_find(PyObject *self, PyObject *key) {
    Py_buffer b;
    if (!PyBytes_Check(key) && !PyByteArray_Check(key) && !PyMemoryView_Check(key)) return -1;
    if (PyObject_GetBuffer(key, &b, PyBUF_SIMPLE) < 0) return -2;
    Py_ssize_t at = -1;
    if (b.len == KEY_BYTES) {
        const char *d = ((KeyRun *)self)->data;
        for (Py_ssize_t i = 0; i < Py_SIZE(self); i++) {
            if (memcmp(d + i * KEY_BYTES, b.buf, KEY_BYTES) == 0) { at = i; break; }
        }
    }
    PyBuffer_Release(&b);
    return at;
}

static int run_contains(PyObject *self, PyObject *key) {
    Py_ssize_t at = run_find(self, key);
    return at == -2 ? -1 : at >= 0;
}

static PyObject *run_index(PyObject *self, PyObject *key) {
    Py_ssize_t at = run_find(self, key);
    if (at == -2) return NULL;
    if (at < 0) {
        PyErr_SetString(PyExc_ValueError, "the key is not in this run");
        return NULL;
    }
    return PyLong_FromSsize_t(at);
}

static PyObject *run_blob(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBytes_FromStringAndSize(((KeyRun *)self)->data, Py_SIZE(self) * KEY_BYTES);
}

static PyObject *run_richcompare(PyObject *self, PyObject *other, int op) {
    if (op != Py_EQ && op != Py_NE) Py_RETURN_NOTIMPLEMENTED;
    int eq;
    if (Py_TYPE(other) == &KeyRunType) {
        eq = Py_SIZE(self) == Py_SIZE(other)
             && memcmp(((KeyRun *)self)->data, ((KeyRun *)other)->data, (size_t)(Py_SIZE(self) * KEY_BYTES)) == 0;
    } else if (PyList_Check(other) || PyTuple_Check(other)) {  /* item by item, as a list of keys compares */
        Py_ssize_t n = PySequence_Size(other);
        eq = n == Py_SIZE(self);
        for (Py_ssize_t i = 0; eq && i < n; i++) {
            PyObject *o = PySequence_GetItem(other, i);
            if (!o) return NULL;
            eq = PyBytes_Check(o) && PyBytes_GET_SIZE(o) == KEY_BYTES
                 && memcmp(PyBytes_AS_STRING(o), ((KeyRun *)self)->data + i * KEY_BYTES, KEY_BYTES) == 0;
            Py_DECREF(o);
        }
    } else {
        Py_RETURN_NOTIMPLEMENTED;
    }
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

static PyObject *run_repr(PyObject *self) {
    if (!Py_SIZE(self)) return PyUnicode_FromString("KeyRun(0 keys)");
    const unsigned char *d = (const unsigned char *)((KeyRun *)self)->data;
    return PyUnicode_FromFormat("KeyRun(%zd keys, first %02x%02x%02x%02x)", Py_SIZE(self), d[0], d[1], d[2], d[3]);
}

static int run_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, self, ((KeyRun *)self)->data, Py_SIZE(self) * KEY_BYTES, 1, flags);
}

static PySequenceMethods run_as_sequence = {
    .sq_length = run_len, .sq_item = run_item, .sq_contains = run_contains,
};
static PyMappingMethods run_as_mapping = {.mp_length = run_len, .mp_subscript = run_subscript};
static PyBufferProcs run_as_buffer = {.bf_getbuffer = run_getbuffer};
static PyMethodDef run_methods[] = {
    {"index", run_index, METH_O, "index(key) -> the key's position (ValueError if absent)"},
    {NULL, NULL, 0, NULL}
};
static PyGetSetDef run_getset[] = {
    {"blob", run_blob, NULL, "the keys as one bytes object", NULL},
    {NULL, NULL, NULL, NULL, NULL}
};

static PyTypeObject KeyRunType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hicache.index._native_index.KeyRun",
    .tp_basicsize = offsetof(KeyRun, data),
    .tp_itemsize = KEY_BYTES,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The page keys of one radix node, packed (hicache/index/keys.py's KeyRun in C).",
    .tp_new = run_tp_new,
    .tp_repr = run_repr,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_as_sequence = &run_as_sequence,
    .tp_as_mapping = &run_as_mapping,
    .tp_as_buffer = &run_as_buffer,
    .tp_richcompare = run_richcompare,
    .tp_methods = run_methods,
    .tp_getset = run_getset,
};

int hicache_add_key_run(PyObject *module) {
    if (PyType_Ready(&KeyRunType) < 0) return -1;
    Py_INCREF(&KeyRunType);
    if (PyModule_AddObject(module, "KeyRun", (PyObject *)&KeyRunType) < 0) {
        Py_DECREF(&KeyRunType);
        return -1;
    }
    return 0;
}
