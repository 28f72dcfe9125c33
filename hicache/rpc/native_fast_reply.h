/* The native frame loop's fast path, the reply side (native_fast_reply.c): the answers to the
   requests native_fast_parse.h reads, appended to a connection's output buffer as whole frames.
   Each returns 0, or -1: fast_encode_match with a Python exception set, fast_encode_true only
   when out of memory (and none set). */
#ifndef HICACHE_NATIVE_FAST_REPLY_H
#define HICACHE_NATIVE_FAST_REPLY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "hicache/rpc/native_frames.h"

/* {"id": id, "result": True} */
int fast_encode_true(buf_t *out, unsigned long long id);

/* {"id": id, "result": {"pin", "device_pages", "host_pages", "disk_len", "slabs"}} from the fast
   handler's (pin, device_pages, host_pages, disk_len, slabs). */
int fast_encode_match(buf_t *out, unsigned long long id, PyObject *res);

#endif
