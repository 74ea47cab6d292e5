/*
 * test_buf.c - kds_buf, the growable byte buffer every module shares: bytes
 * survive growth, growth is geometric, sizes that overflow are refused
 * without touching the buffer, reset keeps the memory, free and detach give
 * it back, printf appends what snprintf would write.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <wchar.h>

#include "kds_buf.h"

/* A deterministic byte stream with NULs in it (xorshift32). */
static unsigned char byte_at(size_t i) {
    uint32_t x = (uint32_t)i * 2654435761u + 1u;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return (unsigned char)(x % 7 == 0 ? 0 : x);
}

static kds_buf filled(const char *text) {
    kds_buf b = {0};
    cr_assert_eq(kds_buf_append(&b, text, strlen(text), NULL), KDS_OK);
    return b;
}

Test(kds_buf, zero_initialised_is_empty) {
    kds_buf b = {0};
    cr_assert_eq(b.len, 0);
    cr_assert_str_eq(kds_buf_str(&b), "");
    size_t len = 1;
    cr_assert_null(kds_buf_detach(&b, &len));
    cr_assert_eq(len, 0);
    kds_buf_free(&b);
    cr_assert_null(b.p);
}

Test(kds_buf, appends_across_growth_keep_the_bytes) {
    enum { TOTAL = 200000 };
    unsigned char *want = malloc(TOTAL);
    cr_assert_not_null(want);
    for (size_t i = 0; i < TOTAL; i++)
        want[i] = byte_at(i);
    kds_buf b = {0};
    size_t grew = 0, last_cap = 0;
    for (size_t off = 0, step = 1; off < TOTAL; off += step, step = step % 331 + 1) {
        size_t n = off + step <= TOTAL ? step : TOTAL - off;
        cr_assert_eq(kds_buf_append(&b, want + off, n, NULL), KDS_OK);
        cr_assert_eq(b.len, off + n);
        cr_assert_eq(b.p[b.len], '\0', "no NUL after %zu bytes", b.len);
        if (b.cap != last_cap) {
            grew++;
            last_cap = b.cap;
        }
    }
    cr_assert_gt(grew, 5, "the buffer grew only %zu times", grew);
    cr_assert_geq(b.cap, b.len);
    cr_assert_eq(memcmp(b.p, want, TOTAL), 0);
    kds_buf_free(&b);
    free(want);
}

Test(kds_buf, growth_is_geometric) {
    /* 1 MiB appended a byte at a time: doubling from 64 bytes needs 15
     * allocations; growing by a constant would need thousands. */
    kds_buf b = {0};
    int allocations = 0;
    size_t last_cap = 0;
    for (size_t i = 0; i < ((size_t)1 << 20); i++) {
        unsigned char c = byte_at(i);
        cr_assert_eq(kds_buf_append(&b, &c, 1, NULL), KDS_OK);
        if (b.cap != last_cap) {
            allocations++;
            last_cap = b.cap;
        }
    }
    cr_assert_leq(allocations, 15, "%d allocations for 1 MiB", allocations);
    /* power-of-two content gets power-of-two room: the NUL is not what
     * doubles a full 1 MiB buffer */
    cr_assert_eq(b.cap, (size_t)1 << 20);
    kds_buf_free(&b);
}

Test(kds_buf, append_overflow_is_refused_and_leaves_buffer_unchanged) {
    kds_buf b = filled("abc");
    kds_buf before = b;
    const size_t sizes[] = {SIZE_MAX, SIZE_MAX - 3, SIZE_MAX - 2, (size_t)PTRDIFF_MAX};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        kds_err e = {0};
        /* the source is never read: the size is refused first */
        cr_assert_eq(kds_buf_append(&b, "x", sizes[i], &e), KDS_NOMEM, "size %zu", sizes[i]);
        cr_assert_eq(e.status, KDS_NOMEM);
        cr_assert_gt(strlen(e.msg), 0);
        cr_assert(b.p == before.p && b.len == before.len && b.cap == before.cap, "size %zu",
                  sizes[i]);
        cr_assert_str_eq(kds_buf_str(&b), "abc");
    }
    kds_buf_free(&b);
}

Test(kds_buf, reserve_overflow_is_refused_and_leaves_buffer_unchanged) {
    kds_buf empty = {0};
    kds_err e = {0};
    cr_assert_eq(kds_buf_reserve(&empty, SIZE_MAX, &e), KDS_NOMEM);
    cr_assert_eq(e.status, KDS_NOMEM);
    cr_assert(empty.p == NULL && empty.len == 0 && empty.cap == 0);

    kds_buf b = filled("hello");
    kds_buf before = b;
    const size_t sizes[] = {SIZE_MAX, SIZE_MAX - 5, (size_t)PTRDIFF_MAX, (size_t)PTRDIFF_MAX - 5};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        cr_assert_eq(kds_buf_reserve(&b, sizes[i], NULL), KDS_NOMEM, "size %zu", sizes[i]);
        cr_assert(b.p == before.p && b.len == before.len && b.cap == before.cap, "size %zu",
                  sizes[i]);
        cr_assert_str_eq(kds_buf_str(&b), "hello");
    }
    kds_buf_free(&b);
}

Test(kds_buf, reserve_makes_room_that_appends_use_without_moving) {
    kds_buf b = filled("x");
    cr_assert_eq(kds_buf_reserve(&b, 5000, NULL), KDS_OK);
    cr_assert_geq(b.cap, b.len + 5000);
    cr_assert_str_eq(kds_buf_str(&b), "x");
    unsigned char *p = b.p;
    size_t cap = b.cap;
    for (int i = 0; i < 5000; i++)
        cr_assert_eq(kds_buf_append(&b, "y", 1, NULL), KDS_OK);
    cr_assert(b.p == p && b.cap == cap, "an append within the reserved room reallocated");
    cr_assert_eq(b.len, 5001);
    kds_buf_free(&b);
}

Test(kds_buf, reserve_nothing_on_empty_gives_an_empty_string) {
    kds_buf b = {0};
    cr_assert_eq(kds_buf_reserve(&b, 0, NULL), KDS_OK);
    cr_assert_not_null(b.p);
    cr_assert_eq(b.len, 0);
    cr_assert_eq(b.p[0], '\0');
    kds_buf_free(&b);
}

Test(kds_buf, reset_keeps_capacity) {
    kds_buf b = {0};
    for (int i = 0; i < 1000; i++)
        cr_assert_eq(kds_buf_append(&b, "0123456789", 10, NULL), KDS_OK);
    unsigned char *p = b.p;
    size_t cap = b.cap;
    kds_buf_reset(&b);
    cr_assert_eq(b.len, 0);
    cr_assert(b.p == p && b.cap == cap);
    cr_assert_str_eq(kds_buf_str(&b), "");
    cr_assert_eq(kds_buf_append(&b, "again", 5, NULL), KDS_OK);
    cr_assert(b.p == p, "an append after reset reallocated");
    cr_assert_str_eq(kds_buf_str(&b), "again");
    kds_buf_free(&b);
}

Test(kds_buf, free_returns_to_empty) {
    kds_buf b = filled("some text that is freed");
    kds_buf_free(&b);
    cr_assert(b.p == NULL && b.len == 0 && b.cap == 0);
    kds_buf_free(&b); /* twice is fine */
    kds_buf_free(NULL);
    cr_assert_eq(kds_buf_append(&b, "re", 2, NULL), KDS_OK, "a freed buffer is usable again");
    cr_assert_str_eq(kds_buf_str(&b), "re");
    kds_buf_free(&b);
}

Test(kds_buf, detach_hands_on_the_bytes) {
    kds_buf b = filled("handed on");
    size_t len = 0;
    char *s = kds_buf_detach(&b, &len);
    cr_assert_not_null(s);
    cr_assert_eq(len, 9);
    cr_assert_str_eq(s, "handed on");
    cr_assert(b.p == NULL && b.len == 0 && b.cap == 0);
    free(s);
}

Test(kds_buf, printf_appends_what_snprintf_writes) {
    kds_buf b = filled("n=");
    cr_assert_eq(kds_buf_printf(&b, NULL, "%d %s %.3f", 42, "x", 1.5), KDS_OK);
    cr_assert_str_eq(kds_buf_str(&b), "n=42 x 1.500");
    cr_assert_eq(b.len, strlen("n=42 x 1.500"));
    /* longer than the room left: the second attempt after growing */
    char big[5001];
    for (int i = 0; i < 5000; i++)
        big[i] = (char)('a' + i % 26);
    big[5000] = '\0';
    size_t before = b.len;
    cr_assert_eq(kds_buf_printf(&b, NULL, "[%s]", big), KDS_OK);
    cr_assert_eq(b.len, before + 5002);
    cr_assert_eq(b.p[before], '[');
    cr_assert_eq(memcmp(b.p + before + 1, big, 5000), 0);
    cr_assert_eq(b.p[b.len - 1], ']');
    cr_assert_eq(b.p[b.len], '\0');
    kds_buf_free(&b);
}

Test(kds_buf, printf_failure_leaves_the_content) {
    /* A wide character the C locale cannot convert makes vsnprintf fail. */
    const wchar_t bad[] = {0x3b1, 0};
    if (snprintf(NULL, 0, "%ls", bad) >= 0)
        cr_skip_test("this libc converts U+03B1 in the C locale");
    kds_buf b = filled("kept");
    kds_err e = {0};
    cr_assert_eq(kds_buf_printf(&b, &e, "%ls", bad), KDS_INVALID_ARG);
    cr_assert_eq(e.status, KDS_INVALID_ARG);
    cr_assert_eq(b.len, 4);
    cr_assert_str_eq(kds_buf_str(&b), "kept");
    kds_buf_free(&b);
}
