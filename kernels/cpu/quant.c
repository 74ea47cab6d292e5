/*
 * quant.c - weight formats (kern.h): the byte layout of every format, the
 * values of the block formats (MXFP4, Q8_0), and the CPU reference product
 * over a weight of any format.
 *
 * The block-format product dequantises blocks of rows into f32 and hands
 * them to kern_matmul's f32 path: it is the reference the fast kernels (the
 * K3 and quantisation work) are checked against, not the fast path itself.
 */
#include "kern.h"

#include <math.h>
#include <string.h>

int kern_dtype_is_block(kern_dtype dt) { return dt == KERN_MXFP4 || dt == KERN_Q8_0; }

const char *kern_dtype_name(kern_dtype dt) {
    switch (dt) {
    case KERN_F32: return "f32";
    case KERN_BF16: return "bf16";
    case KERN_F16: return "f16";
    case KERN_MXFP4: return "mxfp4";
    case KERN_Q8_0: return "q8_0";
    }
    return "?";
}

kern_layout kern_weight_layout(kern_dtype dt, int64_t rows, int64_t cols) {
    kern_layout l = {0, 0, 0, 0, 0};
    if (rows < 0 || cols < 0) return l;
    switch (dt) {
    case KERN_F32:
    case KERN_BF16:
    case KERN_F16: l.row_bytes = (size_t)cols * kern_dtype_size(dt); break;
    case KERN_MXFP4:
        if (cols % KERN_BLOCK) return l;
        l.row_bytes = (size_t)cols / 2;                    /* two codes per byte */
        l.scale_row_bytes = (size_t)(cols / KERN_BLOCK);   /* one E8M0 byte per block */
        break;
    case KERN_Q8_0:
        if (cols % KERN_BLOCK) return l;
        l.row_bytes = (size_t)cols;                        /* one int8 per value */
        l.scale_row_bytes = (size_t)(cols / KERN_BLOCK) * 2; /* one f16 per block */
        break;
    default: return l;
    }
    l.data_bytes = l.row_bytes * (size_t)rows;
    l.scale_bytes = l.scale_row_bytes * (size_t)rows;
    l.bytes = l.data_bytes + l.scale_bytes;
    return l;
}

float kern_e2m1_to_f32(unsigned code) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float v = mag[code & 7u];
    return code & 8u ? -v : v;
}

float kern_e8m0_to_f32(uint8_t e) {
    if (e == 255) return NAN;
    return ldexpf(1.0f, (int)e - 127); /* exact: every 2^k, k in [-127, 127], is a float */
}

void kern_weight_row_f32(const kern_weight *w, int r, int c0, int c1, float *out) {
    const kern_layout l = kern_weight_layout(w->dt, w->rows, w->cols);
    const unsigned char *row = (const unsigned char *)w->data + (size_t)r * l.row_bytes;
    /* element formats have no scales (NULL): no arithmetic on that pointer,
     * which is undefined even with a zero offset */
    const unsigned char *sc =
        w->scales ? (const unsigned char *)w->scales + (size_t)r * l.scale_row_bytes : NULL;
    switch (w->dt) {
    case KERN_F32:
    case KERN_BF16:
    case KERN_F16:
        kern_to_f32(w->dt, row + (size_t)c0 * kern_dtype_size(w->dt), out, (size_t)(c1 - c0));
        return;
    case KERN_MXFP4:
        for (int c = c0; c < c1; c++) {
            const unsigned byte = row[c / 2], code = c % 2 ? byte >> 4 : byte & 15u;
            out[c - c0] = kern_e2m1_to_f32(code) * kern_e8m0_to_f32(sc[c / KERN_BLOCK]);
        }
        return;
    case KERN_Q8_0:
        for (int c = c0; c < c1; c++) {
            uint16_t h;
            memcpy(&h, sc + (size_t)(c / KERN_BLOCK) * 2, sizeof h);
            out[c - c0] = (float)(int8_t)row[c] * kern_f16_to_f32(h);
        }
        return;
    }
}

/* Rows of a block-format weight dequantised per block of 128 (the rows
 * kern_matmul's widening path uses), each block multiplied as f32. */
static void matmul_block(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0,
                         int r1, float *scratch) {
    const int in = w->cols;
    for (int rb = r0; rb < r1; rb += 128) {
        const int nr = r1 - rb < 128 ? r1 - rb : 128;
        for (int r = 0; r < nr; r++) kern_weight_row_f32(w, rb + r, 0, in, scratch + (size_t)r * in);
        /* the block is f32 now: rows [0, nr) of it land in y's columns rb.. */
        kern_matmul(KERN_F32, scratch, in, x, T, y + rb, ldy, 0, nr, NULL);
    }
}

void kern_matmul_w(const kern_weight *w, const float *x, int T, float *y, int ldy, int r0, int r1,
                   float *scratch) {
    if (!kern_dtype_is_block(w->dt)) {
        kern_matmul(w->dt, w->data, w->cols, x, T, y, ldy, r0, r1, scratch);
        return;
    }
    if (scratch) matmul_block(w, x, T, y, ldy, r0, r1, scratch);
}
