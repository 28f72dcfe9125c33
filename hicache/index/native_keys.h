/* KeyRun (native_keys.c): the type, added to `_native_index` by its init, and its keys for the walk. */
#ifndef HICACHE_NATIVE_KEYS_H
#define HICACHE_NATIVE_KEYS_H

#include <Python.h>

int hicache_add_key_run(PyObject *module);

/* The packed keys of a KeyRun and their count in *n; NULL when `o` is no KeyRun. */
const char *hicache_key_run_data(PyObject *o, Py_ssize_t *n);

#endif
