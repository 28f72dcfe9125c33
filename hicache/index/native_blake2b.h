/* BLAKE2b (RFC 7693), unkeyed, for the page keys of hicache/index/keys.py: a key is the
   16-byte BLAKE2b digest of (parent key or namespace salt || the page's tokens as int32
   little-endian). native_restore.c checks restored records with it; tests compare it with
   hashlib's on random inputs. Header-only: one user. */
#ifndef HICACHE_NATIVE_BLAKE2B_H
#define HICACHE_NATIVE_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t h[8], t;  /* state, bytes compressed so far (inputs here stay far below 2**64) */
    uint8_t buf[128];
    size_t fill;
    size_t outlen;
} hc_blake2b;

static const uint64_t hc_blake2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t hc_blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static uint64_t hc_load64(const uint8_t *p) {  /* little-endian */
    uint64_t v = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(&v, p, sizeof v);
#else
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
#endif
    return v;
}

static uint64_t hc_rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define HC_G(a, b, c, d, x, y)                          \
    do {                                                \
        v[a] = v[a] + v[b] + (x); v[d] = hc_rotr64(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];       v[b] = hc_rotr64(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y); v[d] = hc_rotr64(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];       v[b] = hc_rotr64(v[b] ^ v[c], 63); \
    } while (0)

static void hc_blake2b_compress(hc_blake2b *s, const uint8_t *block, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = hc_load64(block + 8 * i);
    for (int i = 0; i < 8; i++) { v[i] = s->h[i]; v[i + 8] = hc_blake2b_iv[i]; }
    v[12] ^= s->t;  /* the counter's high word stays 0 */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *sg = hc_blake2b_sigma[r];
        HC_G(0, 4, 8, 12, m[sg[0]], m[sg[1]]);
        HC_G(1, 5, 9, 13, m[sg[2]], m[sg[3]]);
        HC_G(2, 6, 10, 14, m[sg[4]], m[sg[5]]);
        HC_G(3, 7, 11, 15, m[sg[6]], m[sg[7]]);
        HC_G(0, 5, 10, 15, m[sg[8]], m[sg[9]]);
        HC_G(1, 6, 11, 12, m[sg[10]], m[sg[11]]);
        HC_G(2, 7, 8, 13, m[sg[12]], m[sg[13]]);
        HC_G(3, 4, 9, 14, m[sg[14]], m[sg[15]]);
    }
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

static void hc_blake2b_init(hc_blake2b *s, size_t outlen) {
    for (int i = 0; i < 8; i++) s->h[i] = hc_blake2b_iv[i];
    s->h[0] ^= 0x01010000ULL ^ (uint64_t)outlen;  /* depth 1, fanout 1, no key */
    s->t = 0;
    s->fill = 0;
    s->outlen = outlen;
}

static void hc_blake2b_update(hc_blake2b *s, const uint8_t *in, size_t len) {
    while (len) {
        if (s->fill == 128) {  /* a full block is compressed only once more input follows */
            s->t += 128;
            hc_blake2b_compress(s, s->buf, 0);
            s->fill = 0;
        }
        size_t take = 128 - s->fill < len ? 128 - s->fill : len;
        memcpy(s->buf + s->fill, in, take);
        s->fill += take;
        in += take;
        len -= take;
    }
}

static void hc_blake2b_final(hc_blake2b *s, uint8_t *out) {
    s->t += s->fill;
    memset(s->buf + s->fill, 0, 128 - s->fill);
    hc_blake2b_compress(s, s->buf, 1);
    for (size_t i = 0; i < s->outlen; i++) out[i] = (uint8_t)(s->h[i / 8] >> (8 * (i % 8)));
}

#undef HC_G

#endif
