/* The native frame loop's fast path, the request side: `match` and `release` frames read
   without msgpack's Python objects (native_fast_parse.c). Plain C, no Python.

   `fast_parse` recognises one request shape only, the one the client sends (BlobRequest
   and `post`): a fixmap of "id" (an int >= 0), "method" ("match" or "release"), "params"
   and optionally "noreply" (true or false), each key once, in any order, and nothing after
   the map; params a fixmap of exactly {"engine": int >= 0, "keys": bin} (match) or {"pin":
   int >= 0} (release). Anything else, however valid, takes the Python path unchanged
   (`Connection._handle`): C never answers what it did not fully understand. */
#ifndef HICACHE_NATIVE_FAST_PARSE_H
#define HICACHE_NATIVE_FAST_PARSE_H

#include <stdint.h>

enum { FAST_NONE = 0, FAST_MATCH = 1, FAST_RELEASE = 2 };

typedef struct {
    int kind;
    int quiet;                 /* noreply: true */
    unsigned long long id, arg;  /* the request id; the engine (match) or pin (release) */
    const char *blob;          /* match: the keys, inside the frame's body */
    uint32_t blob_len;
} fast_req_t;

/* The request in the frame body [body, body + len): its kind (FAST_MATCH, FAST_RELEASE) with
   *q filled in, or FAST_NONE for anything the Python path must see. */
int fast_parse(const char *body, uint32_t len, fast_req_t *q);

#endif
