/* The radix index's hot loops (hicache/index/native_index.py loads this module): a CPython
   extension module `hicache.index._native_index` working on the index's own TreeNode objects
   through the C API, step for step as the Python it stands in for:

   - `walk(root, blob, lane, seg, now)`: RadixIndex.match's walk (tree_walk.walk_path);
   - `lock_path(path, tier, engine, protected)` and `unlock_path(path, tier, engine,
     protected, maybe_queue)`: ResidencyLedger.lock_path / unlock_path (policy.py);
   - `lock_segments(nodes, n_dev, n_host, engine, protected)`: RadixIndex.lock_match's locks;
   - `walk_lock(root, blob, engine, now, protected)`: walk, then lock_segments when no split
     is needed: RadixIndex.match_locked in one call;
   - `unlock_node(node, tier, key, root, protected, maybe_queue)`: RadixIndex.unlock after its
     argument checks (the path up and the held check here; a refusal is a small int for the
     caller to raise, with nothing changed);
   - the disk admission's frequency sketch: native_sketch.c;
   - the restore's record check and chaining: native_restore.c;
   - KeyRun, a node's page keys packed in one object: native_keys.c.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <string.h>

#include "hicache/kernels/native_build.h"
#include "hicache/index/native_keys.h"
#include "hicache/index/native_restore.h"
#include "hicache/index/native_sketch.h"

#define KEY_BYTES 16

static PyObject *s_children, *s_device, *s_host, *s_on_disk, *s_keys, *s_last_access, *s_hit_count;

static PyObject *s_blob;

/* A node's keys, packed: a KeyRun's (native_keys.c) or the bytes `blob` of keys.py's KeyRun,
   which *hold then keeps alive (release it after use); NULL with an exception otherwise. */
static const char *node_keys(PyObject *ck, Py_ssize_t *n, PyObject **hold) {
    *hold = NULL;
    const char *d = hicache_key_run_data(ck, n);
    if (d) return d;
    PyObject *blob = PyObject_GetAttr(ck, s_blob);
    if (blob && PyBytes_CheckExact(blob) && PyBytes_GET_SIZE(blob) % KEY_BYTES == 0) {
        *hold = blob;
        *n = PyBytes_GET_SIZE(blob) / KEY_BYTES;
        return PyBytes_AS_STRING(blob);
    }
    Py_XDECREF(blob);
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, "TreeNode.keys must be a KeyRun");
    return NULL;
}

/* tree_walk.common_pages: leading pages of the node's `m` keys at `ck` equal to the request's
   keys from `start`, given that the first is; chained keys make equality monotone. */
static Py_ssize_t common_pages(const char *ck, Py_ssize_t m, const char *blob, Py_ssize_t n, Py_ssize_t start) {
    if (n - start < m) m = n - start;
    if (memcmp(ck + (m - 1) * KEY_BYTES, blob + (start + m - 1) * KEY_BYTES, KEY_BYTES) == 0) return m;
    Py_ssize_t lo = 1, hi = m - 1;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) >> 1;
        if (memcmp(ck + (mid - 1) * KEY_BYTES, blob + (start + mid - 1) * KEY_BYTES, KEY_BYTES) == 0) lo = mid;
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

/* walk()'s loop over the keys in `buf`: the path (a new list), its segment lengths and
   `j` in *out (n_dev, n_host, j); NULL on error. */
static PyObject *walk_path(PyObject *root, const Py_buffer *bp, PyObject *lane, int seg, PyObject *now,
                           Py_ssize_t *out) {
    const char *blob = bp->buf;
    Py_ssize_t n = bp->len / KEY_BYTES, i = 0, n_dev = 0, n_host = 0, j = -1;
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
        PyObject *ck = PyObject_GetAttr(child, s_keys), *hold = NULL;
        if (!ck) { Py_DECREF(child); goto fail; }
        Py_ssize_t m = 0, step;
        const char *kd = node_keys(ck, &m, &hold);
        if (kd && m == 0) {
            PyErr_SetString(PyExc_TypeError, "TreeNode.keys of a child must not be empty");
            kd = NULL;
        }
        if (!kd) { Py_XDECREF(hold); Py_DECREF(ck); Py_DECREF(child); goto fail; }
        if (i + m <= n && memcmp(kd + (m - 1) * KEY_BYTES, blob + (i + m - 1) * KEY_BYTES, KEY_BYTES) == 0) step = m;
        else step = common_pages(kd, m, blob, n, i);
        Py_XDECREF(hold);
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
    out[0] = n_dev; out[1] = n_host; out[2] = j;
    return path;
fail:
    Py_XDECREF(path);
    return NULL;
}

static PyObject *walk(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *root, *lane, *now;
    Py_buffer buf;
    int seg;
    Py_ssize_t out[3];
    if (!PyArg_ParseTuple(args, "Oy*OiO", &root, &buf, &lane, &seg, &now)) return NULL;
    PyObject *path = walk_path(root, &buf, lane, seg, now, out);
    PyBuffer_Release(&buf);
    return path ? Py_BuildValue("(Nnnn)", path, out[0], out[1], out[2]) : NULL;
}

/* ---------------------------------------------------------------- locks */

static PyObject *s_lock_ref, *s_device_locks, *s_queued, *s_removed, *s_parent, *host_lane, *disk_lane;

/* list[i] += delta; the new value, or LONG_MIN on error. */
static long list_add(PyObject *list, Py_ssize_t i, long delta) {
    if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) != 3) {
        PyErr_SetString(PyExc_TypeError, "TreeNode.lock_ref must be a list of 3 ints");
        return LONG_MIN;
    }
    long v = PyLong_AsLong(PyList_GET_ITEM(list, i));
    if (v == -1 && PyErr_Occurred()) return LONG_MIN;
    v += delta;
    PyObject *o = PyLong_FromLong(v);
    if (!o) return LONG_MIN;
    PyList_SetItem(list, i, o);  /* steals o, drops the old item */
    return v;
}

/* d.get(key, 0) as a long; LONG_MIN on error. */
static long dict_get(PyObject *d, PyObject *key) {
    PyObject *o = PyDict_GetItemWithError(d, key);
    if (!o) return PyErr_Occurred() ? LONG_MIN : 0;
    long v = PyLong_AsLong(o);
    return (v == -1 && PyErr_Occurred()) ? LONG_MIN : v;
}

/* d[key] += delta (a missing key is 0 when `missing_ok`, else KeyError, as `d[key] += n`
   raises); the new value, or LONG_MIN on error. */
static long dict_add(PyObject *d, PyObject *key, long delta, int missing_ok) {
    PyObject *o = PyDict_GetItemWithError(d, key);
    long v = 0;
    if (o) {
        v = PyLong_AsLong(o);
        if (v == -1 && PyErr_Occurred()) return LONG_MIN;
    } else if (PyErr_Occurred()) {
        return LONG_MIN;
    } else if (!missing_ok) {
        PyErr_SetObject(PyExc_KeyError, key);
        return LONG_MIN;
    }
    v += delta;
    PyObject *n = PyLong_FromLong(v);
    if (!n) return LONG_MIN;
    int r = PyDict_SetItem(d, key, n);
    Py_DECREF(n);
    return r < 0 ? LONG_MIN : v;
}

static PyObject *empty_map;  /* stands in, read-only, for a node's shared empty map */

/* A node's map (device, device_locks) to read: a dict, or node.NO_ENTRIES (any empty
   mapping), read as an empty dict that nobody writes. */
static PyObject *get_dict(PyObject *x, PyObject *name) {
    PyObject *d = PyObject_GetAttr(x, name);
    if (d && !PyDict_CheckExact(d)) {
        Py_ssize_t n = PyMapping_Check(d) ? PyObject_Length(d) : -1;
        Py_DECREF(d);
        if (n == 0) {
            Py_INCREF(empty_map);
            return empty_map;
        }
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "TreeNode.%U must be a dict", name);
        return NULL;
    }
    return d;
}

/* A node's map to write: node.NO_ENTRIES is replaced by a new dict first (policy.py does the same). */
static PyObject *get_dict_mut(PyObject *x, PyObject *name) {
    PyObject *d = get_dict(x, name);
    if (d != empty_map) return d;
    Py_DECREF(d);
    d = PyDict_New();
    if (d && PyObject_SetAttr(x, name, d) < 0) Py_CLEAR(d);
    return d;
}

/* policy._engines_flipped: engines whose copy on the node changes protection when the
   device-lock count of `engine` (an engine, or None for all) moves between 0 and 1. */
static PyObject *engines_flipped(PyObject *dev, PyObject *dl, PyObject *engine) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    if (engine == Py_None) {
        PyObject *e, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(dev, &pos, &e, &v)) {
            long c = dict_get(dl, e);
            if (c == LONG_MIN || (!c && PyList_Append(out, e) < 0)) { Py_DECREF(out); return NULL; }
        }
        return out;
    }
    int has = PyDict_Contains(dev, engine);
    long all = has > 0 ? dict_get(dl, Py_None) : 0;
    if (has < 0 || all == LONG_MIN || (has && !all && PyList_Append(out, engine) < 0)) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* Whether the node is resident in the host lane (tier 1) or the disk lane (tier 2). */
static int resident_in(PyObject *x, long tier) {
    if (tier == 1) {
        PyObject *h = PyObject_GetAttr(x, s_host);
        if (!h) return -1;
        int r = h != Py_None;
        Py_DECREF(h);
        return r;
    }
    return attr_true(x, s_on_disk);
}

static Py_ssize_t n_keys(PyObject *x) {
    PyObject *k = PyObject_GetAttr(x, s_keys);
    if (!k) return -1;
    Py_ssize_t n = PyObject_Length(k);
    Py_DECREF(k);
    return n;
}

/* ResidencyLedger.lock_path over the first `count` nodes of `path`: a ref in `tier`
   on each; -1 on error. */
static int lock_nodes(PyObject *path, Py_ssize_t count, long tier, PyObject *engine, PyObject *prot) {
    PyObject *lane = tier == 1 ? host_lane : disk_lane;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *x = PyList_GET_ITEM(path, k);
        PyObject *r = PyObject_GetAttr(x, s_lock_ref);
        if (!r) return -1;
        long v = list_add(r, tier, 1);
        Py_DECREF(r);
        if (v == LONG_MIN) return -1;
        if (tier == 0) {
            PyObject *dl = get_dict_mut(x, s_device_locks);
            if (!dl) return -1;
            long c = dict_add(dl, engine, 1, 1);
            PyObject *dev = c == 1 ? get_dict(x, s_device) : NULL;
            if (c == LONG_MIN || (c == 1 && !dev)) { Py_DECREF(dl); return -1; }
            if (dev && PyDict_GET_SIZE(dev)) {
                Py_ssize_t n = n_keys(x);
                PyObject *flipped = n < 0 ? NULL : engines_flipped(dev, dl, engine);
                if (!flipped) { Py_DECREF(dev); Py_DECREF(dl); return -1; }
                for (Py_ssize_t q = 0; q < PyList_GET_SIZE(flipped); q++) {
                    if (dict_add(prot, PyList_GET_ITEM(flipped, q), n, 1) == LONG_MIN) {
                        Py_DECREF(flipped); Py_DECREF(dev); Py_DECREF(dl); return -1;
                    }
                }
                Py_DECREF(flipped);
            }
            Py_XDECREF(dev);
            Py_DECREF(dl);
        } else if (v == 1) {
            int res = resident_in(x, tier);
            if (res < 0) return -1;
            if (res) {
                Py_ssize_t n = n_keys(x);
                if (n < 0 || dict_add(prot, lane, n, 0) == LONG_MIN) return -1;
            }
        }
    }
    return 0;
}

static int check_tier(long tier) {
    if (tier >= 0 && tier <= 2) return 0;
    PyErr_SetString(PyExc_ValueError, "tier must be 0..2");
    return -1;
}

/* lock_path(path, tier, engine, protected): ResidencyLedger.lock_path. */
static PyObject *lock_path(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *path, *engine, *prot;
    long tier;
    if (!PyArg_ParseTuple(args, "O!lOO!", &PyList_Type, &path, &tier, &engine, &PyDict_Type, &prot)) return NULL;
    if (check_tier(tier) < 0 || lock_nodes(path, PyList_GET_SIZE(path), tier, engine, prot) < 0) return NULL;
    Py_RETURN_NONE;
}

/* lock_segments(nodes, n_dev, n_host, engine, protected): RadixIndex.lock_match's locks,
   the first n_dev nodes on `engine`'s device, the first n_dev + n_host in HOST. */
static PyObject *lock_segments(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *nodes, *engine, *prot;
    Py_ssize_t n_dev, n_host;
    if (!PyArg_ParseTuple(args, "O!nnOO!", &PyList_Type, &nodes, &n_dev, &n_host, &engine, &PyDict_Type, &prot))
        return NULL;
    if (n_dev < 0 || n_host < 0 || n_dev + n_host > PyList_GET_SIZE(nodes)) {
        PyErr_SetString(PyExc_ValueError, "segments longer than the path");
        return NULL;
    }
    if (n_dev && lock_nodes(nodes, n_dev, 0, engine, prot) < 0) return NULL;
    if (n_host && lock_nodes(nodes, n_dev + n_host, 1, Py_None, prot) < 0) return NULL;
    Py_RETURN_NONE;
}

/* walk_lock(root, blob, engine, now, protected) -> (path, n_dev, n_host, j): walk() from
   the device segment of `engine`, then, when no node needs splitting (j == -1), the locks
   of lock_segments on what it matched; with j >= 0 nothing is locked (the caller splits
   the last node first, then locks). One call for RadixIndex.match_locked. */
static PyObject *walk_lock(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *root, *engine, *now, *prot;
    Py_buffer buf;
    Py_ssize_t out[3];
    if (!PyArg_ParseTuple(args, "Oy*OOO!", &root, &buf, &engine, &now, &PyDict_Type, &prot)) return NULL;
    PyObject *path = walk_path(root, &buf, engine, 0, now, out);
    PyBuffer_Release(&buf);
    if (!path) return NULL;
    if (out[2] < 0 && ((out[0] && lock_nodes(path, out[0], 0, engine, prot) < 0)
                       || (out[1] && lock_nodes(path, out[0] + out[1], 1, Py_None, prot) < 0))) {
        Py_DECREF(path);
        return NULL;
    }
    return Py_BuildValue("(Nnnn)", path, out[0], out[1], out[2]);
}

/* maybe_queue(x, lane) unless the lane already has an entry in x.queued; -1 on error. */
static int queue_if_new(PyObject *maybe_queue, PyObject *x, PyObject *lane) {
    PyObject *queued = PyObject_GetAttr(x, s_queued);
    if (!queued) return -1;
    int in = PySequence_Contains(queued, lane);
    Py_DECREF(queued);
    if (in) return in < 0 ? -1 : 0;
    PyObject *r = PyObject_CallFunctionObjArgs(maybe_queue, x, lane, NULL);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* ResidencyLedger.unlock_path: drop a ref in `tier` on every node of `path` (a node
   and its ancestors, bottom up; the caller checked none goes below zero). Returns the
   highest node left in no tier and without locks (the caller removes it), or None. */
static PyObject *unlock_nodes(PyObject *path, long tier, PyObject *engine, PyObject *prot, PyObject *maybe_queue) {
    PyObject *doomed = Py_None;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(path); k++) {
        PyObject *x = PyList_GET_ITEM(path, k);
        PyObject *r = PyObject_GetAttr(x, s_lock_ref);
        if (!r) return NULL;
        long v = list_add(r, tier, -1);
        if (v == LONG_MIN) { Py_DECREF(r); return NULL; }
        if (tier == 0) {
            PyObject *dl = get_dict_mut(x, s_device_locks);  /* holds the engine's lock: a dict */
            long c = dl ? dict_add(dl, engine, -1, 0) : LONG_MIN;
            if (c == 0 && PyDict_DelItem(dl, engine) < 0) c = LONG_MIN;
            PyObject *dev = c == 0 ? get_dict(x, s_device) : NULL;
            if (c == LONG_MIN || (c == 0 && !dev)) { Py_XDECREF(dl); Py_DECREF(r); return NULL; }
            if (dev && PyDict_GET_SIZE(dev)) {
                Py_ssize_t n = n_keys(x);
                PyObject *flipped = n < 0 ? NULL : engines_flipped(dev, dl, engine);
                int err = !flipped;
                for (Py_ssize_t q = 0; !err && q < PyList_GET_SIZE(flipped); q++) {
                    PyObject *e = PyList_GET_ITEM(flipped, q);
                    err = dict_add(prot, e, -n, 0) == LONG_MIN || queue_if_new(maybe_queue, x, e) < 0;
                }
                Py_XDECREF(flipped);
                if (err) { Py_DECREF(dev); Py_DECREF(dl); Py_DECREF(r); return NULL; }
            }
            Py_XDECREF(dev);
            Py_DECREF(dl);
        } else if (v == 0) {
            int res = resident_in(x, tier);
            if (res < 0) { Py_DECREF(r); return NULL; }
            if (res) {
                PyObject *lane = tier == 1 ? host_lane : disk_lane;
                Py_ssize_t n = n_keys(x);
                if (n < 0 || dict_add(prot, lane, -n, 0) == LONG_MIN || queue_if_new(maybe_queue, x, lane) < 0) {
                    Py_DECREF(r); return NULL;
                }
            }
        }
        long r0 = PyLong_AsLong(PyList_GET_ITEM(r, 0)), r1 = PyLong_AsLong(PyList_GET_ITEM(r, 1)),
             r2 = PyLong_AsLong(PyList_GET_ITEM(r, 2));
        Py_DECREF(r);
        if (PyErr_Occurred()) return NULL;
        if (r0 || r1 || r2) continue;
        /* no lock left here: the node is removable, or a candidate in each of its lanes
           (TreeNode.lanes(): its engines' devices in dict order, then host, then disk) */
        PyObject *dev = get_dict(x, s_device);
        PyObject *lanes = dev ? PyDict_Keys(dev) : NULL;
        Py_XDECREF(dev);
        if (!lanes) return NULL;
        int on_host = resident_in(x, 1), on_disk = on_host < 0 ? -1 : resident_in(x, 2);
        if (on_disk < 0 || (on_host && PyList_Append(lanes, host_lane) < 0)
                || (on_disk && PyList_Append(lanes, disk_lane) < 0)) { Py_DECREF(lanes); return NULL; }
        if (PyList_GET_SIZE(lanes) == 0) doomed = x;  /* walking up: the last one found is the highest */
        for (Py_ssize_t q = 0; q < PyList_GET_SIZE(lanes); q++) {
            if (queue_if_new(maybe_queue, x, PyList_GET_ITEM(lanes, q)) < 0) { Py_DECREF(lanes); return NULL; }
        }
        Py_DECREF(lanes);
    }
    Py_INCREF(doomed);
    return doomed;
}

/* unlock_path(path, tier, engine, protected, maybe_queue) -> doomed: ResidencyLedger.unlock_path. */
static PyObject *unlock_path(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *path, *engine, *prot, *maybe_queue;
    long tier;
    if (!PyArg_ParseTuple(args, "O!lOO!O", &PyList_Type, &path, &tier, &engine, &PyDict_Type, &prot,
                          &maybe_queue)) return NULL;
    if (check_tier(tier) < 0) return NULL;
    return unlock_nodes(path, tier, engine, prot, maybe_queue);
}

/* unlock_node(node, tier, key, root, protected, maybe_queue): RadixIndex.unlock after its
   argument checks, the path back to `root` walked here. Returns the doomed node or None;
   without changing anything, 1 when `node` is no live node, 2 when it is not under
   `root`, 3 when the unlock would go below zero (the caller raises the error). */
static PyObject *unlock_node(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *node, *key, *root, *prot, *maybe_queue;
    long tier;
    if (!PyArg_ParseTuple(args, "OlOOO!O", &node, &tier, &key, &root, &PyDict_Type, &prot, &maybe_queue)) return NULL;
    if (check_tier(tier) < 0) return NULL;
    int removed = attr_true(node, s_removed);
    Py_ssize_t n = removed ? 0 : n_keys(node);
    if (removed < 0 || n < 0) { PyErr_Clear(); return PyLong_FromLong(1); }  /* no TreeNode */
    if (removed || n == 0) return PyLong_FromLong(1);  /* removed, or a root */
    PyObject *path = PyList_New(0);
    if (!path) return NULL;
    PyObject *x = node;
    Py_INCREF(x);
    while (x != root) {
        if (x == Py_None) { Py_DECREF(x); Py_DECREF(path); return PyLong_FromLong(2); }
        PyObject *parent = PyList_Append(path, x) < 0 ? NULL : PyObject_GetAttr(x, s_parent);
        Py_DECREF(x);
        if (!parent) { Py_DECREF(path); return NULL; }
        x = parent;
    }
    Py_DECREF(x);
    long held;
    if (tier == 0) {
        PyObject *dl = get_dict(node, s_device_locks);
        held = dl ? dict_get(dl, key) : LONG_MIN;
        Py_XDECREF(dl);
    } else {
        PyObject *r = PyObject_GetAttr(node, s_lock_ref);
        held = r && PyList_CheckExact(r) && PyList_GET_SIZE(r) == 3 ? PyLong_AsLong(PyList_GET_ITEM(r, tier)) : LONG_MIN;
        if (r && held == LONG_MIN && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "TreeNode.lock_ref");
        Py_XDECREF(r);
        if (held == -1 && PyErr_Occurred()) held = LONG_MIN;
    }
    if (held == LONG_MIN) { Py_DECREF(path); return NULL; }
    if (held < 1) { Py_DECREF(path); return PyLong_FromLong(3); }  /* ancestors hold at least as many */
    PyObject *doomed = unlock_nodes(path, tier, key, prot, maybe_queue);
    Py_DECREF(path);
    return doomed;
}

static PyMethodDef mod_methods[] = {
    {"walk", walk, METH_VARARGS, "walk(root, blob, lane, seg, now) -> (path, n_dev, n_host, j)"},
    {"lock_path", lock_path, METH_VARARGS, "lock_path(path, tier, engine, protected)"},
    {"unlock_path", unlock_path, METH_VARARGS, "unlock_path(path, tier, engine, protected, maybe_queue) -> doomed"},
    {"lock_segments", lock_segments, METH_VARARGS, "lock_segments(nodes, n_dev, n_host, engine, protected)"},
    {"walk_lock", walk_lock, METH_VARARGS, "walk_lock(root, blob, engine, now, protected) -> (path, n_dev, n_host, j)"},
    {"unlock_node", unlock_node, METH_VARARGS,
     "unlock_node(node, tier, key, root, protected, maybe_queue) -> doomed | None | error code"},
    {NULL}
};
static struct PyModuleDef mod_def = {
    PyModuleDef_HEAD_INIT, .m_name = "hicache.index._native_index", .m_size = -1, .m_methods = mod_methods,
};

HICACHE_BUILD_INFO_SYMBOL;

PyMODINIT_FUNC PyInit__native_index(void) {
    if (!(s_children = PyUnicode_InternFromString("children"))) return NULL;
    if (!(s_device = PyUnicode_InternFromString("device"))) return NULL;
    if (!(s_host = PyUnicode_InternFromString("host"))) return NULL;
    if (!(s_on_disk = PyUnicode_InternFromString("on_disk"))) return NULL;
    if (!(s_keys = PyUnicode_InternFromString("keys"))) return NULL;
    if (!(s_blob = PyUnicode_InternFromString("blob"))) return NULL;
    if (!(s_last_access = PyUnicode_InternFromString("last_access"))) return NULL;
    if (!(s_hit_count = PyUnicode_InternFromString("hit_count"))) return NULL;
    if (!(s_lock_ref = PyUnicode_InternFromString("lock_ref"))) return NULL;
    if (!(s_device_locks = PyUnicode_InternFromString("device_locks"))) return NULL;
    if (!(s_queued = PyUnicode_InternFromString("queued"))) return NULL;
    if (!(s_removed = PyUnicode_InternFromString("removed"))) return NULL;
    if (!(s_parent = PyUnicode_InternFromString("parent"))) return NULL;
    if (!(empty_map = PyDict_New())) return NULL;
    if (!(host_lane = PyLong_FromLong(-1))) return NULL;  /* node.HOST_LANE */
    if (!(disk_lane = PyLong_FromLong(-2))) return NULL;  /* node.DISK_LANE */
    PyObject *m = PyModule_Create(&mod_def);
    if (m && (PyModule_AddFunctions(m, hicache_sketch_methods) < 0  /* native_sketch.c */
              || PyModule_AddFunctions(m, hicache_restore_methods) < 0  /* native_restore.c */
              || hicache_add_key_run(m) < 0)) Py_CLEAR(m);  /* native_keys.c */
    return m;
}
