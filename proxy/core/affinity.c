/* Rendezvous hashing with bounded loads: see affinity.h. */
#include "proxy/core/affinity.h"

#include "common/util.h"

const char *const px_affinity_result_names[PX_AFF__COUNT] = {"", "hit", "spill", "fallback"};

uint64_t px_affinity_hash(const void *p, size_t n)
{
    uint8_t d[32];
    dp_sha256(p, n, d);
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | d[i];
    return v;
}

/* A full-avalanche mixer makes one key's scores for different replicas as good as independent
 * draws (keys and ids are already SHA-256 bits). */
uint64_t px_affinity_score(uint64_t key, uint64_t id)
{
    return dp_mix64(key ^ id);
}

bool px_affinity_overloaded(uint32_t inflight, uint64_t total, size_t n, double load_factor)
{
    if (n == 0)
        return false;
    return (double)inflight > load_factor * ((double)total / (double)n) + 1.0;
}

/* Does a come before b in the key's order? Equal scores (never seen in practice) are broken by
 * the identity, so the order stays a function of the key and the ids alone. */
static bool before(uint64_t sa, uint64_t ida, uint64_t sb, uint64_t idb)
{
    return sa > sb || (sa == sb && ida < idb);
}

/* One pass, O(n): the order is never materialised, since the first usable replica under its
 * bound is simply the best-scoring one among them. */
size_t px_affinity_home(uint64_t key, const px_affinity_cand_t *c, size_t n)
{
    size_t top = n;
    uint64_t s_top = 0;
    for (size_t i = 0; i < n; i++) {
        if (!c[i].member)
            continue;
        uint64_t s = px_affinity_score(key, c[i].id);
        if (top == n || before(s, c[i].id, s_top, c[top].id)) {
            top = i;
            s_top = s;
        }
    }
    return top;
}

size_t px_affinity_choose(uint64_t key, const px_affinity_cand_t *c, size_t n, double load_factor,
                          px_affinity_result_t *result)
{
    uint64_t total = 0;
    size_t members = 0;
    for (size_t i = 0; i < n; i++) {
        if (c[i].member) {
            total += c[i].inflight;
            members++;
        }
    }
    size_t top = px_affinity_home(key, c, n), under = n, any = n;
    uint64_t s_under = 0, s_any = 0;
    for (size_t i = 0; i < n; i++) {
        if (!c[i].member)
            continue;
        uint64_t s = px_affinity_score(key, c[i].id);
        if (!c[i].usable)
            continue;
        if (any == n || before(s, c[i].id, s_any, c[any].id)) {
            any = i;
            s_any = s;
        }
        if (!px_affinity_overloaded(c[i].inflight, total, members, load_factor) &&
            (under == n || before(s, c[i].id, s_under, c[under].id))) {
            under = i;
            s_under = s;
        }
    }
    size_t pick = under != n ? under : any;
    *result = pick != n && pick == top ? PX_AFF_HIT : PX_AFF_SPILL;
    return pick;
}
