#include "tests/sim/lm.h"

#include <math.h>
#include <string.h>

#include "common/util.h"

/* Logits are spread over [0, LOGIT_SCALE); the (quantization, dtype) perturbation is uniform in
 * +-QUANT_AMPLITUDE/2. With ~300 words the expected gap between the two best logits is about
 * LOGIT_SCALE/300 = 0.027, so an amplitude of 0.05 moves the argmax at roughly one step in three:
 * a different quantization diverges within the first few tokens, the same one never does. */
#define LOGIT_SCALE 8.0
#define QUANT_AMPLITUDE 0.05
/* Share of steps forced into a near tie (natural ties add ~2% more at this epsilon). */
#define TIE_RATE 0.13
/* Chance per step (after SIM_LM_MIN_TOKENS_BEFORE_EOS) that end-of-sequence wins. */
#define EOS_RATE 0.012

#define SALT_TIE 0x7469652d73616c74ull
#define SALT_EOS 0x656f732d73616c74ull

static const char *const vocab[] = {
    "the",     "of",       "and",      "to",       "in",       "is",       "was",      "that",
    "for",     "on",       "with",     "as",       "by",       "at",       "from",     "his",
    "her",     "their",    "our",      "your",     "its",      "this",     "these",    "those",
    "which",   "who",      "what",     "when",     "where",    "why",      "how",      "all",
    "some",    "many",     "few",      "more",     "most",     "other",    "such",     "only",
    "also",    "very",     "just",     "even",     "still",    "never",    "always",   "often",
    "again",   "then",     "now",      "here",     "there",    "today",    "tomorrow", "yesterday",
    "one",     "two",      "three",    "four",     "five",     "six",      "seven",    "eight",
    "nine",    "ten",      "first",    "second",   "third",    "last",     "next",     "new",
    "old",     "good",     "bad",      "great",    "small",    "large",    "long",     "short",
    "high",    "low",      "early",    "late",     "young",    "big",      "little",   "right",
    "left",    "true",     "false",    "open",     "closed",   "quick",    "slow",     "bright",
    "dark",    "warm",     "cold",     "soft",     "hard",     "quiet",    "loud",     "clear",
    "simple",  "strange",  "happy",    "sad",      "calm",     "brave",    "gentle",   "wise",
    "curious", "careful",  "red",      "blue",     "green",    "yellow",   "white",    "black",
    "golden",  "silver",   "time",     "year",     "day",      "night",    "morning",  "evening",
    "week",    "month",    "hour",     "minute",   "world",    "country",  "city",     "village",
    "river",   "mountain", "forest",   "ocean",    "sea",      "lake",     "island",   "valley",
    "road",    "bridge",   "house",    "home",     "garden",   "window",   "door",     "room",
    "table",   "chair",    "book",     "letter",   "story",    "song",     "music",    "picture",
    "word",    "name",     "voice",    "sound",    "light",    "fire",     "water",    "stone",
    "tree",    "flower",   "leaf",     "rain",     "snow",     "wind",     "storm",    "sun",
    "moon",    "star",     "sky",      "cloud",    "bird",     "horse",    "dog",      "cat",
    "fish",    "wolf",     "fox",      "bear",     "child",    "children", "man",      "woman",
    "people",  "friend",   "family",   "mother",   "father",   "teacher",  "doctor",   "farmer",
    "king",    "queen",    "soldier",  "traveler", "stranger", "neighbor", "machine",  "engine",
    "system",  "signal",   "number",   "answer",   "question", "problem",  "idea",     "reason",
    "plan",    "way",      "part",     "place",    "point",    "end",      "side",     "hand",
    "eye",     "heart",    "mind",     "life",     "death",    "love",     "hope",     "fear",
    "truth",   "memory",   "dream",    "journey",  "market",   "school",   "library",  "station",
    "harbor",  "ship",     "train",    "wheel",    "clock",    "map",      "key",      "gate",
    "wall",    "tower",    "field",    "path",     "bread",    "salt",     "coffee",   "tea",
    "apple",   "orange",   "are",      "be",       "been",     "has",      "have",     "had",
    "do",      "did",      "does",     "can",      "could",    "will",     "would",    "should",
    "may",     "might",    "must",     "go",       "goes",     "went",     "come",     "came",
    "see",     "saw",      "look",     "find",     "found",    "give",     "gave",     "take",
    "took",    "make",     "made",     "know",     "knew",     "think",    "thought",  "say",
    "said",    "tell",     "told",     "ask",      "asked",    "walk",     "walked",   "run",
    "ran",     "sing",     "sang",     "write",    "wrote",    "read",     "build",    "built",
    "carry",   "carried",  "follow",   "followed", "remember", "forget",   "begin",    "began",
    "stop",    "wait",     "watch",    "listen",   "learn",    "teach",    "help",     "keep",
    "kept",    "leave",    "return",   "returned", "under",    "over",     "between",  "behind",
    "beyond",  "across",   "through",  "toward",   "without",  "within",   "before",   "after",
    "during",  "because",  "although", "while",    "until",    "if",       "but",      "or",
    "so",      "not",      "no",       "yes",      "perhaps",  "together", "alone",    "away",
    "back",    "down",     "up",
};

#define VOCAB_N (sizeof(vocab) / sizeof(vocab[0]))
/* Index of the end-of-sequence slot in a logits vector. */
#define EOS_SLOT VOCAB_N

uint64_t sim_mix64(uint64_t x)
{
    return dp_mix64(x);
}

static uint64_t hash2(uint64_t a, uint64_t b)
{
    return sim_mix64(a ^ sim_mix64(b + 0x9e3779b97f4a7c15ull));
}

uint64_t sim_hash64(const void *p, size_t n, uint64_t seed)
{
    /* FNV-1a over the bytes, then mixed with the seed: strings only need to be told apart. */
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return hash2(h, seed ^ (uint64_t)n);
}

/* A uniform double in [0, 1) from 64 hash bits. */
static double unit(uint64_t h)
{
    return (double)(h >> 11) * 0x1p-53;
}

static uint64_t str_hash(const char *s, uint64_t seed)
{
    return sim_hash64(s ? s : "", s ? strlen(s) : 0, seed);
}

void sim_lm_init(sim_lm_t *lm, const char *checkpoint_sha256, const char *quantization,
                 const char *dtype)
{
    lm->model_key = str_hash(checkpoint_sha256, 0x636b7074ull);
    lm->quant_key = hash2(str_hash(quantization, 0x7175616eull), str_hash(dtype, 0x64747970ull));
}

size_t sim_lm_vocab_size(void)
{
    return VOCAB_N;
}

const char *sim_lm_word(int32_t token)
{
    if (token < 0 || (size_t)token >= VOCAB_N)
        return NULL;
    return vocab[token];
}

void sim_prompt_init(sim_prompt_t *p)
{
    p->hash = 0x70726f6d7074ull;
    p->ntokens = 0;
}

static bool is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

void sim_prompt_add_text(sim_prompt_t *p, const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        while (i < n && is_space(s[i]))
            i++;
        size_t start = i;
        while (i < n && !is_space(s[i]))
            i++;
        if (i > start) {
            p->hash = hash2(p->hash, sim_hash64(s + start, i - start, 0x776f7264ull));
            p->ntokens++;
        }
    }
}

void sim_prompt_add_token(sim_prompt_t *p, int64_t token)
{
    p->hash = hash2(p->hash, hash2((uint64_t)token, 0x746f6b656eull));
    p->ntokens++;
}

uint64_t sim_lm_sample_seed(int64_t seed, uint32_t index)
{
    return hash2((uint64_t)seed, 0x73656564ull + index);
}

void sim_gen_init(sim_gen_t *g, const sim_lm_t *lm, const sim_prompt_t *prompt,
                  const sim_gen_params_t *params)
{
    memset(g, 0, sizeof(*g));
    g->lm = *lm;
    g->params = *params;
    g->prompt_hash = prompt->hash;
    g->rng = sim_mix64(params->sample_seed ^ 0x726e67ull);
    g->last[0] = g->last[1] = g->last[2] = -2;
    if (params->max_tokens == 0)
        g->finish = SIM_FINISH_LENGTH;
}

static uint64_t context_hash(const sim_gen_t *g)
{
    uint64_t h = hash2(g->prompt_hash, g->step);
    for (int i = 0; i < 3; i++)
        h = hash2(h, (uint64_t)(int64_t)g->last[i] + 7);
    return h;
}

/* Indices of the best and second-best logits (ties go to the lower index). */
static void top2(const double *l, size_t n, size_t *best, size_t *second)
{
    size_t b = 0, s = 1;
    if (l[1] > l[0]) {
        b = 1;
        s = 0;
    }
    for (size_t i = 2; i < n; i++) {
        if (l[i] > l[b]) {
            s = b;
            b = i;
        } else if (l[i] > l[s]) {
            s = i;
        }
    }
    *best = b;
    *second = s;
}

bool sim_gen_logits(const sim_gen_t *g, double *out)
{
    uint64_t ctx = context_hash(g);
    uint64_t mk = g->lm.model_key ^ ctx, qk = g->lm.quant_key ^ ctx;
    for (size_t w = 0; w < VOCAB_N; w++) {
        double base = LOGIT_SCALE * unit(hash2(mk, w));
        double pert = QUANT_AMPLITUDE * (unit(hash2(qk, w)) - 0.5);
        out[w] = base + pert;
    }
    out[EOS_SLOT] = -INFINITY;
    size_t b, s;
    top2(out, VOCAB_N, &b, &s);
    /* Tie-prone steps depend on the model and context only, so every quantization of a model
     * has them at the same contexts. */
    if (unit(hash2(g->lm.model_key ^ ctx, SALT_TIE)) < TIE_RATE)
        out[s] = out[b] - SIM_LM_NEAR_TIE_EPS * 0.2;
    if (g->step >= SIM_LM_MIN_TOKENS_BEFORE_EOS &&
        unit(hash2(g->lm.model_key ^ ctx, SALT_EOS)) < EOS_RATE)
        out[EOS_SLOT] = out[b] + 0.5;
    top2(out, VOCAB_N + 1, &b, &s);
    return out[b] - out[s] < SIM_LM_NEAR_TIE_EPS;
}

static uint64_t rng_next(uint64_t *state)
{
    *state += 0x9e3779b97f4a7c15ull;
    return sim_mix64(*state);
}

typedef struct {
    double logit;
    size_t idx;
} cand_t;

/* Sort by logit descending, index ascending on equal logits (deterministic). A Shell sort:
 * n is ~300 and this only runs for sampled steps. */
static void sort_cands(cand_t *c, size_t n)
{
    static const size_t gaps[] = {132, 57, 23, 10, 4, 1};
    for (size_t gi = 0; gi < sizeof(gaps) / sizeof(gaps[0]); gi++) {
        size_t gap = gaps[gi];
        for (size_t i = gap; i < n; i++) {
            cand_t t = c[i];
            size_t j = i;
            while (j >= gap && (c[j - gap].logit < t.logit ||
                                (c[j - gap].logit == t.logit && c[j - gap].idx > t.idx))) {
                c[j] = c[j - gap];
                j -= gap;
            }
            c[j] = t;
        }
    }
}

static size_t sample(sim_gen_t *g, const double *l, size_t n)
{
    cand_t c[VOCAB_N + 1];
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (isfinite(l[i]))
            c[m++] = (cand_t){l[i] / g->params.temperature, i};
    sort_cands(c, m);
    if (g->params.top_k > 0 && (size_t)g->params.top_k < m)
        m = (size_t)g->params.top_k;
    double mx = c[0].logit, sum = 0;
    double p[VOCAB_N + 1];
    for (size_t i = 0; i < m; i++) {
        p[i] = exp(c[i].logit - mx);
        sum += p[i];
    }
    if (g->params.top_p > 0 && g->params.top_p < 1) {
        double acc = 0;
        size_t keep = m;
        for (size_t i = 0; i < m; i++) {
            acc += p[i] / sum;
            if (acc >= g->params.top_p) {
                keep = i + 1;
                break;
            }
        }
        sum = 0;
        for (size_t i = 0; i < keep; i++)
            sum += p[i];
        m = keep;
    }
    double r = unit(rng_next(&g->rng)) * sum;
    for (size_t i = 0; i < m; i++) {
        r -= p[i];
        if (r < 0)
            return c[i].idx;
    }
    return c[m - 1].idx;
}

bool sim_gen_step(sim_gen_t *g, const sim_noise_t *noise, sim_step_t *out)
{
    if (g->finish != SIM_FINISH_NONE)
        return false;
    double l[VOCAB_N + 1];
    bool tied = sim_gen_logits(g, l);
    size_t b, s;
    top2(l, VOCAB_N + 1, &b, &s);
    bool flip = false;
    if (tied && noise && noise->inflight >= 2 && noise->p > 0)
        flip = unit(noise->rnd) < noise->p;
    if (flip) {
        /* Batching changed the reduction order and the runner-up won by a hair. */
        double t = l[b];
        l[b] = l[s];
        l[s] = t;
        size_t tmp = b;
        b = s;
        s = tmp;
    }
    size_t pick = g->params.temperature > 0 ? sample(g, l, VOCAB_N + 1) : b;

    out->near_tied = tied;
    out->flipped = flip;
    if (pick == EOS_SLOT) {
        out->token = SIM_LM_TOKEN_EOS;
        g->finish = SIM_FINISH_STOP;
        return true;
    }
    out->token = (int32_t)pick;
    g->last[2] = g->last[1];
    g->last[1] = g->last[0];
    g->last[0] = (int32_t)pick;
    g->step++;
    if (g->step >= g->params.max_tokens)
        g->finish = SIM_FINISH_LENGTH;
    return true;
}
