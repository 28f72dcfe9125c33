/* A fuzzer for what a peer's bytes go through first in the daemon's native frame loop: the
   frame splitter (hicache/rpc/native_frames.h) and the fast path's request parser
   (hicache/rpc/native_fast_parse.c). The wire fuzzer (tests/robustness/test_wire_fuzz.py)
   sends hostile frames to a live daemon; this one calls the C directly, millions of inputs
   a minute, and checks what the sanitizers cannot see in the daemon:

   - each frame body is parsed from an allocation of exactly its size, so a read one byte
     past the frame is an AddressSanitizer error (in the daemon the next frame's bytes, or
     the buffer's spare room, follow the body and hide it);
   - the frames split from a stream delivered in random pieces are the ones an independent
     splitter finds in the whole stream, and a length over the cap breaks the stream at the
     same frame;
   - a parsed request points only inside its frame, and parsing is deterministic.

   One input is a byte stream as a connection receives it; its first byte seeds how it is
   cut into receives. Built two ways:
   - `clang -fsanitize=fuzzer,address,undefined -DHICACHE_LIBFUZZER -I. tests/native/fuzz_frames.c
     hicache/rpc/native_fast_parse.c`: libFuzzer drives LLVMFuzzerTestOneInput;
   - otherwise (gcc, tests/native/test_fuzz_frames.py): main(iterations, seed) mutates streams of
     valid match and release frames (the client's own shapes) and fails unless the parser both
     accepted and refused some of them. Any failed check aborts with the input in hex.
*/
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hicache/rpc/native_fast_parse.h"
#include "hicache/rpc/native_frames.h"

#define MAX_FRAME 4096u /* the cap next_frame enforces: small, so fuzzed lengths cross it */

static unsigned long long counts[5]; /* frames, match, release, refused, over the cap */

static uint32_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (uint32_t)(*s >> 16);
}

static void fail(const char *what, const uint8_t *data, size_t size) {
    fprintf(stderr, "fuzz_frames: %s; input (%zu bytes):\n", what, size);
    for (size_t i = 0; i < size; i++) fprintf(stderr, "%02x", data[i]);
    fprintf(stderr, "\n");
    abort();
}

/* Parse one body from an exact-size copy and check the request stays inside it. */
static void check_body(const char *body, uint32_t n, const uint8_t *data, size_t size) {
    char *copy = malloc(n ? n : 1);
    if (!copy) abort();
    memcpy(copy, body, n);
    fast_req_t q, again;
    int kind = fast_parse(copy, n, &q);
    counts[0]++;
    if (kind == FAST_NONE) {
        counts[3]++;
    } else if (kind != q.kind || (kind != FAST_MATCH && kind != FAST_RELEASE) || (q.quiet != 0 && q.quiet != 1)) {
        fail("fast_parse returned an inconsistent request", data, size);
    } else if (kind == FAST_MATCH) {
        counts[1]++;
        if (!q.blob || q.blob < copy || q.blob_len > n || q.blob - copy > (long)(n - q.blob_len))
            fail("a match's keys point outside its frame", data, size);
    } else {
        counts[2]++;
        if (q.blob || q.blob_len) fail("a release carries keys", data, size);
    }
    if (fast_parse(copy, n, &again) != kind || (kind != FAST_NONE && memcmp(&q, &again, sizeof q)))
        fail("fast_parse is not deterministic", data, size);
    free(copy);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint64_t cut = 0x9e3779b97f4a7c15ULL ^ data[0];
    const uint8_t *stream = data + 1;
    size_t len = size - 1, fed = 0, split = 0; /* split: where the independent splitter is */
    buf_t in = {0};
    int broken = 0;
    while (!broken && fed < len) {
        size_t piece = 1 + rng_next(&cut) % 700; /* one recv's worth */
        if (piece > len - fed) piece = len - fed;
        if (buf_room(&in, piece)) abort();
        memcpy(in.p + in.end, stream + fed, piece);
        in.end += piece;
        fed += piece;
        const char *body;
        uint32_t n;
        int r;
        while ((r = next_frame(&in, MAX_FRAME, &body, &n)) == 1) {
            /* the independent splitter: the same frame from the whole stream */
            if (len - split < 4) fail("next_frame found a frame past the stream's end", data, size);
            uint32_t want = be32((const char *)stream + split);
            if (want != n || len - split - 4 < n || memcmp(body, stream + split + 4, n))
                fail("next_frame split a frame the stream does not hold", data, size);
            split += 4 + (size_t)n;
            check_body(body, n, data, size);
        }
        if (r < 0) {
            if (len - split < 4 || be32((const char *)stream + split) <= MAX_FRAME)
                fail("next_frame refused a length within the cap", data, size);
            counts[4]++;
            broken = 1;
        }
    }
    /* whatever is left unsplit is a partial frame: under 4 bytes, or a body not all here */
    if (!broken && len - split >= 4 && be32((const char *)stream + split) <= MAX_FRAME
            && len - split - 4 >= be32((const char *)stream + split))
        fail("a whole frame was left unsplit", data, size);
    buf_free(&in);
    return 0;
}

#ifndef HICACHE_LIBFUZZER
/* -- the driver without libFuzzer: seeded mutations of the client's own frames -------------- */
typedef struct { uint8_t *p; size_t n, cap; } bytes_t;

static void put(bytes_t *b, const void *data, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2;
        if (!(b->p = realloc(b->p, b->cap))) abort();
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
}
static void put_byte(bytes_t *b, uint8_t x) { put(b, &x, 1); }
static void put_str(bytes_t *b, const char *s) { put_byte(b, (uint8_t)(0xa0 | strlen(s))); put(b, s, strlen(s)); }
static void put_be(bytes_t *b, unsigned long long x, int w) {
    for (int i = w - 1; i >= 0; i--) put_byte(b, (uint8_t)(x >> (8 * i)));
}
static void put_uint(bytes_t *b, unsigned long long x) { /* msgpack-python's smallest format */
    if (x < 0x80) put_byte(b, (uint8_t)x);
    else if (x < 0x100) { put_byte(b, 0xcc); put_be(b, x, 1); }
    else if (x < 0x10000) { put_byte(b, 0xcd); put_be(b, x, 2); }
    else if (x < 0x100000000ULL) { put_byte(b, 0xce); put_be(b, x, 4); }
    else { put_byte(b, 0xcf); put_be(b, x, 8); }
}

/* One valid frame, as the client writes it: match {"engine", "keys"} or release {"pin"},
   with or without "noreply", the keys in any order the parser accepts. */
static void valid_frame(bytes_t *out, uint64_t *s) {
    bytes_t body = {0};
    int match = rng_next(s) & 1, noreply = rng_next(s) % 4 == 0, order = rng_next(s) % 3;
    unsigned long long id = rng_next(s) % 3 ? rng_next(s) % 300 : ((unsigned long long)rng_next(s) << 32) | rng_next(s);
    put_byte(&body, noreply ? 0x84 : 0x83);
    for (int k = 0; k < 3; k++) {
        int which = (k + order) % 3;
        if (which == 0) { put_str(&body, "id"); put_uint(&body, id); }
        if (which == 1) { put_str(&body, "method"); put_str(&body, match ? "match" : "release"); }
        if (which == 2) {
            put_str(&body, "params");
            if (match) {
                uint32_t keys = 16 * (rng_next(s) % 24);
                put_byte(&body, 0x82);
                put_str(&body, "engine");
                put_uint(&body, rng_next(s) % 5 ? rng_next(s) % 8 : rng_next(s));
                put_str(&body, "keys");
                int w = keys < 0x100 && rng_next(s) % 2 ? 1 : rng_next(s) % 2 ? 2 : 4; /* bin8 / bin16 / bin32 */
                put_byte(&body, w == 1 ? 0xc4 : w == 2 ? 0xc5 : 0xc6);
                put_be(&body, keys, w);
                for (uint32_t i = 0; i < keys; i++) put_byte(&body, (uint8_t)rng_next(s));
            } else {
                put_byte(&body, 0x81);
                put_str(&body, "pin");
                put_uint(&body, rng_next(s) % 1000);
            }
        }
    }
    if (noreply) { put_str(&body, "noreply"); put_byte(&body, rng_next(s) % 2 ? 0xc3 : 0xc2); }
    put_be(out, body.n, 4);
    put(out, body.p, body.n);
    free(body.p);
}

static const uint8_t INTERESTING[] = {0x00, 0x01, 0x7f, 0x80, 0x81, 0x82, 0x83, 0x84, 0x8f, 0xa0, 0xbf, 0xc2,
                                      0xc3, 0xc4, 0xc5, 0xc6, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xff};

static void mutate(bytes_t *b, uint64_t *s) {
    if (!b->n) return;
    size_t at = rng_next(s) % b->n;
    switch (rng_next(s) % 7) {
    case 0: b->p[at] ^= (uint8_t)(1u << (rng_next(s) % 8)); break;
    case 1: b->p[at] = INTERESTING[rng_next(s) % sizeof INTERESTING]; break;
    case 2: b->p[at] = (uint8_t)rng_next(s); break;
    case 3: memmove(b->p + at, b->p + at + 1, b->n - at - 1); b->n--; break; /* delete */
    case 4: put_byte(b, 0); memmove(b->p + at + 1, b->p + at, b->n - at - 1); b->p[at] = (uint8_t)rng_next(s); break;
    case 5: b->n = at; break; /* truncate */
    default: { /* a length prefix (of the first frame, or anywhere) that lies by a little or a lot */
        size_t where = rng_next(s) % 2 ? 1 : at; /* byte 0 of the input seeds the cuts */
        if (where + 4 > b->n) break;
        uint32_t v = be32((const char *)b->p + where), d = rng_next(s) % 4;
        v = d == 0 ? v + 1 : d == 1 ? v - 1 : d == 2 ? MAX_FRAME + (rng_next(s) % 2) : rng_next(s);
        b->p[where] = (uint8_t)(v >> 24); b->p[where + 1] = (uint8_t)(v >> 16);
        b->p[where + 2] = (uint8_t)(v >> 8); b->p[where + 3] = (uint8_t)v;
    }
    }
}

int main(int argc, char **argv) {
    unsigned long long iterations = argc > 1 ? strtoull(argv[1], NULL, 10) : 100000;
    uint64_t s = argc > 2 ? strtoull(argv[2], NULL, 10) * 2654435761ULL + 1 : 1405;
    bytes_t in = {0};
    for (unsigned long long it = 0; it < iterations; it++) {
        in.n = 0;
        put_byte(&in, (uint8_t)rng_next(&s));
        int frames = 1 + rng_next(&s) % 4;
        for (int f = 0; f < frames; f++) valid_frame(&in, &s);
        int mutations = it % 8 == 0 ? 0 : 1 + rng_next(&s) % 6; /* some inputs stay valid */
        for (int m = 0; m < mutations; m++) mutate(&in, &s);
        LLVMFuzzerTestOneInput(in.p, in.n);
    }
    free(in.p);
    printf("fuzz_frames: %llu inputs, %llu frames: %llu match, %llu release, %llu refused; %llu over the cap\n",
           iterations, counts[0], counts[1], counts[2], counts[3], counts[4]);
    if (iterations >= 1000 && !(counts[1] && counts[2] && counts[3] && counts[4])) {
        fprintf(stderr, "fuzz_frames: the inputs did not reach every outcome\n");
        return 1;
    }
    return 0;
}
#endif
