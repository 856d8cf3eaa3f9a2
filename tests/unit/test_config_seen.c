/* The config's seen-set (config/cfg_internal.h): the first value a string was added with,
 * across the growth of its table, for many keys and keys that share a hash bucket's start. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>

#include "config/cfg_internal.h"

Test(seen, the_first_value_is_kept_and_found)
{
    cfg_seen_t s = {0};
    cr_assert_eq(cfg_seen_find(&s, "a"), CFG_UNSEEN);
    cr_assert_eq(cfg_seen_add(&s, "a", 7), CFG_UNSEEN);
    cr_assert_eq(cfg_seen_add(&s, "a", 9), 7); /* a duplicate: the first one's value */
    cr_assert_eq(cfg_seen_find(&s, "a"), 7);
    cr_assert_eq(cfg_seen_find(&s, "b"), CFG_UNSEEN);
    cr_assert_eq(cfg_seen_add(&s, "", 3), CFG_UNSEEN); /* the empty string is a key too */
    cr_assert_eq(cfg_seen_find(&s, ""), 3);
    cfg_seen_free(&s);
    cr_assert_eq(cfg_seen_find(&s, "a"), CFG_UNSEEN);
}

Test(seen, many_keys_survive_every_growth)
{
    enum { N = 50000 };
    char(*keys)[16] = malloc(N * sizeof(*keys));
    cfg_seen_t s = {0};
    for (size_t i = 0; i < N; i++) {
        snprintf(keys[i], sizeof(keys[i]), "/x/%zu", i);
        cr_assert_eq(cfg_seen_add(&s, keys[i], i), CFG_UNSEEN, "key %zu", i);
    }
    cr_assert_eq(s.n, N);
    for (size_t i = 0; i < N; i++)
        cr_assert_eq(cfg_seen_add(&s, keys[i], N + i), i, "key %zu", i);
    cr_assert_eq(s.n, N);
    cfg_seen_free(&s);
    free(keys);
}
