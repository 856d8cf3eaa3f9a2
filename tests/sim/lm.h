/* The simulator's toy language model: pure, no I/O, no libuv.
 *
 * A "model" is a fixed vocabulary of English words plus an end-of-sequence token. At every
 * step each word gets a logit computed from a hash of (checkpoint, context, word), where the
 * context is the prompt hash, the step number and the last three generated tokens. The
 * (quantization, dtype) pair adds a small systematic perturbation, hashed the same way, so a
 * different quantization flips the argmax at a good fraction of steps while the same pair always
 * gives bit-identical logits. About one step in seven is a "near tie": the two best logits sit
 * within SIM_LM_NEAR_TIE_EPS of each other; those are the only tokens that batching noise
 * (--noise) may flip, and only while two or more generations are running.
 *
 * Output is therefore a deterministic function of (checkpoint, quantization, dtype, prompt,
 * sampling seed, temperature, top_p, top_k, max_tokens); the caller chooses the sampling seed
 * (from the request's seed, or from a random source when the request has none). */
#ifndef SIM_LM_H
#define SIM_LM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Two top logits closer than this are a near tie. */
#define SIM_LM_NEAR_TIE_EPS 5e-4
/* No end-of-sequence token before this many tokens have been generated. */
#define SIM_LM_MIN_TOKENS_BEFORE_EOS 4
#define SIM_LM_TOKEN_EOS (-1)

typedef struct {
    uint64_t model_key; /* from the checkpoint hash */
    uint64_t quant_key; /* from (quantization, dtype) */
} sim_lm_t;

/* A tokenised prompt: an order-sensitive hash of its tokens and their count. */
typedef struct {
    uint64_t hash;
    uint32_t ntokens;
} sim_prompt_t;

typedef struct {
    double temperature; /* 0: greedy argmax */
    double top_p;       /* (0, 1]; 1 disables */
    int32_t top_k;      /* <= 0 disables */
    uint32_t max_tokens;
    uint64_t sample_seed; /* seeds the sampling PRNG; ignored when temperature is 0 */
} sim_gen_params_t;

/* Batching noise as seen by one step: flip probability, generations running now, and 64 bits
 * from a non-deterministic source for the coin. */
typedef struct {
    double p;
    unsigned inflight;
    uint64_t rnd;
} sim_noise_t;

typedef enum {
    SIM_FINISH_NONE = 0,
    SIM_FINISH_LENGTH, /* max_tokens reached */
    SIM_FINISH_STOP,   /* end-of-sequence token */
} sim_finish_t;

/* What one step produced. */
typedef struct {
    int32_t token;  /* vocabulary index, or SIM_LM_TOKEN_EOS */
    bool near_tied; /* the top two candidates were within SIM_LM_NEAR_TIE_EPS */
    bool flipped;   /* noise replaced the best token by the runner-up */
} sim_step_t;

/* One generation in progress. Plain data: copy it, keep it anywhere, no free needed. */
typedef struct {
    sim_lm_t lm;
    sim_gen_params_t params;
    uint64_t prompt_hash;
    uint64_t rng;
    uint32_t step;       /* tokens generated so far */
    int32_t last[3];     /* most recent token first; -2 = none */
    sim_finish_t finish; /* SIM_FINISH_NONE while running */
} sim_gen_t;

/* Identity of a model. Strings are hashed, not kept. */
void sim_lm_init(sim_lm_t *lm, const char *checkpoint_sha256, const char *quantization,
                 const char *dtype);

size_t sim_lm_vocab_size(void);
/* The word for a vocabulary index (NULL when out of range or EOS). */
const char *sim_lm_word(int32_t token);

void sim_prompt_init(sim_prompt_t *p);
/* Append text, split on ASCII whitespace; each word is one token. */
void sim_prompt_add_text(sim_prompt_t *p, const char *s, size_t n);
/* Append one token id (prompts given as token arrays). */
void sim_prompt_add_token(sim_prompt_t *p, int64_t token);

/* Derive the sampling seed for choice `index` of a request with seed `seed`. */
uint64_t sim_lm_sample_seed(int64_t seed, uint32_t index);

void sim_gen_init(sim_gen_t *g, const sim_lm_t *lm, const sim_prompt_t *prompt,
                  const sim_gen_params_t *params);
/* Generate the next token. Returns true and fills *out when a token was produced (EOS is
 * reported as a token too, and finishes the generation); false once finished (g->finish says
 * why). noise may be NULL. */
bool sim_gen_step(sim_gen_t *g, const sim_noise_t *noise, sim_step_t *out);

/* Logits of the next step, for tests: fills out[0..sim_lm_vocab_size()] (the last one is EOS).
 * Returns whether this step is a near tie. */
bool sim_gen_logits(const sim_gen_t *g, double *out);

/* 64-bit mixing hash helpers, exposed for the server's ids. */
uint64_t sim_hash64(const void *p, size_t n, uint64_t seed);
uint64_t sim_mix64(uint64_t x);

#endif
