/* proxy/core/metrics: per-thread cells written concurrently, summed at scrape time; look-ups of
 * one series from several threads find the same series. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <string.h>

#include "proxy/core/metrics.h"

#define THREADS 4
#define ADDS 100000

static void *adder(void *arg)
{
    px_metrics_thread = (unsigned)(uintptr_t)arg;
    for (int i = 0; i < ADDS; i++) {
        /* A look-up every time, as a request path without a cached pointer does. */
        px_metrics_add(px_metrics_get("t_total", "k", "v", NULL), 1);
        px_metrics_observe(px_metrics_hist("t_seconds", px_metrics_latency_bounds,
                                           px_metrics_latency_nbounds, NULL),
                           0.001);
    }
    return NULL;
}

Test(metrics_threads, cells_sum_at_render)
{
    px_metrics_reset();
    px_metrics_set_threads(THREADS + 1);
    px_metrics_family("t_total", PX_COUNTER, "test");
    pthread_t t[THREADS];
    for (unsigned i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, adder, (void *)(uintptr_t)(i + 1));
    for (unsigned i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    px_series_t *s = px_metrics_get("t_total", "k", "v", NULL);
    cr_assert_eq(px_metrics_value(s), (double)THREADS * ADDS);
    px_series_t *h =
        px_metrics_hist("t_seconds", px_metrics_latency_bounds, px_metrics_latency_nbounds, NULL);
    cr_assert_eq(px_metrics_count(h), (uint64_t)THREADS * ADDS);
    cr_assert_eq(px_metrics_bucket(h, 0), (uint64_t)THREADS * ADDS); /* 0.001 <= 0.005 */
    dp_buf_t out = {0};
    px_metrics_render(&out);
    cr_assert(strstr(out.base, "t_total{k=\"v\"} 400000\n") != NULL, "%s", out.base);
    cr_assert(strstr(out.base, "t_seconds_count 400000\n") != NULL, "%s", out.base);
    dp_buf_free(&out);
    px_metrics_reset();
}

Test(metrics_threads, a_gauge_is_one_shared_value)
{
    px_metrics_reset();
    px_metrics_set_threads(3);
    px_series_t *g = px_metrics_get("t_gauge", NULL);
    px_metrics_thread = 2;
    px_metrics_set(g, 5);
    px_metrics_thread = 0;
    px_metrics_set(g, 7);
    cr_assert_eq(px_metrics_value(g), 7);
    px_metrics_reset();
}
