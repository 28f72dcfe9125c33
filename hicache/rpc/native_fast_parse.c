/* The fast path's request parser (native_fast_parse.h): reads every match or release frame
   a peer sends, other tenants' engines included, so it trusts no length and reads nothing
   past the frame (tests/native/fuzz_frames.c fuzzes it under the sanitizers). */
#include "hicache/rpc/native_fast_parse.h"

#include <string.h>

typedef struct { const unsigned char *p, *end; } rd_t;

static int rd_uint(rd_t *r, unsigned long long *v) {
    if (r->p >= r->end) return -1;
    unsigned char t = *r->p++;
    int w;
    if (t < 0x80) { *v = t; return 0; }
    if (t == 0xcc) w = 1; else if (t == 0xcd) w = 2; else if (t == 0xce) w = 4; else if (t == 0xcf) w = 8;
    else return -1;  /* negative, float, anything else: the Python path */
    if (r->end - r->p < w) return -1;
    unsigned long long x = 0;
    for (int i = 0; i < w; i++) x = (x << 8) | r->p[i];
    r->p += w;
    *v = x;
    return 0;
}

/* A fixstr; returns its length and sets *s, or -1. */
static int rd_fixstr(rd_t *r, const char **s) {
    if (r->p >= r->end || (*r->p & 0xe0) != 0xa0) return -1;
    int n = *r->p++ & 0x1f;
    if (r->end - r->p < n) return -1;
    *s = (const char *)r->p;
    r->p += n;
    return n;
}

static int str_is(const char *s, int n, const char *lit) { return (int)strlen(lit) == n && !memcmp(s, lit, n); }

static int rd_bin(rd_t *r, const char **s, uint32_t *n) {
    if (r->p >= r->end) return -1;
    unsigned char t = *r->p++;
    int w = t == 0xc4 ? 1 : t == 0xc5 ? 2 : t == 0xc6 ? 4 : 0;
    if (!w || r->end - r->p < w) return -1;
    uint32_t x = 0;
    for (int i = 0; i < w; i++) x = (x << 8) | r->p[i];
    r->p += w;
    if ((uint32_t)(r->end - r->p) < x) return -1;
    *s = (const char *)r->p;
    *n = x;
    r->p += x;
    return 0;
}

static int rd_params(rd_t *r, int kind, fast_req_t *q) {
    if (r->p >= r->end || (*r->p & 0xf0) != 0x80) return -1;
    int n = *r->p++ & 0x0f, got_engine = 0, got_keys = 0, got_pin = 0;
    if (n != (kind == FAST_MATCH ? 2 : 1)) return -1;
    for (int i = 0; i < n; i++) {
        const char *k;
        int kn = rd_fixstr(r, &k);
        if (kn < 0) return -1;
        if (kind == FAST_MATCH && !got_engine && str_is(k, kn, "engine")) {
            if (rd_uint(r, &q->arg)) return -1;
            got_engine = 1;
        } else if (kind == FAST_MATCH && !got_keys && str_is(k, kn, "keys")) {
            if (rd_bin(r, &q->blob, &q->blob_len)) return -1;
            got_keys = 1;
        } else if (kind == FAST_RELEASE && !got_pin && str_is(k, kn, "pin")) {
            if (rd_uint(r, &q->arg)) return -1;
            got_pin = 1;
        } else return -1;
    }
    return 0;
}

/* The request in `body`, or FAST_NONE for anything the Python path must see. Params are
   read after the whole map is seen: "params" may come before "method". */
int fast_parse(const char *body, uint32_t len, fast_req_t *q) {
    rd_t r = {(const unsigned char *)body, (const unsigned char *)body + len};
    memset(q, 0, sizeof *q);
    if (r.p >= r.end) return FAST_NONE;
    unsigned char h = *r.p++;
    if (h != 0x83 && h != 0x84) return FAST_NONE;
    int got_id = 0, got_noreply = 0, kind = FAST_NONE;
    rd_t params = {NULL, NULL};
    for (int i = 0; i < (h & 0x0f); i++) {
        const char *k;
        int kn = rd_fixstr(&r, &k);
        if (kn < 0) return FAST_NONE;
        if (!got_id && str_is(k, kn, "id")) {
            if (rd_uint(&r, &q->id)) return FAST_NONE;
            got_id = 1;
        } else if (kind == FAST_NONE && str_is(k, kn, "method")) {
            const char *m;
            int mn = rd_fixstr(&r, &m);
            if (mn < 0) return FAST_NONE;
            kind = str_is(m, mn, "match") ? FAST_MATCH : str_is(m, mn, "release") ? FAST_RELEASE : -1;
            if (kind < 0) return FAST_NONE;
        } else if (!params.p && str_is(k, kn, "params")) {
            params.p = r.p;  /* skipped for now: a fixmap of at most 2 entries, checked below */
            if (r.p >= r.end || (*r.p & 0xf0) != 0x80) return FAST_NONE;
            int pn = *r.p++ & 0x0f;
            for (int j = 0; j < pn; j++) {
                const char *pk, *pv;
                uint32_t pvn;
                unsigned long long x;
                if (rd_fixstr(&r, &pk) < 0) return FAST_NONE;
                if (r.p < r.end && (*r.p == 0xc4 || *r.p == 0xc5 || *r.p == 0xc6)) {
                    if (rd_bin(&r, &pv, &pvn)) return FAST_NONE;
                } else if (rd_uint(&r, &x)) return FAST_NONE;
            }
            params.end = r.p;
        } else if (!got_noreply && str_is(k, kn, "noreply")) {
            if (r.p >= r.end || (*r.p != 0xc3 && *r.p != 0xc2)) return FAST_NONE;
            q->quiet = *r.p++ == 0xc3;
            got_noreply = 1;
        } else return FAST_NONE;
    }
    if (r.p != r.end || !got_id || kind == FAST_NONE || !params.p) return FAST_NONE;
    if ((h == 0x84) != got_noreply) return FAST_NONE;
    if (rd_params(&params, kind, q) || params.p != params.end) return FAST_NONE;
    q->kind = kind;
    return kind;
}
