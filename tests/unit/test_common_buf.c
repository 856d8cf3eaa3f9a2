/* common/buf.c: exact reservations and the thread's stash of large buffers; common/util.h's
 * case-insensitive comparisons. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/buf.h"
#include "common/util.h"

Test(buf, an_exact_reservation_allocates_what_is_asked_and_keeps_the_bytes)
{
    dp_buf_t b = {0};
    dp_buf_append(&b, "abc", 3);
    dp_buf_reserve_exact(&b, 1000);
    cr_assert_eq(b.cap, 3 + 1000 + 1);
    cr_assert_str_eq(b.base, "abc");
    dp_buf_reserve_exact(&b, 10); /* room already: nothing moves */
    cr_assert_eq(b.cap, 1004);
    dp_buf_free(&b);
}

Test(buf, a_released_large_buffer_is_reused_by_the_next_exact_reservation_that_fits)
{
    dp_buf_stash_free();
    dp_buf_t a = {0};
    dp_buf_reserve_exact(&a, 300000);
    memset(a.base, 'x', 300000);
    char *first = a.base;
    dp_buf_release(&a);
    cr_assert_null(a.base);
    cr_assert_eq(a.cap, 0);

    dp_buf_t b = {0};
    dp_buf_append(&b, "head", 4);
    dp_buf_reserve_exact(&b, 250000 - 4);
    cr_assert_eq(b.base, first, "the stashed buffer was not reused");
    cr_assert_eq(b.cap, 300001);
    cr_assert_str_eq(b.base, "head", "the bytes already there move with the buffer");
    dp_buf_free(&b);
    dp_buf_stash_free();
}

Test(buf, a_stashed_buffer_much_bigger_than_needed_is_left_alone)
{
    dp_buf_stash_free();
    dp_buf_t a = {0};
    dp_buf_reserve_exact(&a, 1 << 20);
    char *big = a.base;
    dp_buf_release(&a);
    dp_buf_t b = {0};
    dp_buf_reserve_exact(&b, 100000); /* a 1 MiB buffer would hold 10x the body resident */
    cr_assert_neq(b.base, big);
    cr_assert_eq(b.cap, 100001);
    dp_buf_free(&b);
    dp_buf_stash_free();
}

Test(buf, small_buffers_are_freed_and_large_ones_come_back_from_the_stash)
{
    dp_buf_stash_free();
    dp_buf_t small = {0};
    dp_buf_reserve_exact(&small, 1000);
    dp_buf_release(&small); /* freed: LeakSanitizer would see a leak otherwise */
    cr_assert_null(small.base);
    for (int i = 0; i < 40; i++) {
        dp_buf_t b = {0};
        dp_buf_reserve_exact(&b, 512 * 1024 - 1);
        static char *once;
        if (i == 0)
            once = b.base;
        cr_assert_eq(b.base, once, "each reservation reuses what the one before released");
        dp_buf_release(&b);
    }
    dp_buf_stash_free();
}

/* 40 buffers of 512 KiB released together: the stash keeps 16 MiB of them, the newest 32,
 * and every one of those comes back. */
Test(buf, a_full_stash_keeps_the_newest_buffers)
{
    dp_buf_stash_free();
    enum { N = 160, KEPT = 128 }; /* 80 MiB of 512 KiB buffers into a 64 MiB stash */
    dp_buf_t hold[N];
    char *was[N];
    for (int i = 0; i < N; i++) {
        hold[i] = (dp_buf_t){0};
        dp_buf_reserve_exact(&hold[i], 512 * 1024 - 1);
        was[i] = hold[i].base;
    }
    for (int i = 0; i < N; i++)
        dp_buf_release(&hold[i]);
    for (int i = 0; i < N; i++) {
        hold[i] = (dp_buf_t){0};
        dp_buf_reserve_exact(&hold[i], 512 * 1024 - 1);
    }
    for (int k = N - KEPT; k < N; k++) {
        bool back = false;
        for (int i = 0; i < N; i++)
            back |= hold[i].base == was[k];
        cr_assert(back, "released buffer %d of %d was not reused", k, N);
    }
    for (int i = 0; i < N; i++)
        for (int j = i + 1; j < N; j++)
            cr_assert_neq(hold[i].base, hold[j].base, "one buffer handed out twice");
    for (int i = 0; i < N; i++)
        dp_buf_free(&hold[i]);
    dp_buf_stash_free();
}

/* Buffers the stash held through a whole decay window (2 s) without one being taken are freed
 * at its next use; one taken and given back in the window stays. */
Test(buf, buffers_nothing_took_for_a_window_are_freed)
{
    dp_buf_stash_free();
    enum { N = 4 };
    dp_buf_t b[N];
    for (int i = 0; i < N; i++) {
        b[i] = (dp_buf_t){0};
        dp_buf_reserve_exact(&b[i], 256 * 1024);
    }
    size_t one = b[0].cap;
    for (int i = 0; i < N; i++)
        dp_buf_release(&b[i]);
    cr_assert_eq(dp_buf_stash_bytes(), N * one);
    usleep(2100 * 1000);                     /* the window that started at the first release ends */
    dp_buf_reserve_exact(&b[0], 256 * 1024); /* a new window: all four stashed at its start */
    cr_assert_eq(dp_buf_stash_bytes(), (N - 1) * one, "a buffer was freed too early");
    dp_buf_release(&b[0]);
    usleep(2100 * 1000);
    /* three stayed stashed through the whole window: freed now; the one in use remains */
    dp_buf_reserve_exact(&b[0], 256 * 1024);
    cr_assert_eq(b[0].cap, one);
    cr_assert_eq(dp_buf_stash_bytes(), 0, "buffers idle for a whole window were kept");
    dp_buf_free(&b[0]);
    dp_buf_stash_free();
}

/* A buffer bigger than any body that takes from the stash would only sit there: it is freed
 * (a chunked 8 MiB body's 16 MiB buffer would otherwise fill the whole stash). */
Test(buf, a_buffer_no_presized_body_can_use_is_not_kept)
{
    dp_buf_stash_free();
    dp_buf_t big = {0};
    dp_buf_reserve(&big, 3u << 20);
    dp_buf_release(&big);
    dp_buf_t b = {0};
    dp_buf_reserve_exact(&b, (DP_BUF_STASH_MAX - 2) * 2 / 3);
    cr_assert_eq(b.cap, (DP_BUF_STASH_MAX - 2) * 2 / 3 + 1, "got a kept buffer of %zu", b.cap);
    char *kept = b.base; /* one a presized body can use is kept */
    dp_buf_release(&b);
    dp_buf_t again = {0};
    dp_buf_reserve_exact(&again, (DP_BUF_STASH_MAX - 2) * 2 / 3);
    cr_assert_eq(again.base, kept);
    dp_buf_free(&again);
    dp_buf_stash_free();
}

static void *thread_releases(void *arg)
{
    (void)arg;
    dp_buf_t b = {0};
    dp_buf_reserve_exact(&b, 200000);
    dp_buf_release(&b);
    return NULL; /* the stash goes with the thread: LeakSanitizer would say otherwise */
}

Test(buf, a_threads_stash_is_freed_when_the_thread_exits)
{
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, thread_releases, NULL), 0);
    cr_assert_eq(pthread_join(t, NULL), 0);
}

#if defined(__SANITIZE_ADDRESS__)
/* A pointer kept into a released body is caught while the buffer waits in the stash, as it
 * would be after free(). */
Test(buf, reading_a_stashed_buffer_is_caught_by_asan, .exit_code = 1)
{
    dp_buf_stash_free();
    dp_buf_t b = {0};
    dp_buf_reserve_exact(&b, 100000);
    memset(b.base, 'x', 100000);
    volatile char *stale = b.base;
    dp_buf_release(&b);
    cr_assert_eq(stale[10], 'x', "not reached: ASan stops the process on the read");
}
#endif

/* Header names compare ASCII case-insensitively, whole: a prefix, a longer name or a name
 * holding a NUL is another name. */
/* A size no allocation can meet is out of memory (abort), never a length that wraps around to
 * "fits" and lets the caller write past the buffer. */
Test(buf, a_reservation_too_large_to_meet_aborts, .signal = SIGABRT)
{
    dp_buf_t b = {0};
    dp_buf_appends(&b, "abc");
    dp_buf_reserve(&b, SIZE_MAX - 2);
}

Test(buf, an_exact_reservation_too_large_to_meet_aborts, .signal = SIGABRT)
{
    dp_buf_t b = {0};
    dp_buf_appends(&b, "abc");
    dp_buf_reserve_exact(&b, SIZE_MAX - 2);
}

Test(util, strieq_compares_whole_names_ignoring_ascii_case)
{
    cr_assert(dp_strieq("Content-Type", 12, "content-type"));
    cr_assert(dp_strieq("HOST", 4, "host"));
    cr_assert(dp_strieq("", 0, ""));
    cr_assert_not(dp_strieq("Host", 3, "host"));  /* a prefix */
    cr_assert_not(dp_strieq("Hosts", 5, "host")); /* longer */
    cr_assert_not(dp_strieq("ho\0t", 4, "host")); /* a NUL inside */
    cr_assert_not(dp_strieq("h\xc3st", 5, "host"));
    cr_assert_not(dp_strieq("Hozt", 4, "host"));
    cr_assert(dp_memieq("AbC", "aBc", 3));
    cr_assert_not(dp_memieq("[", "{", 1)); /* 0x5b and 0x7b differ only by 0x20: not letters */
    /* eight bytes a step, and the tail a byte at a time, against the byte-wise definition */
    cr_assert(dp_memieq("X-DetProxy-Tenant", "x-detproxy-tenant", 17));
    cr_assert_not(dp_memieq("x-detproxy-tenanT", "x-detproxy-tenanu", 17));
    for (int c = 0; c < 256; c++) {
        for (int d = 0; d < 256; d++) {
            char x[9] = "abcdefgh", y[9] = "ABCDEFGH";
            x[c % 8] = (char)c;
            y[c % 8] = (char)d;
            bool same =
                c == d || ((c | 0x20) == (d | 0x20) && (c | 0x20) >= 'a' && (c | 0x20) <= 'z');
            cr_assert_eq(dp_memieq(x, y, 8), same, "0x%02x 0x%02x", c, d);
            cr_assert_eq(dp_memieq(x + 7, y + 7, 1), c % 8 != 7 || same, "0x%02x 0x%02x", c, d);
        }
    }
    /* every length up to three steps, one byte changed at each place: the overlapping last
     * step and the four-byte halves see it wherever it is */
    static const char up[] = "X-FORWARDED-PROTO-HOST-TE", lo[] = "x-forwarded-proto-host-te";
    for (size_t n = 0; n <= 24; n++) {
        cr_assert(dp_memieq(up, lo, n), "n %zu", n);
        for (size_t at = 0; at < n; at++) {
            for (int flip = 0; flip < 2; flip++) {
                char y[25];
                memcpy(y, lo, sizeof(y));
                y[at] = flip ? (char)(y[at] ^ 0x01) : (char)(y[at] ^ 0x80);
                cr_assert_not(dp_memieq(up, y, n), "n %zu at %zu flip %d", n, at, flip);
                cr_assert_not(dp_memieq(y, up, n), "n %zu at %zu flip %d", n, at, flip);
            }
        }
    }
}

/* dp_u64_dec writes v as snprintf("%llu") does, and says how long it is. */
static void expect_dec(uint64_t v)
{
    char got[21], want[32];
    size_t n = dp_u64_dec(v, got);
    int wn = snprintf(want, sizeof(want), "%llu", (unsigned long long)v);
    cr_assert_str_eq(got, want);
    cr_assert_eq(n, (size_t)wn);
}

/* Decimal writing and bounded copies, as snprintf("%llu") and snprintf("%.*s") write them. */
Test(util, u64_dec_and_copy_str_write_what_snprintf_writes)
{
    static const uint64_t vs[] = {
        0, 7, 10, 99, 100, 1234, 4294967295u, 4294967296u, 18446744073709551615u};
    for (size_t i = 0; i < sizeof(vs) / sizeof(vs[0]); i++)
        expect_dec(vs[i]);
    /* every digit count's first and last value, and values between */
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (uint64_t p = 1, k = 0; k < 20; k++, p *= 10) {
        uint64_t near[] = {p - 1, p, p + 1, p * 5 + 7, x >> (k * 3)};
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        for (size_t i = 0; i < sizeof(near) / sizeof(near[0]); i++)
            expect_dec(near[i]);
    }
    dp_buf_t b = {0};
    dp_buf_append_u64(&b, 18446744073709551615u);
    cr_assert_str_eq(b.base, "18446744073709551615");
    dp_buf_free(&b);
    char dst[8];
    dp_copy_str(dst, sizeof(dst), "POST /x", 4);
    cr_assert_str_eq(dst, "POST");
    dp_copy_str(dst, sizeof(dst), "0123456789", 10); /* cut to cap - 1 */
    cr_assert_str_eq(dst, "0123456");
    dp_copy_str(dst, sizeof(dst), NULL, 0);
    cr_assert_str_eq(dst, "");
}

Test(util, base64_round_trips_every_length_and_appends_to_what_is_there)
{
    unsigned char raw[64];
    for (size_t i = 0; i < sizeof(raw); i++)
        raw[i] = (unsigned char)(i * 37 + 11);
    for (size_t n = 0; n <= sizeof(raw); n++) {
        dp_buf_t enc = {0}, dec = {0};
        dp_buf_append(&enc, "x", 1);
        dp_base64_encode(raw, n, &enc);
        cr_assert_eq(enc.len, 1 + 4 * ((n + 2) / 3), "n=%zu", n);
        cr_assert_eq(strlen(enc.base), enc.len);
        dp_buf_append(&dec, "y", 1);
        cr_assert_eq(dp_base64_decode(enc.base + 1, enc.len - 1, &dec), 0, "n=%zu", n);
        cr_assert_eq(dec.len, 1 + n, "n=%zu", n);
        cr_assert(dec.base[0] == 'y' && memcmp(dec.base + 1, raw, n) == 0, "n=%zu", n);
        dp_buf_free(&enc);
        dp_buf_free(&dec);
    }
}

Test(util, base64_refuses_what_is_not_padded_standard_base64_and_keeps_the_buffer)
{
    static const char *const bad[] = {"abc",  "ab=c", "a===",   "=abc", "ab-_",
                                      "ab c", "Zg=",  "Zm9v\n", "Z===", "Zg==Zg=="};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        dp_buf_t out = {0};
        dp_buf_append(&out, "keep", 4);
        cr_assert_neq(dp_base64_decode(bad[i], strlen(bad[i]), &out), 0, "%s", bad[i]);
        cr_assert_eq(out.len, 4, "%s", bad[i]);
        cr_assert_str_eq(out.base, "keep", "%s", bad[i]);
        dp_buf_free(&out);
    }
    dp_buf_t out = {0};
    cr_assert_eq(dp_base64_decode("Zm9vYg==", 8, &out), 0);
    cr_assert_str_eq(out.base, "foob");
    dp_buf_free(&out);
}

Test(util, rfc3339_times_and_dates_parse_to_milliseconds)
{
    static const struct {
        const char *s;
        int64_t ms;
    } good[] = {
        {"1970-01-01T00:00:00Z", 0},
        {"2026-12-01", 1796083200000},
        {"2026-12-01T00:00:00Z", 1796083200000},
        {"2026-12-01t00:00:00.250z", 1796083200250},
        {"2026-12-01T00:00:00.2509999Z", 1796083200250},
        {"2026-12-01T01:30:00+01:30", 1796083200000},
        {"2026-11-30T23:00:00-01:00", 1796083200000},
        {"2024-02-29T12:00:00Z", 1709208000000},
        {"2000-02-29", 951782400000},
    };
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        int64_t ms = -1;
        cr_assert_eq(dp_parse_time_ms(good[i].s, &ms), 0, "%s", good[i].s);
        cr_assert_eq(ms, good[i].ms, "%s: %lld", good[i].s, (long long)ms);
    }
    static const char *const bad[] = {
        "yesterday",
        "2026-12-1",
        "2026-13-01",
        "2026-02-30",
        "2025-02-29",
        "1900-02-29",
        "2026-12-01T",
        "2026-12-01T24:00:00Z",
        "2026-12-01T10:00:00",
        "2026-12-01T10:00:00.Z",
        "2026-12-01T10:00:00+0100",
        "2026-12-01T10:00:00Zjunk",
        "2026-12-01 10:00:00Z",
        "",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int64_t ms = 7;
        cr_assert_neq(dp_parse_time_ms(bad[i], &ms), 0, "%s", bad[i]);
        cr_assert_eq(ms, 7, "%s", bad[i]);
    }
    cr_assert_neq(dp_parse_time_ms(NULL, &(int64_t){0}), 0);
}
