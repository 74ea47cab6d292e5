/*
 * kds_le.h - little-endian integer fields of kdaserve's stored byte formats
 * (sequence state, snapshot records). Byte by byte, so they work on any
 * host and at any alignment. Dependency-free like kds_status.h.
 */
#ifndef KDS_LE_H
#define KDS_LE_H

#include <stdint.h>

static inline void kds_put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static inline void kds_put64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static inline uint32_t kds_get32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static inline uint64_t kds_get64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

#endif
