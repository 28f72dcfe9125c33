/* The disk writer's put loop (hicache/tiers/disk/native.py loads this library with ctypes and
   says why it exists and how it reaches LMDB): one call writes a run of queued puts and batch
   parts inside the writer's open LMDB transaction, with the GIL released for the whole run,
   calling py-lmdb's bundled LMDB and the xxhash extension's XXH3 through the function
   pointers the Python side passes in. It is linked against neither.

   Entry points: hicache_disk_put_run (the run), hicache_disk_txn_id and hicache_disk_dbi.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "hicache/kernels/native_build.h"

typedef struct { size_t size; void *data; } hc_val;               /* MDB_val */
typedef int (*hc_get_fn)(void *, unsigned, hc_val *, hc_val *);    /* mdb_get */
typedef int (*hc_put_fn)(void *, unsigned, hc_val *, hc_val *, unsigned); /* mdb_put */
typedef uint64_t (*hc_hash_fn)(const void *, size_t);              /* XXH3_64bits */

#define HC_NOTFOUND (-30798)
#define HC_RESERVE 0x10000
#define HC_NOOVERWRITE 0x10
#define HC_KEYEXIST (-30799)
#define HC_META_HEADER 72
#define HC_PARENT_SCAN 16

/* The writer's running totals for its open transaction (DiskWriter._put's inputs),
   updated in place. Must match State in native.py. */
typedef struct {
    int64_t used_bytes, map_bytes, deleted_bytes, capacity_bytes, map_size, headroom,
            batch_limit, max_footprint, freed_bytes, may_defer;
    double now;
    int64_t pages_written, bytes_written, dedup_puts, rejected_orphan;
    int64_t put_bytes_done;  /* page bytes of the ops done (written, duplicates, orphans) */
    int64_t stop_index, stop_page, stop_why, stop_rc;  /* before ops[stop_index] (a part: its page stop_page) */
} hc_state;

typedef struct {
    const char *key, *salt, *parent, *tokens, *page;
    Py_ssize_t tokens_len, page_len;
    int64_t charge;
    int parent_required;
    Py_ssize_t op_index, page_index;  /* where it came from: ops[op_index], page page_index of a batch (-1: a PutOp) */
} hc_op;

static const char hc_none[1] = {0};  /* marks a parent of None */
static PyObject *n_key, *n_salt, *n_parent, *n_tokens, *n_page, *n_charge, *n_required, *n_job, *n_digest;
static PyObject *n_batch, *n_lo, *n_hi, *n_keys, *n_chained, *n_token_bytes, *n_store, *n_page_bytes, *n_rows;

static int hc_names(void) {
    if (n_key) return 0;
    n_salt = PyUnicode_InternFromString("salt");
    n_parent = PyUnicode_InternFromString("parent");
    n_tokens = PyUnicode_InternFromString("tokens");
    n_page = PyUnicode_InternFromString("page");
    n_charge = PyUnicode_InternFromString("charge");
    n_required = PyUnicode_InternFromString("parent_required");
    n_job = PyUnicode_InternFromString("job");
    n_digest = PyUnicode_InternFromString("digest");
    n_batch = PyUnicode_InternFromString("batch");
    n_lo = PyUnicode_InternFromString("lo");
    n_hi = PyUnicode_InternFromString("hi");
    n_keys = PyUnicode_InternFromString("keys");
    n_chained = PyUnicode_InternFromString("chained");
    n_token_bytes = PyUnicode_InternFromString("token_bytes");
    n_store = PyUnicode_InternFromString("store");
    n_page_bytes = PyUnicode_InternFromString("page_bytes");
    n_rows = PyUnicode_InternFromString("rows");
    n_key = PyUnicode_InternFromString("key");
    return (n_key && n_salt && n_parent && n_tokens && n_page && n_charge && n_required && n_job
            && n_digest && n_batch && n_lo && n_hi && n_keys && n_chained && n_token_bytes && n_store
            && n_page_bytes && n_rows) ? 0 : -1;
}

/* A 16-byte bytes attribute; the op (alive in the caller's list) keeps it alive. */
static const char *hc_key16(PyObject *op, PyObject *name, int none_ok) {
    PyObject *v = PyObject_GetAttr(op, name);
    const char *p = NULL;
    if (!v) return NULL;
    if (v == Py_None && none_ok) { Py_DECREF(v); return hc_none; }
    if (PyBytes_CheckExact(v) && PyBytes_GET_SIZE(v) == 16) p = PyBytes_AS_STRING(v);
    else PyErr_Format(PyExc_TypeError, "disk put: %U must be 16 bytes", name);
    Py_DECREF(v);
    return p;
}

/* A bytes attribute (kept alive by its owner) and its length. */
static const char *hc_bytes(PyObject *obj, PyObject *name, Py_ssize_t *len) {
    PyObject *v = PyObject_GetAttr(obj, name);
    const char *p = NULL;
    if (!v) return NULL;
    if (PyBytes_CheckExact(v)) { p = PyBytes_AS_STRING(v); *len = PyBytes_GET_SIZE(v); }
    else PyErr_Format(PyExc_TypeError, "disk put: %U must be bytes", name);
    Py_DECREF(v);
    return p;
}

static int hc_int(PyObject *obj, PyObject *name, int64_t *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int hc_bool(PyObject *obj, PyObject *name, int *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    *out = PyObject_IsTrue(v);
    Py_DECREF(v);
    return *out < 0 ? -1 : 0;
}

static int hc_buffer(PyObject *obj, PyObject *name, Py_buffer *buf) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    int rc = PyObject_GetBuffer(v, buf, PyBUF_SIMPLE);
    Py_DECREF(v);
    return rc;
}

/* Whether the C loop takes `obj`: a put whose page it hashes itself (none of a hasher
   job's, nor a retry that carries its digest), or a part of a batch. 1 yes, 0 no, -1 error. */
static int hc_eligible(PyObject *obj, PyObject *put_type, PyObject *part_type) {
    PyObject *job, *digest;
    int ok;
    if (Py_TYPE(obj) == (PyTypeObject *)part_type) return 1;
    if (Py_TYPE(obj) != (PyTypeObject *)put_type) return 0;
    if (!(job = PyObject_GetAttr(obj, n_job))) return -1;
    if (!(digest = PyObject_GetAttr(obj, n_digest))) { Py_DECREF(job); return -1; }
    ok = job == Py_None && digest == Py_None;
    Py_DECREF(job);
    Py_DECREF(digest);
    return ok;
}

/* A PutOp's fields; its page's buffer goes to `buf` (released by the caller). */
static int hc_take(PyObject *obj, hc_op *o, Py_buffer *buf) {
    Py_ssize_t len;
    if (!(o->key = hc_key16(obj, n_key, 0)) || !(o->salt = hc_key16(obj, n_salt, 0))) return -1;
    if (!(o->parent = hc_key16(obj, n_parent, 1))) return -1;
    if (o->parent == hc_none) o->parent = NULL;
    if (!(o->tokens = hc_bytes(obj, n_tokens, &len))) return -1;
    o->tokens_len = len;
    if (hc_int(obj, n_charge, &o->charge) < 0 || hc_bool(obj, n_required, &o->parent_required) < 0) return -1;
    if (hc_buffer(obj, n_page, buf) < 0) return -1;
    o->page = buf->buf;
    o->page_len = buf->len;
    o->page_index = -1;
    return 0;
}

/* Pages [lo, hi) of a batch part (disk_batch.BatchPart) into v[0 .. hi - lo); the store's
   and the rows' buffers go to bufs[0], bufs[1] (released by the caller). Returns the
   number of buffers held, or -1 with an exception set. */
static int hc_take_part(PyObject *part, int64_t lo, int64_t hi, hc_op *v, Py_buffer *bufs) {
    PyObject *b = PyObject_GetAttr(part, n_batch);
    const char *salt, *parent, *keys, *tokens;
    Py_ssize_t keys_len, tokens_len;
    int64_t token_bytes, page_bytes, charge;
    int chained, required, held = 0;
    if (!b) return -1;
    if (!(salt = hc_key16(b, n_salt, 0)) || !(parent = hc_key16(b, n_parent, 1))
        || !(keys = hc_bytes(b, n_keys, &keys_len)) || !(tokens = hc_bytes(b, n_tokens, &tokens_len))
        || hc_int(b, n_token_bytes, &token_bytes) < 0 || hc_int(b, n_page_bytes, &page_bytes) < 0
        || hc_int(b, n_charge, &charge) < 0 || hc_bool(b, n_chained, &chained) < 0
        || hc_bool(b, n_required, &required) < 0) goto fail;
    if (parent == hc_none) parent = NULL;
    if (hc_buffer(b, n_store, &bufs[0]) < 0) goto fail;
    held = 1;
    if (hc_buffer(b, n_rows, &bufs[1]) < 0) goto fail;
    held = 2;
    if (lo < 0 || hi < lo || keys_len < 16 * hi || tokens_len < token_bytes * hi || token_bytes < 0
        || bufs[1].len < 8 * hi || page_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "disk put: a batch part out of its batch's range");
        goto fail;
    }
    const int64_t *rows = bufs[1].buf;
    for (int64_t j = lo; j < hi; j++) {
        hc_op *o = &v[j - lo];
        if (rows[j] < 0 || (rows[j] + 1) * page_bytes > bufs[0].len) {
            PyErr_SetString(PyExc_ValueError, "disk put: a batch row out of its store");
            goto fail;
        }
        o->key = keys + 16 * j;
        o->salt = salt;
        o->parent = chained && j > 0 ? keys + 16 * (j - 1) : parent;
        o->tokens = tokens + token_bytes * j;
        o->tokens_len = token_bytes;
        o->page = (const char *)bufs[0].buf + rows[j] * page_bytes;
        o->page_len = page_bytes;
        o->charge = charge;
        o->parent_required = required;
        o->page_index = j;
    }
    Py_DECREF(b);
    return held;
fail:
    Py_DECREF(b);
    for (int h = 0; h < held; h++) PyBuffer_Release(&bufs[h]);
    return -1;
}

/* The record on disk under this key is this page's (DiskWriter._put's dedup test:
   a well-formed header of the same namespace and size). */
static int hc_same(const hc_val *d, const hc_op *o) {
    const unsigned char *p = d->data;
    uint32_t n_tokens; uint16_t algo; uint64_t size;
    if (d->size < HC_META_HEADER) return 0;
    memcpy(&n_tokens, p + 64, 4);
    memcpy(&algo, p + 68, 2);
    memcpy(&size, p + 32, 8);
    if (d->size != HC_META_HEADER + 4 * (size_t)n_tokens || algo < 1 || algo > 3) return 0;
    return memcmp(p + 16, o->salt, 16) == 0 && size == (uint64_t)o->page_len;
}

/* Stop before entry `o` (nothing of it done): where (its op, its page of a batch) and why. */
static void hc_stop(hc_state *st, const hc_op *o, int64_t why, int64_t rc) {
    st->stop_index = o->op_index; st->stop_page = o->page_index; st->stop_why = why; st->stop_rc = rc;
}

static void hc_loop(hc_op *v, char *res, Py_ssize_t n, Py_ssize_t end, void *txn, unsigned pages,
                    unsigned meta, hc_get_fn get, hc_put_fn put, hc_hash_fn hash, hc_state *st) {
    for (Py_ssize_t i = 0; i < n; i++) {
        hc_op *o = &v[i];
        hc_val k = {16, (void *)o->key}, d;
        int rc, found = 0;
        if (o->parent && o->parent_required) {
            for (Py_ssize_t j = i - 1; j >= 0 && j >= i - HC_PARENT_SCAN && !found; j--)
                found = res[j] == 1 && memcmp(v[j].key, o->parent, 16) == 0;
            if (!found) {
                hc_val pk = {16, (void *)o->parent};
                rc = get(txn, meta, &pk, &d);
                if (rc == HC_NOTFOUND) {
                    res[i] = 3; st->rejected_orphan++; st->put_bytes_done += o->page_len;
                    continue;
                }
                if (rc) { hc_stop(st, o, 2, rc); return; }
            }
        }
        int64_t size = o->page_len, charge = o->charge;
        int64_t max_fp = charge > st->max_footprint ? charge : st->max_footprint;  /* kept once written */
        int64_t map_budget = st->map_size - st->headroom - 2 * (st->batch_limit + max_fp);
        /* budgets before the dedup test (Python's order is the reverse): a put handed back
           here is one Python finds a duplicate of or makes room for, with the same outcome */
        if (st->used_bytes + size > st->capacity_bytes ||
            st->map_bytes - st->deleted_bytes + charge > map_budget) {
            hc_stop(st, o, 1, 0); return;  /* over a budget: the evict hook is Python's */
        }
        if (st->may_defer && st->map_bytes + st->freed_bytes + charge + st->headroom > st->map_size) {
            hc_stop(st, o, 1, 0); return;  /* fits only once freed pages are reusable */
        }
        /* the meta record first, inserted only if the key is new: one B-tree descent for
           the dedup test and the insert; the checksum it carries is taken from the source
           (which LMDB's copy then reads from the cache) */
        uint64_t digest = hash(o->page, (size_t)size);
        hc_val mv = {HC_META_HEADER + (size_t)o->tokens_len, NULL};
        rc = put(txn, meta, &k, &mv, HC_RESERVE | HC_NOOVERWRITE);
        if (rc == HC_KEYEXIST) {  /* mv is the record on disk */
            if (hc_same(&mv, o)) {
                res[i] = 2; st->dedup_puts++; st->put_bytes_done += o->page_len;
                continue;
            }
            hc_stop(st, o, 1, 0); return;  /* another namespace's or size's record: Python replaces it */
        }
        if (rc) { hc_stop(st, o, 2, rc); return; }
        unsigned char *m = mv.data;  /* disk_format.META_HEADER: "<16s16sQQQdIHH" + tokens */
        uint64_t zero = 0, usize = (uint64_t)size;
        uint32_t n_tokens = (uint32_t)(o->tokens_len / 4);
        uint16_t algo = 3, flags = o->parent ? 1 : 0;
        if (o->parent) memcpy(m, o->parent, 16); else memset(m, 0, 16);
        memcpy(m + 16, o->salt, 16);
        memcpy(m + 32, &usize, 8);
        memcpy(m + 40, &digest, 8);
        memcpy(m + 48, &zero, 8);
        memcpy(m + 56, &st->now, 8);
        memcpy(m + 64, &n_tokens, 4);
        memcpy(m + 68, &algo, 2);
        memcpy(m + 70, &flags, 2);
        memcpy(m + HC_META_HEADER, o->tokens, (size_t)o->tokens_len);
        hc_val pv = {(size_t)size, (void *)o->page};  /* after filling the reserved record: next update */
        if ((rc = put(txn, pages, &k, &pv, 0))) { hc_stop(st, o, 2, rc); return; }
        st->max_footprint = max_fp;
        st->used_bytes += size;
        st->map_bytes += charge;
        st->pages_written++;
        st->bytes_written += size;
        st->put_bytes_done += size;
        res[i] = 1;
    }
    st->stop_index = end; st->stop_page = -1; st->stop_why = 0; st->stop_rc = 0;
}

/* Write the run of puts the C loop takes (hc_eligible) from ops[lo], in the open
   transaction `txn`, up to the first op it does not take: PutOps one page each, batch
   parts (`part_type`) their pages [lo, hi). Returns bytes with each page's outcome in
   order (NOT_DONE from where it stopped), `st` where (op, page) and why; NULL with a
   Python exception set when an op is malformed (nothing written then). */
PyObject *hicache_disk_put_run(PyObject *ops, Py_ssize_t lo, PyObject *put_type, PyObject *part_type,
                               void *txn, unsigned pages, unsigned meta, void *get, void *put, void *hash,
                               hc_state *st) {
    Py_ssize_t n_ops = 0, n = 0, n_bufs = 0, cap;
    int ok = 1;
    PyObject *out = NULL;
    if (hc_names() < 0) return NULL;
    if (!PyList_Check(ops) || lo < 0 || lo > PyList_GET_SIZE(ops)) {
        PyErr_SetString(PyExc_ValueError, "disk put run: bad op range");
        return NULL;
    }
    /* the run: how many ops, how many pages */
    for (Py_ssize_t i = lo; i < PyList_GET_SIZE(ops); i++, n_ops++) {
        PyObject *op = PyList_GET_ITEM(ops, i);
        int e = hc_eligible(op, put_type, part_type);
        if (e < 0) return NULL;
        if (!e) break;
        if (Py_TYPE(op) == (PyTypeObject *)part_type) {
            int64_t a, b;
            if (hc_int(op, n_lo, &a) < 0 || hc_int(op, n_hi, &b) < 0) return NULL;
            n += b > a ? b - a : 0;
        } else n++;
    }
    cap = n ? n : 1;
    hc_op *v = PyMem_Calloc((size_t)cap, sizeof *v);
    Py_buffer *bufs = PyMem_Calloc((size_t)(2 * n_ops + 1), sizeof *bufs);
    if (!v || !bufs) { PyMem_Free(v); PyMem_Free(bufs); PyErr_NoMemory(); return NULL; }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n_ops && ok; i++) {
        PyObject *op = PyList_GET_ITEM(ops, lo + i);
        if (Py_TYPE(op) == (PyTypeObject *)part_type) {
            int64_t a, b;
            int held;
            if (hc_int(op, n_lo, &a) < 0 || hc_int(op, n_hi, &b) < 0 || b - a > n - k) { ok = 0; break; }
            if ((held = hc_take_part(op, a, b, &v[k], &bufs[n_bufs])) < 0) { ok = 0; break; }
            n_bufs += held;
            for (int64_t j = 0; j < b - a; j++) v[k + j].op_index = lo + i;
            k += b - a;
        } else {
            if (k >= n || hc_take(op, &v[k], &bufs[n_bufs]) < 0) { ok = 0; break; }
            n_bufs++;
            v[k++].op_index = lo + i;
        }
    }
    if (ok && k != n) { PyErr_SetString(PyExc_ValueError, "disk put run: the ops changed"); ok = 0; }
    if (ok && !PyErr_Occurred()) out = PyBytes_FromStringAndSize(NULL, n);
    if (out) {
        char *res = PyBytes_AS_STRING(out);
        memset(res, 0, (size_t)n);
        Py_BEGIN_ALLOW_THREADS
        hc_loop(v, res, n, lo + n_ops, txn, pages, meta, (hc_get_fn)get, (hc_put_fn)put, (hc_hash_fn)hash, st);
        Py_END_ALLOW_THREADS
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "disk put run: a malformed op");
    }
    for (Py_ssize_t i = 0; i < n_bufs; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(v);
    return out;
}

HICACHE_BUILD_INFO_SYMBOL;

/* LMDB's txn_id of `txn`, to check the located pointer. */
uint64_t hicache_disk_txn_id(void *fn, void *txn) { return ((size_t (*)(void *))fn)(txn); }

int hicache_disk_dbi(void *fn, void *txn, const char *name, unsigned *dbi) {
    return ((int (*)(void *, const char *, unsigned, unsigned *))fn)(txn, name, 0, dbi);
}
