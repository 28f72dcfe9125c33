/* hicache's framing in C, shared by the daemon's native frame loop (native_conn.c) and the
   bench's echo servers (hicache/bench/rpc/native_echo.c): byte buffers, one non-blocking recv, a
   flush, and splitting whole frames (a 4-byte big-endian length, then the body; the Python
   side of the same format is hicache/rpc/framing.py). Plain C, no Python: the frame splitter
   is what every byte a peer sends goes through (tests/native/fuzz_frames.c fuzzes it). */
#ifndef HICACHE_NATIVE_FRAMES_H
#define HICACHE_NATIVE_FRAMES_H

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define RECV_CHUNK 65536

enum { IO_OK = 0, IO_PENDING = 1, IO_CLOSED = -1, IO_RAISED = -2 };

/* A byte buffer: [start, end) holds data, room after end. */
typedef struct { char *p; size_t start, end, cap; } buf_t;

static inline int buf_room(buf_t *b, size_t want) {
    if (b->start == b->end) b->start = b->end = 0;
    if (b->cap - b->end >= want) return 0;
    if (b->start) {
        memmove(b->p, b->p + b->start, b->end - b->start);
        b->end -= b->start;
        b->start = 0;
        if (b->cap - b->end >= want) return 0;
    }
    size_t cap = b->cap ? b->cap : RECV_CHUNK;
    while (cap - b->end < want) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline void buf_free(buf_t *b) { free(b->p); memset(b, 0, sizeof *b); }

static inline int buf_put(buf_t *b, const char *data, size_t n) {
    if (buf_room(b, n)) return -1;
    memcpy(b->p + b->end, data, n);
    b->end += n;
    return 0;
}

static inline int buf_put_frame(buf_t *b, const char *body, size_t n) {
    if (n > UINT32_MAX || buf_room(b, n + 4)) return -1;
    unsigned char *h = (unsigned char *)b->p + b->end;
    h[0] = (unsigned char)(n >> 24); h[1] = (unsigned char)(n >> 16);
    h[2] = (unsigned char)(n >> 8); h[3] = (unsigned char)n;
    memcpy(b->p + b->end + 4, body, n);
    b->end += n + 4;
    return 0;
}

static inline uint32_t be32(const char *p) {
    const unsigned char *h = (const unsigned char *)p;
    return ((uint32_t)h[0] << 24) | ((uint32_t)h[1] << 16) | ((uint32_t)h[2] << 8) | h[3];
}

/* One recv (level-triggered: the loop calls again while bytes remain), with room for
   the whole frame being assembled when its length is within `max` (a length over it
   reserves nothing: next_frame breaks the stream). IO_CLOSED on end of stream, error,
   or no memory; *err is the errno (0 at end of stream). */
static inline int conn_recv(int fd, buf_t *in, uint32_t max, int *err) {
    size_t want = RECV_CHUNK, have = in->end - in->start;
    *err = 0;
    if (have >= 4) {
        size_t need = (size_t)be32(in->p + in->start) + 4;
        if (need <= (size_t)max + 4 && need > have && need - have > want) want = need - have;
    }
    if (buf_room(in, want)) { *err = ENOMEM; return IO_CLOSED; }
    for (;;) {
        ssize_t k = recv(fd, in->p + in->end, in->cap - in->end, 0);
        if (k > 0) { in->end += (size_t)k; return IO_OK; }
        if (k == 0) return IO_CLOSED;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return IO_OK;
        *err = errno;
        return IO_CLOSED;
    }
}

static inline int conn_flush(int fd, buf_t *out) {
    while (out->start < out->end) {
        ssize_t k = send(fd, out->p + out->start, out->end - out->start, MSG_NOSIGNAL);
        if (k >= 0) { out->start += (size_t)k; continue; }
        if (errno == EINTR) continue;
        return errno == EAGAIN || errno == EWOULDBLOCK ? IO_PENDING : IO_CLOSED;
    }
    out->start = out->end = 0;
    return IO_OK;
}

/* The next whole frame's body, consumed from `in`: 1; 0 if none yet; -1 if its
   length exceeds the cap (the stream is broken, as in the daemon). */
static inline int next_frame(buf_t *in, uint32_t max, const char **body, uint32_t *n) {
    size_t have = in->end - in->start;
    if (have < 4) return 0;
    uint32_t len = be32(in->p + in->start);
    if (len > max) return -1;
    if (have - 4 < len) return 0;
    *body = in->p + in->start + 4;
    *n = len;
    in->start += 4 + (size_t)len;
    return 1;
}

#endif
