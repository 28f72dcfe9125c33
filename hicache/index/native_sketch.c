/* The disk admission's frequency sketch in C (hicache/index/admission.py's FrequencySketch
   calls these when the `_native_index` module is loaded): step for step its Python, over the
   same table (one bytearray of depth x width counters, row i at i * width).

   - `sketch_add(table, depth, mask, blob, added, sample) -> added`: FrequencySketch.add for
     the page keys packed in `blob` (16 bytes each; the sketch's key is the first 8 bytes
     read little-endian: admission.admission_key), in order, aging (every counter halved,
     `added` halved) whenever `added` reaches `sample`; returns the new `added`.
   - `sketch_estimate(table, depth, mask, key) -> int`: FrequencySketch.estimate of one page
     key (16 bytes).

   Why: every `match` of an engine that stores by puts (vLLM) counts each page key of the
   request; in Python that was the largest single cost of the fill at a million pages
   (~27% of the event loop, docs/benchmarks.md "A million pages"). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "hicache/index/native_sketch.h"

#define KEY_BYTES 16
#define MAX_COUNT 15
#define MAX_DEPTH 16

/* splitmix64's finalizer (admission._mix): a fixed hash of the key. */
static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static uint64_t key_of(const unsigned char *p) {  /* the first 8 bytes, little-endian */
    uint64_t k = 0;
    for (int b = 7; b >= 0; b--) k = (k << 8) | p[b];
    return k;
}

/* The counter index of each row for `key` (FrequencySketch._slots, plus the row offset). */
static void slots_of(uint64_t key, Py_ssize_t depth, uint64_t mask, Py_ssize_t width, Py_ssize_t *out) {
    uint64_t h = mix(key), h1 = h & 0xFFFFFFFFULL, h2 = (h >> 32) | 1;
    for (Py_ssize_t i = 0; i < depth; i++) out[i] = i * width + (Py_ssize_t)((h1 + (uint64_t)i * h2) & mask);
}

/* Checks the table against depth and mask; the row width, or -1 with an exception set. */
static Py_ssize_t table_width(const Py_buffer *t, Py_ssize_t depth, unsigned long long mask) {
    Py_ssize_t width = (Py_ssize_t)mask + 1;
    if (depth < 1 || depth > MAX_DEPTH || (mask & (mask + 1)) != 0 || width < 1 || t->len != depth * width) {
        PyErr_SetString(PyExc_ValueError, "the table is not depth x (mask + 1) counters");
        return -1;
    }
    return width;
}

static PyObject *sketch_add(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer table, blob;
    Py_ssize_t depth, added, sample;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "w*nKy*nn", &table, &depth, &mask, &blob, &added, &sample)) return NULL;
    Py_ssize_t width = table_width(&table, depth, mask);
    if (width >= 0 && (blob.len % KEY_BYTES || sample < 1)) {
        PyErr_SetString(PyExc_ValueError, "keys must be packed 16-byte page keys and sample >= 1");
        width = -1;
    }
    if (width < 0) {
        PyBuffer_Release(&table);
        PyBuffer_Release(&blob);
        return NULL;
    }
    unsigned char *t = table.buf;
    const unsigned char *keys = blob.buf;
    Py_ssize_t n = blob.len / KEY_BYTES, slots[MAX_DEPTH];
    for (Py_ssize_t k = 0; k < n; k++) {
        slots_of(key_of(keys + k * KEY_BYTES), depth, mask, width, slots);
        unsigned char low = t[slots[0]];
        for (Py_ssize_t i = 1; i < depth; i++) if (t[slots[i]] < low) low = t[slots[i]];
        if (low < MAX_COUNT) {  /* conservative update: raise only the counters at the minimum */
            for (Py_ssize_t i = 0; i < depth; i++) if (t[slots[i]] == low) t[slots[i]] = low + 1;
        }
        if (++added >= sample) {  /* aging: FrequencySketch._age */
            for (Py_ssize_t c = 0; c < table.len; c++) t[c] >>= 1;
            added /= 2;
        }
    }
    PyBuffer_Release(&table);
    PyBuffer_Release(&blob);
    return PyLong_FromSsize_t(added);
}

static PyObject *sketch_estimate(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer table, key;
    Py_ssize_t depth;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "y*nKy*", &table, &depth, &mask, &key)) return NULL;
    Py_ssize_t width = table_width(&table, depth, mask);
    if (width >= 0 && key.len != KEY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "a page key is 16 bytes");
        width = -1;
    }
    long low = -1;
    if (width >= 0) {
        const unsigned char *t = table.buf;
        Py_ssize_t slots[MAX_DEPTH];
        slots_of(key_of(key.buf), depth, mask, width, slots);
        low = t[slots[0]];
        for (Py_ssize_t i = 1; i < depth; i++) if (t[slots[i]] < low) low = t[slots[i]];
    }
    PyBuffer_Release(&table);
    PyBuffer_Release(&key);
    return low < 0 ? NULL : PyLong_FromLong(low);
}

PyMethodDef hicache_sketch_methods[] = {
    {"sketch_add", sketch_add, METH_VARARGS, "sketch_add(table, depth, mask, blob, added, sample) -> added"},
    {"sketch_estimate", sketch_estimate, METH_VARARGS, "sketch_estimate(table, depth, mask, key) -> count"},
    {NULL, NULL, 0, NULL}
};
