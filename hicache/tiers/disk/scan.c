/* The disk tier's start-up scans in C (hicache/tiers/disk/scan.py calls them with ctypes, in the
   `_native` library beside the put loop, reaching py-lmdb's bundled LMDB through the
   function pointers the Python side passes in, as native.c does):

   - hicache_disk_scan_meta: every record of the `meta` database from a key on (or the first),
     unpacked into the caller's arrays: key, parent (the salt for a sequence's first page),
     salt, last access, the tokens appended to one int32 array (tok_end: where each record's
     end). Records disk_format.unpack_record refuses (a key that is not 16 bytes, a value
     whose length is not the header's plus its tokens') are skipped and counted. Stops before
     a record that would overflow the arrays and hands back its key to resume from.
   - hicache_disk_count_keys: walks every key of a database, reading every value's bytes
     too if asked (the verification child reads every meta record and every page key, so
     that a damaged map kills it rather than the daemon: hicache/tiers/disk/env.py).

   Why: read from Python, a million records took ~2 s to scan and ~1 s to verify
   (docs/benchmarks.md, "A million pages"); here each is a tenth of that. */
#include <stdint.h>
#include <string.h>

typedef struct { size_t size; void *data; } hc_mdb_val;  /* MDB_val */
typedef int (*hc_cursor_open_fn)(void *txn, unsigned dbi, void **cursor);
typedef int (*hc_cursor_get_fn)(void *cursor, hc_mdb_val *key, hc_mdb_val *data, int op);
typedef void (*hc_cursor_close_fn)(void *cursor);

#define HC_FIRST 0
#define HC_NEXT 8
#define HC_SET_RANGE 17
#define HC_NOTFOUND (-30798)
#define HC_KEY 16
#define HC_HEADER 72        /* disk_format.META_HEADER: parent, salt, size, 2 checksums, last access, ... */
#define HC_OFF_SALT 16
#define HC_OFF_LAST 56
#define HC_OFF_NTOK 64
#define HC_OFF_FLAGS 70
#define HC_HAS_PARENT 1
#define HC_MAX_KEY 511      /* LMDB's default key size limit */

/* out: [0] records written, [1] tokens written, [2] malformed records skipped, [3] 1 when the
   database's end was reached, [4] the length of the key in `resume` (the record to start
   from next, when [3] is 0). Returns 0 or LMDB's error code. */
__attribute__((visibility("default")))
int hicache_disk_scan_meta(void *open_fn, void *get_fn, void *close_fn, void *txn, unsigned dbi,
                           const uint8_t *start, int64_t start_len, int64_t cap, int64_t tok_cap,
                           uint8_t *keys, uint8_t *parents, uint8_t *salts, double *last_access,
                           int64_t *tok_end, int32_t *tokens, uint8_t *resume, int64_t *out) {
    hc_cursor_get_fn get = (hc_cursor_get_fn)get_fn;
    void *cur = NULL;
    int rc = ((hc_cursor_open_fn)open_fn)(txn, dbi, &cur);
    int64_t n = 0, nt = 0, bad = 0, done = 0, resume_len = 0;
    if (rc) return rc;
    hc_mdb_val k = {0, NULL}, v = {0, NULL};
    if (start && start_len > 0) {
        k.size = (size_t)start_len;
        k.data = (void *)start;
        rc = get(cur, &k, &v, HC_SET_RANGE);
    } else {
        rc = get(cur, &k, &v, HC_FIRST);
    }
    for (; rc == 0; rc = get(cur, &k, &v, HC_NEXT)) {
        const uint8_t *val = v.data;
        uint32_t n_tok = 0;
        uint16_t flags = 0;
        if (v.size >= HC_HEADER) {
            memcpy(&n_tok, val + HC_OFF_NTOK, sizeof n_tok);
            memcpy(&flags, val + HC_OFF_FLAGS, sizeof flags);
        }
        if (k.size != HC_KEY || v.size < HC_HEADER || v.size != HC_HEADER + 4 * (size_t)n_tok) {
            bad++;
            continue;
        }
        if (n == cap || nt + n_tok > tok_cap) {  /* full: resume from this record */
            resume_len = (int64_t)k.size;
            memcpy(resume, k.data, k.size);
            break;
        }
        memcpy(keys + n * HC_KEY, k.data, HC_KEY);
        memcpy(salts + n * HC_KEY, val + HC_OFF_SALT, HC_KEY);
        memcpy(parents + n * HC_KEY, flags & HC_HAS_PARENT ? val : val + HC_OFF_SALT, HC_KEY);
        memcpy(last_access + n, val + HC_OFF_LAST, sizeof(double));
        memcpy(tokens + nt, val + HC_HEADER, 4 * (size_t)n_tok);
        nt += n_tok;
        tok_end[n++] = nt;
    }
    if (rc == HC_NOTFOUND) {
        rc = 0;
        done = 1;
    }
    ((hc_cursor_close_fn)close_fn)(cur);
    out[0] = n;
    out[1] = nt;
    out[2] = bad;
    out[3] = done;
    out[4] = resume_len;
    return rc;
}

/* *count = the keys of database `dbi`, *fold = the XOR of every value byte when
   `read_values` (else 0: only the keys and the values' first page references are read).
   Returns 0 or LMDB's error code. */
__attribute__((visibility("default")))
int hicache_disk_count_keys(void *open_fn, void *get_fn, void *close_fn, void *txn, unsigned dbi, int read_values,
                            int64_t *count, uint64_t *fold) {
    hc_cursor_get_fn get = (hc_cursor_get_fn)get_fn;
    void *cur = NULL;
    int rc = ((hc_cursor_open_fn)open_fn)(txn, dbi, &cur);
    if (rc) return rc;
    hc_mdb_val k = {0, NULL}, v = {0, NULL};
    int64_t n = 0;
    uint8_t x = 0;
    for (rc = get(cur, &k, &v, HC_FIRST); rc == 0; rc = get(cur, &k, &v, HC_NEXT)) {
        n++;
        if (read_values) {
            const uint8_t *p = v.data;
            for (size_t i = 0; i < v.size; i++) x ^= p[i];
        }
    }
    ((hc_cursor_close_fn)close_fn)(cur);
    *count = n;
    *fold = x;
    return rc == HC_NOTFOUND ? 0 : rc;
}
