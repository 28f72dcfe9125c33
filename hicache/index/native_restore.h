/* The restore's record check and chaining (native_restore.c), added to `_native_index` by its init. */
#ifndef HICACHE_NATIVE_RESTORE_H
#define HICACHE_NATIVE_RESTORE_H

#include <Python.h>

extern PyMethodDef hicache_restore_methods[];

#endif
