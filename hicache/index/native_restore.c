/* The restore's record check and chaining in C (hicache/index/restore.py calls these when the
   `_native_index` module is loaded): step for step restore.disk_runs, over packed records.

   - `chain_runs(keys, parents, tokens, tok_bytes, salt, order, run_ends, run_parent, left)
     -> (n_order, n_runs, n_left)`: record i is keys[16i:16i+16] (its page key),
     parents[16i:...] (its parent's key, or the salt for a sequence's first page) and
     tokens[tok_bytes*i:...]. A record is kept when its key is the 16-byte BLAKE2b of
     (parent key || tokens), or of (salt || tokens) (a keyed engine's named page), and its
     parents reach the salt through kept records. Written into the int64 arrays (each of
     room for every record): `order`, the kept records in runs, parents' runs first;
     `run_ends[r]`, where run r ends in `order`; `run_parent[r]`, the record whose key the
     run hangs below (it ends an earlier run), -1 for the salt; `left`, the records left
     out (orphans, corrupt). A record whose key came earlier is ignored, in neither list.
     A chain of records with one child each is one run (a radix node).
   - `page_key(prefix, data) -> bytes`: the 16-byte BLAKE2b of prefix || data, for tests.

   Why: at a million pages the restore's Python took ~8 s per million records to hash and
   chain them (docs/benchmarks.md, "A million pages"); this is a few hundred ms. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hicache/index/native_blake2b.h"
#include "hicache/index/native_restore.h"

#define KEY_BYTES 16
#define NONE (-1)

static void hash_of(const uint8_t *prefix, const uint8_t *data, size_t len, uint8_t *out) {
    hc_blake2b s;
    hc_blake2b_init(&s, KEY_BYTES);
    hc_blake2b_update(&s, prefix, KEY_BYTES);
    hc_blake2b_update(&s, data, len);
    hc_blake2b_final(&s, out);
}

static uint64_t slot_hash(const uint8_t *key) {  /* page keys are hashes: their bytes spread */
    uint64_t h;
    memcpy(&h, key, sizeof h);
    return h ^ (h >> 29);
}

typedef struct { int32_t head, next; } child_link;  /* a record's first child, and its next sibling */

typedef struct {
    const uint8_t *keys, *parents, *tokens, *salt;
    Py_ssize_t n, tok_bytes;
    /* 32-bit record numbers (records < 2**31): at ten million records these tables are
       random-access bound, and half the bytes is half the cache misses */
    int32_t *table;  /* open addressing: record index + 1, 0 = empty */
    uint64_t mask;
    child_link *links;  /* children lists: links[p].head (p = n for the salt), links[child].next */
    int32_t *stack;
    char *flags;  /* OK: the record's key is the hash of its parent field (or the salt) and its
                     tokens; DONE: kept, or a duplicate (not left out). One byte: one cache miss */
} chain;

enum { OK = 1, DONE = 2 };

static int64_t find(const chain *c, const uint8_t *key) {
    for (uint64_t s = slot_hash(key) & c->mask;; s = (s + 1) & c->mask) {
        int64_t v = c->table[s];
        if (!v) return NONE;
        if (memcmp(c->keys + (v - 1) * KEY_BYTES, key, KEY_BYTES) == 0) return v - 1;
    }
}

/* Index every key (the first of equal keys wins; later ones are marked done: ignored). */
static void index_keys(chain *c) {
    for (Py_ssize_t i = 0; i < c->n; i++) {
        const uint8_t *key = c->keys + i * KEY_BYTES;
        uint64_t s = slot_hash(key) & c->mask;
        for (;; s = (s + 1) & c->mask) {
            int64_t v = c->table[s];
            if (!v) { c->table[s] = (int32_t)(i + 1); break; }
            if (memcmp(c->keys + (v - 1) * KEY_BYTES, key, KEY_BYTES) == 0) { c->flags[i] |= DONE; break; }
        }
    }
}

/* Hang each record under its parent (in record order); orphans hang nowhere. */
static void link_children(chain *c) {
    for (Py_ssize_t i = c->n - 1; i >= 0; i--) {
        if (c->flags[i] & DONE) continue;
        const uint8_t *parent = c->parents + i * KEY_BYTES;
        int64_t p = memcmp(parent, c->salt, KEY_BYTES) == 0 ? c->n : find(c, parent);
        if (p == NONE) continue;
        c->links[i].next = c->links[p].head;
        c->links[p].head = (int32_t)i;
    }
}

/* Whether record i's key is the hash of (its parent field || its tokens), or of (salt ||
   tokens): a named page. Its parent field is the key of the record the walk reaches it
   from (found by that key) or the salt, so this is the check of restore.disk_runs. */
static char verified(const chain *c, Py_ssize_t i) {
    uint8_t h[KEY_BYTES];
    const uint8_t *key = c->keys + i * KEY_BYTES, *prev = c->parents + i * KEY_BYTES,
                  *data = c->tokens + i * c->tok_bytes;
    hash_of(prev, data, (size_t)c->tok_bytes, h);
    if (memcmp(h, key, KEY_BYTES) == 0) return 1;
    if (memcmp(prev, c->salt, KEY_BYTES) == 0) return 0;
    hash_of(c->salt, data, (size_t)c->tok_bytes, h);
    return memcmp(h, key, KEY_BYTES) == 0;
}

typedef struct { chain *c; Py_ssize_t lo, hi; } span;

static void *verify_span(void *arg) {
    span *s = arg;
    for (Py_ssize_t i = s->lo; i < s->hi; i++) s->c->flags[i] = verified(s->c, i) ? OK : 0;
    return NULL;
}

/* ok[i] for every record, on up to 4 threads (the hashing is most of the work; a record's
   check needs nothing of the others). */
static void verify_all(chain *c) {
    enum { MAX_THREADS = 4 };
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int t = cpus < 1 ? 1 : cpus > MAX_THREADS ? MAX_THREADS : (int)cpus;
    if (c->n < 4096) t = 1;
    span spans[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int k = 0; k < t; k++) {
        spans[k] = (span){c, c->n * k / t, c->n * (k + 1) / t};
        if (k > 0) started[k] = pthread_create(&threads[k], NULL, verify_span, &spans[k]) == 0;
    }
    verify_span(&spans[0]);
    for (int k = 1; k < t; k++) {
        if (started[k]) pthread_join(threads[k], NULL);
        else verify_span(&spans[k]);  /* no thread to be had: here */
    }
}

/* The depth-first walk from the salt (restore.disk_runs' loop). */
static void walk(chain *c, int64_t *order, int64_t *run_ends, int64_t *run_parent, Py_ssize_t *out) {
    Py_ssize_t n_order = 0, n_runs = 0, top = 0;
    c->stack[top++] = (int32_t)c->n;  /* parents whose children start runs; n: the salt */
    while (top) {
        int64_t parent = c->stack[--top];
        for (int64_t item = c->links[parent].head; item != NONE; item = c->links[item].next) {
            Py_ssize_t start = n_order;
            int64_t prev = parent, x = item;
            for (;;) {  /* a single-child chain becomes one run */
                if (!(c->flags[x] & OK)) break;  /* corrupt: it and its descendants stay out */
                order[n_order++] = x;
                c->flags[x] |= DONE;
                prev = x;
                int64_t only = c->links[x].head;
                if (only == NONE || c->links[only].next != NONE) break;
                c->links[x].head = NONE;  /* taken into this run */
                x = only;
            }
            if (n_order > start) {
                run_ends[n_runs] = n_order;
                run_parent[n_runs++] = parent == c->n ? NONE : parent;
                c->stack[top++] = (int32_t)prev;  /* its children, if any, start runs below it */
            }
        }
    }
    out[0] = n_order;
    out[1] = n_runs;
}

static PyObject *chain_runs(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer keys, parents, tokens, salt, order, ends, rparent, left;
    Py_ssize_t tok_bytes;
    if (!PyArg_ParseTuple(args, "y*y*y*ny*w*w*w*w*", &keys, &parents, &tokens, &tok_bytes, &salt, &order, &ends,
                          &rparent, &left)) return NULL;
    Py_buffer *all[] = {&keys, &parents, &tokens, &salt, &order, &ends, &rparent, &left};
    Py_ssize_t n = keys.len / KEY_BYTES, out[2] = {0, 0}, n_left = 0;
    PyObject *result = NULL;
    chain c = {0};
    if (keys.len % KEY_BYTES || parents.len != keys.len || tok_bytes < 0 || tokens.len != n * tok_bytes
            || salt.len != KEY_BYTES || n >= INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "records must be n keys, n parents and n * tok_bytes of tokens");
        goto done;
    }
    for (int b = 4; b < 8; b++) {
        if (all[b]->len < (Py_ssize_t)(n * sizeof(int64_t))) {
            PyErr_SetString(PyExc_ValueError, "every output needs room for an int64 per record");
            goto done;
        }
    }
    uint64_t cap = 16;
    while (cap < 2 * (uint64_t)n) cap <<= 1;
    c = (chain){keys.buf, parents.buf, tokens.buf, salt.buf, n, tok_bytes, calloc(cap, sizeof(int32_t)), cap - 1,
                malloc((n + 1) * sizeof(child_link)), malloc((n + 1) * sizeof(int32_t)), calloc(n + 1, 1)};
    if (!c.table || !c.links || !c.stack || !c.flags) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i <= n; i++) c.links[i] = (child_link){NONE, NONE};
    verify_all(&c);
    index_keys(&c);
    link_children(&c);
    walk(&c, order.buf, ends.buf, rparent.buf, out);
    int64_t *lo = left.buf;
    for (Py_ssize_t i = 0; i < n; i++) if (!(c.flags[i] & DONE)) lo[n_left++] = i;
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(nnn)", out[0], out[1], n_left);
done:
    free(c.table); free(c.links); free(c.stack); free(c.flags);
    for (int b = 0; b < 8; b++) PyBuffer_Release(all[b]);
    return result;
}

static PyObject *page_key(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer prefix, data;
    if (!PyArg_ParseTuple(args, "y*y*", &prefix, &data)) return NULL;
    PyObject *r = NULL;
    if (prefix.len != KEY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "the prefix is a 16-byte key");
    } else {
        uint8_t h[KEY_BYTES];
        hash_of(prefix.buf, data.buf, (size_t)data.len, h);
        r = PyBytes_FromStringAndSize((const char *)h, KEY_BYTES);
    }
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&data);
    return r;
}

PyMethodDef hicache_restore_methods[] = {
    {"chain_runs", chain_runs, METH_VARARGS,
     "chain_runs(keys, parents, tokens, tok_bytes, salt, order, run_ends, run_parent, left) -> (n_order, n_runs, n_left)"},
    {"page_key", page_key, METH_VARARGS, "page_key(prefix, data) -> the 16-byte BLAKE2b of prefix || data"},
    {NULL, NULL, 0, NULL}
};
