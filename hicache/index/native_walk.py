"""The radix walk of RadixIndex.match in C, over the index's own TreeNode objects.

Why: a match's walk in Python pays an interpreter round per node for a dict lookup,
two key slices, a comparison and three attribute updates (~0.5 us a node, plus the
calls around it), on the path every engine request waits on. The C loop does the same
steps through the CPython C API on the same objects: there is no second copy of the
tree that could drift from it.

`walk(root, blob, lane, seg, now)` walks from `root` along the packed 16-byte page
keys in `blob` exactly as the Python loop in RadixIndex.match does (same segment
rules, same key comparisons, `last_access = now` and `hit_count += 1` on every
node it passes) and returns `(path, n_dev, n_host, j)`. When the request diverges or
ends inside the last node of `path`, that node is left untouched and `j` is the
number of its pages that match: the caller splits it there and touches the upper part
(the split is Python's, tree_walk.split_node). Otherwise `j` is -1.

The extension is compiled on first use against this Python's headers
(hicache/kernels/native_build.py). Without a compiler or headers, or with
`HICACHE_NATIVE_INDEX=0`, `load()` returns None and the index walks in Python:
the same result (tests/index/test_native_walk.py checks both on random trees).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sysconfig
import threading
from types import ModuleType

from hicache.kernels import native_build

log = logging.getLogger(__name__)

_MODULE = "hicache_native_walk"
_lock = threading.Lock()
_loaded: list[tuple[ModuleType | None, str | None]] = []  # [] = not tried yet

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define KEY_BYTES 16

static PyObject *s_children, *s_device, *s_host, *s_on_disk, *s_keys, *s_last_access, *s_hit_count;

/* Whether node key `k` (a bytes object) equals the 16 bytes at `p`. */
static int key_eq(PyObject *k, const char *p) {
    return PyBytes_CheckExact(k) && PyBytes_GET_SIZE(k) == KEY_BYTES
        && memcmp(PyBytes_AS_STRING(k), p, KEY_BYTES) == 0;
}

/* tree_walk.common_pages: leading pages of `ck` equal to the request's keys from
   `start`, given that the first is; chained keys make equality monotone. */
static Py_ssize_t common_pages(PyObject *ck, const char *blob, Py_ssize_t n, Py_ssize_t start) {
    Py_ssize_t m = PyList_GET_SIZE(ck);
    if (n - start < m) m = n - start;
    if (key_eq(PyList_GET_ITEM(ck, m - 1), blob + (start + m - 1) * KEY_BYTES)) return m;
    Py_ssize_t lo = 1, hi = m - 1;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) >> 1;
        if (key_eq(PyList_GET_ITEM(ck, mid - 1), blob + (start + mid - 1) * KEY_BYTES)) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* One attribute's truth value; -1 on error. */
static int attr_true(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static int touch(PyObject *node, PyObject *now) {
    if (PyObject_SetAttr(node, s_last_access, now) < 0) return -1;
    PyObject *hc = PyObject_GetAttr(node, s_hit_count);
    if (!hc) return -1;
    PyObject *one = PyLong_FromLong(1);
    PyObject *next = one ? PyNumber_Add(hc, one) : NULL;
    Py_DECREF(hc);
    Py_XDECREF(one);
    if (!next) return -1;
    int r = PyObject_SetAttr(node, s_hit_count, next);
    Py_DECREF(next);
    return r;
}

static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *root, *lane, *now;
    Py_buffer buf;
    int seg;
    if (!PyArg_ParseTuple(args, "Oy*OiO", &root, &buf, &lane, &seg, &now)) return NULL;
    const char *blob = buf.buf;
    Py_ssize_t n = buf.len / KEY_BYTES, i = 0, n_dev = 0, n_host = 0, j = -1;
    PyObject *path = PyList_New(0);
    PyObject *node = root;  /* borrowed: the tree (and `path`) keep every node alive */
    if (!path) goto fail;
    while (i < n) {
        PyObject *children = PyObject_GetAttr(node, s_children);
        if (!children) goto fail;
        if (!PyDict_CheckExact(children)) {
            Py_DECREF(children);
            PyErr_SetString(PyExc_TypeError, "TreeNode.children must be a dict");
            goto fail;
        }
        PyObject *key = PyBytes_FromStringAndSize(blob + i * KEY_BYTES, KEY_BYTES);
        if (!key) { Py_DECREF(children); goto fail; }
        PyObject *child = PyDict_GetItemWithError(children, key);  /* borrowed */
        Py_DECREF(key);
        Py_XINCREF(child);
        Py_DECREF(children);
        if (!child) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        int fits = 0;  /* the segment rules of RadixIndex.match */
        if (seg == 0) {
            PyObject *dev = PyObject_GetAttr(child, s_device);
            int has = dev ? PySequence_Contains(dev, lane) : -1;
            Py_XDECREF(dev);
            if (has < 0) { Py_DECREF(child); goto fail; }
            if (has) { n_dev++; fits = 1; }
        }
        if (!fits) {
            PyObject *host = PyObject_GetAttr(child, s_host);
            if (!host) { Py_DECREF(child); goto fail; }
            int on_host = host != Py_None;
            Py_DECREF(host);
            if (seg <= 1 && on_host) { seg = 1; n_host++; fits = 1; }
            else if (on_host) { seg = 2; fits = 1; }
            else {
                int on_disk = attr_true(child, s_on_disk);
                if (on_disk < 0) { Py_DECREF(child); goto fail; }
                if (on_disk) { seg = 2; fits = 1; }
            }
        }
        if (!fits) { Py_DECREF(child); break; }
        PyObject *ck = PyObject_GetAttr(child, s_keys);
        if (!ck) { Py_DECREF(child); goto fail; }
        if (!PyList_CheckExact(ck) || PyList_GET_SIZE(ck) == 0) {
            Py_DECREF(ck); Py_DECREF(child);
            PyErr_SetString(PyExc_TypeError, "TreeNode.keys must be a non-empty list");
            goto fail;
        }
        Py_ssize_t m = PyList_GET_SIZE(ck), step;
        if (i + m <= n && key_eq(PyList_GET_ITEM(ck, m - 1), blob + (i + m - 1) * KEY_BYTES)) step = m;
        else step = common_pages(ck, blob, n, i);
        Py_DECREF(ck);
        int appended = PyList_Append(path, child);
        if (appended < 0) { Py_DECREF(child); goto fail; }
        if (step < m) {  /* diverged or ended inside: the caller splits, then touches */
            Py_DECREF(child);
            j = step;
            break;
        }
        if (touch(child, now) < 0) { Py_DECREF(child); goto fail; }
        Py_DECREF(child);
        i += step;
        node = child;
    }
    PyBuffer_Release(&buf);
    PyObject *out = Py_BuildValue("(Nnnn)", path, n_dev, n_host, j);
    return out;
fail:
    PyBuffer_Release(&buf);
    Py_XDECREF(path);
    return NULL;
}

static PyMethodDef mod_methods[] = {
    {"walk", walk, METH_VARARGS, "walk(root, blob, lane, seg, now) -> (path, n_dev, n_host, j)"},
    {NULL}
};
static struct PyModuleDef mod_def = {PyModuleDef_HEAD_INIT, "hicache_native_walk", NULL, -1, mod_methods};

PyMODINIT_FUNC PyInit_hicache_native_walk(void) {
    if (!(s_children = PyUnicode_InternFromString("children"))) return NULL;
    if (!(s_device = PyUnicode_InternFromString("device"))) return NULL;
    if (!(s_host = PyUnicode_InternFromString("host"))) return NULL;
    if (!(s_on_disk = PyUnicode_InternFromString("on_disk"))) return NULL;
    if (!(s_keys = PyUnicode_InternFromString("keys"))) return NULL;
    if (!(s_last_access = PyUnicode_InternFromString("last_access"))) return NULL;
    if (!(s_hit_count = PyUnicode_InternFromString("hit_count"))) return NULL;
    return PyModule_Create(&mod_def);
}
"""


def load() -> ModuleType | None:
    """The compiled walk, or None where it cannot be built here (logged once)."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0][0]


def unavailable_reason() -> str | None:
    load()
    return _loaded[0][1]


def _load() -> tuple[ModuleType | None, str | None]:
    if os.environ.get("HICACHE_NATIVE_INDEX", "1") == "0":
        return None, "disabled by HICACHE_NATIVE_INDEX=0"
    try:
        include = sysconfig.get_paths()["include"]
        if not os.path.exists(os.path.join(include, "Python.h")):
            raise OSError(f"no Python.h in {include} (the Python development headers)")
        path = native_build.build(_MODULE, SOURCE, [f"-I{include}"])
        loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
        spec = importlib.util.spec_from_file_location(_MODULE, path, loader=loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        return mod, None
    except (OSError, subprocess.SubprocessError, ImportError) as e:
        log.warning("native radix walk unavailable, walking in Python: %s", e)
        return None, f"not built: {e}"
