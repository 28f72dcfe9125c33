/* The frequency sketch's functions (native_sketch.c), added to `_native_index` by its init. */
#ifndef HICACHE_NATIVE_SKETCH_H
#define HICACHE_NATIVE_SKETCH_H

#include <Python.h>

extern PyMethodDef hicache_sketch_methods[];

#endif
