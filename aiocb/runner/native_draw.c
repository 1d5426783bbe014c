/* The CPU sampler's draws (aiocb.runner.draw's picks), one row at a time, without a sort
 * of the vocabulary or [rows, vocab] temporaries.
 *
 * A top-k row draws from its k largest logits, found in two passes over the row: the
 * first takes the maxima of 2k interleaved groups (element j belongs to group j mod G),
 * the second keeps every value not below the k-th largest of those maxima (at least k
 * groups hold such a value, so the row's k largest are among them); a selection and a
 * sort of those few finish it. Then, as in aiocb.runner.draw: temperature, the top-p mass
 * (a cumulative sum in double, as torch's CPU cumsum accumulates), min-p, and the
 * Gumbel-max pick with the counter-hash noise of aiocb.runner.noise (the same 32-bit
 * values; the logarithms are the C library's).
 *
 * A row with the temperature alone (or a min-p) draws over the whole vocabulary in one pass, hashing
 * four ids at a time and taking the logarithms only where a bound on the noise lets a
 * token win; a top-p row without a top-k does the same over the tokens at or above its
 * nucleus's smallest value, which binned sums of the probabilities find without a sort.
 *
 * Built by aiocb.runner.native with the system's C compiler and called through ctypes,
 * which releases the GIL for the call. Rows are split over up to `threads` threads (see
 * native_parallel.h).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_parallel.h"

/* 16-byte vectors: one SSE2 or NEON register, the baseline of x86-64 and aarch64 (wider ones
 * without -march flags are emulated, several times slower) */
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

typedef struct {
    float v;
    int64_t i;
} item;

/* a ranks before b: the larger value, a NaN before any number (as torch.topk), then the
 * lower index */
static inline int before(item a, item b) {
    int an = a.v != a.v, bn = b.v != b.v;
    if (__builtin_expect(an | bn, 0)) return an > bn || (an == bn && a.i < b.i);
    return a.v > b.v || (a.v == b.v && a.i < b.i);
}

static inline void swap_items(item* a, item* b) {
    item t = *a;
    *a = *b;
    *b = t;
}

static void insertion_sort(item* a, int64_t n) {
    for (int64_t j = 1; j < n; j++) {
        item x = a[j];
        int64_t m = j - 1;
        while (m >= 0 && before(x, a[m])) {
            a[m + 1] = a[m];
            m--;
        }
        a[m + 1] = x;
    }
}

/* a[lo..hi] around a median-of-three pivot; returns the pivot's final place */
static int64_t partition(item* a, int64_t lo, int64_t hi) {
    int64_t mid = lo + (hi - lo) / 2;
    if (before(a[mid], a[lo])) swap_items(&a[mid], &a[lo]);
    if (before(a[hi], a[lo])) swap_items(&a[hi], &a[lo]);
    if (before(a[mid], a[hi])) swap_items(&a[mid], &a[hi]);
    item p = a[hi];
    int64_t s = lo;
    for (int64_t j = lo; j < hi; j++)
        if (before(a[j], p)) swap_items(&a[j], &a[s++]);
    swap_items(&a[s], &a[hi]);
    return s;
}

/* the k first of a[0:n] in rank order become a[0:k] (in no order) */
static void select_first(item* a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (hi - lo > 16) {
        int64_t s = partition(a, lo, hi);
        if (s == k - 1 || s == k) return;
        if (s < k)
            lo = s + 1;
        else
            hi = s - 1;
    }
    insertion_sort(a + lo, hi - lo + 1);
}

static void sort_items(item* a, int64_t n) {
    while (n > 24) {
        int64_t s = partition(a, 0, n - 1);
        if (s < n - 1 - s) {  /* recurse into the smaller side: depth stays logarithmic */
            sort_items(a, s);
            a += s + 1;
            n -= s + 1;
        } else {
            sort_items(a + s + 1, n - s - 1);
            n = s;
        }
    }
    insertion_sort(a, n);
}

/* the k-th largest of v[0:n] (numbers, no NaN), reordering v */
static float kth_largest(float* v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float p = v[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > p) i++;
            while (v[j] < p) j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return v[want];
    }
    return v[want];
}

static inline v4f load4(const float* p) {
    v4f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store4(float* p, v4f v) { memcpy(p, &v, sizeof v); }

static inline v4f max4(v4f a, v4f b) { /* a NaN in a is passed over */
    v4i gt = a > b;
    return (v4f)(((v4i)a & gt) | ((v4i)b & ~gt));
}

/* The k first of row x[0:n] in rank order, and every later one tied with the k-th (as
 * transformers' top-k keeps them), sorted, into buf; gmax holds 2k + 8 floats. Returns how
 * many there are (k or more, or n if that is fewer). */
static int64_t top_k(const float* x, int64_t n, int64_t k, item* buf, float* gmax) {
    int64_t count = 0;
    int64_t groups = (2 * k + 7) / 8 * 8;
    if (n < 4 * groups) {
        for (int64_t j = 0; j < n; j++) buf[j] = (item){x[j], j};
        count = n;
    } else {
        for (int64_t g = 0; g < groups; g++) gmax[g] = -INFINITY;
        int64_t j = 0;
        /* (in the row's order: the first read of a row comes from memory, at the prefetcher's pace) */
        for (; j + groups <= n; j += groups)
            for (int64_t g = 0; g < groups; g += 4) store4(gmax + g, max4(load4(x + j + g), load4(gmax + g)));
        for (int64_t g = 0; j + g < n; g++) gmax[g] = x[j + g] > gmax[g] ? x[j + g] : gmax[g];
        float t = kth_largest(gmax, groups, k);
        /* Fewer than k finite logits (a grammar's or an allow-list's row): the masked ones
         * can never be drawn, and are left out (all of them would tie at -inf). */
        if (t == -INFINITY) {
            for (int64_t m = 0; m < n; m++)
                if (!(x[m] == -INFINITY)) buf[count++] = (item){x[m], m};
            if (count == 0) buf[count++] = (item){x[0], 0}; /* (all masked: the first, as a sort ranks it) */
        }
        v4f tv = {t, t, t, t};
        int64_t i = t == -INFINITY ? n : 0;
        for (; i + 16 <= n; i += 16) {
            /* (a NaN is never below t: it is kept, and ranks first) */
            v4i hit = ~((load4(x + i) < tv) & (load4(x + i + 4) < tv) & (load4(x + i + 8) < tv) & (load4(x + i + 12) < tv));
            uint64_t w[2];
            memcpy(w, &hit, sizeof w);
            if (__builtin_expect(!(w[0] | w[1]), 1)) continue;
            for (int64_t m = i; m < i + 16; m++)
                if (!(x[m] < t)) buf[count++] = (item){x[m], m};
        }
        for (; i < n; i++)
            if (!(x[i] < t)) buf[count++] = (item){x[i], i};
    }
    if (count > k) {
        select_first(buf, count, k);
        /* (every token equal to the k-th is at least the threshold t: it is in buf) */
        float kth = buf[0].v;
        for (int64_t j = 1; j < k; j++) kth = buf[j].v < kth ? buf[j].v : kth;
        int64_t kept = k;
        if (kth != -INFINITY) /* (masked tokens are never drawn: no need to keep them all) */
            for (int64_t j = k; j < count; j++)
                if (buf[j].v == kth) swap_items(&buf[j], &buf[kept++]);
        count = kept;
    }
    sort_items(buf, count);
    return count;
}

/* aiocb.runner.noise: lowbias32 */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352DU;
    x ^= x >> 15;
    x *= 0x846CA68BU;
    return x ^ (x >> 16);
}

/* aiocb.runner.noise._row_keys: the two keys of a row's noise, from its seed (32-bit) and
 * its offset (the tokens it generated before) */
static inline void row_keys(int64_t seed, int64_t offset, uint32_t* key1, uint32_t* key2) {
    uint32_t first = mix32(mix32((uint32_t)seed) ^ mix32(mix32((uint32_t)(offset + 0x9E3779B9LL))));
    *key1 = first;
    *key2 = mix32(first ^ 0x5BD1E995U);
}

/* mix32's inverse (lowbias32 is a bijection: its multipliers' inverses mod 2**32) */
static inline uint32_t unmix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x43021123U;
    x ^= (x >> 15) ^ (x >> 30);
    x *= 0x1D69E2A5U;
    return x ^ (x >> 16);
}

/* the 32-bit noise value of vocabulary id `id` in the row with keys key1, key2 */
static inline uint32_t noise_bits(uint32_t key1, uint32_t key2, uint32_t id) { return mix32(mix32(id ^ key1) ^ key2); }

/* aiocb.runner.noise.gumbel_of_bits: the same float32 operations in the same order (every
 * one IEEE-rounded but the logs): x = (~bits + 0.5) / 2**32 below 1, E = x * (-log(w) / (1 - w))
 * with w = 1 - x (the ratio 1 where w is 1), then -log(E) */
static inline float gumbel_of(uint32_t bits) {
    float x = ((float)(~bits) + 0.5f) * 0x1p-32f;
    if (x > 0x1.fffffep-1f) x = 0x1.fffffep-1f;
    float w = 1.0f - x;
    float ratio = w == 1.0f ? 1.0f : -logf(w) / (1.0f - w);
    return -logf(x * ratio);
}

/* Above the noise of every value whose top 8 bits are b: the noise is increasing in the
 * bits, so the bucket's largest value bounds it (plus room for the logarithms' rounding). */
static float noise_ceiling[256];
/* The noise's tail: the TAIL values of the bits from 2**32 - TAIL up, whose noise is past
 * body_ceiling (about 16.6); the ids that draw them in a row are found by inverting the
 * hash (some 0.01 of them in a vocabulary of 151,936), so that a whole-vocabulary draw
 * need not hash the tokens that only such noise could make win. */
#define TAIL 256U
static float body_ceiling;
static pthread_once_t ceiling_once = PTHREAD_ONCE_INIT;

static void fill_noise_ceiling(void) {
    for (uint32_t b = 0; b < 256; b++) noise_ceiling[b] = gumbel_of((b << 24) | 0xFFFFFFU) + 1e-3f;
    body_ceiling = gumbel_of(0xFFFFFFFFU - TAIL) + 1e-3f;
}

typedef struct {
    const float* logits;
    int64_t vocab, stride;
    const float *temperature, *top_p, *log_min_p;
    const int64_t* top_k; /* NULL: the draw over the whole vocabulary */
    const int64_t *seed, *offset;
    int64_t* tokens;
    int64_t first, last, most_k;
} job;

/* aiocb.runner.noise.gumbel_argmax: argmax of x / T + noise over a whole row, the first
 * index on ties, the first NaN if there is one; tokens with x / T below `floor`, or (with
 * `min_p`) more than `log_min_p` below `top`, take no part. A value's logarithms are taken
 * only when its bound (its bucket's noise_ceiling) beats the best score so far: a few
 * dozen a row. Tokens that only noise from the tail could make win are not hashed at all:
 * the tail's ids are looked at after the scan. */
static int64_t whole_argmax(const float* x, int64_t n, float temperature, uint32_t key1, uint32_t key2, float floor,
                            int min_p, float top, float log_min_p) {
    typedef uint32_t v4u __attribute__((vector_size(16)));
    v4i lane = {0, 1, 2, 3}, first = {(int32_t)key1, (int32_t)key1, (int32_t)key1, (int32_t)key1};
    v4i second = {(int32_t)key2, (int32_t)key2, (int32_t)key2, (int32_t)key2};
    v4f t = {temperature, temperature, temperature, temperature}, lowest = {floor, floor, floor, floor};
    float best = -INFINITY, most_noise = body_ceiling;
    int64_t pick = 0, i = 0;
    for (; i + 4 <= n; i += 4) {
        v4f scaled = load4(x + i) / t;
        /* values too small to win even with the largest noise below the tail skip the hash */
        v4f beat = {best, best, best, best};
        v4i near = ((scaled + most_noise > beat) & (scaled >= lowest)) | (scaled != scaled);
        uint64_t w[2];
        memcpy(w, &near, sizeof w);
        if (!(w[0] | w[1])) continue;
        /* the noise bits of four ids at once: mix32 on vectors (logical shifts on unsigned) */
        v4u h = (v4u)((lane + (int32_t)i) ^ first);
        h ^= h >> 16, h *= 0x7FEB352DU, h ^= h >> 15, h *= 0x846CA68BU, h ^= h >> 16;
        h ^= (v4u)second;
        h ^= h >> 16, h *= 0x7FEB352DU, h ^= h >> 15, h *= 0x846CA68BU, h ^= h >> 16;
        v4f bound = {scaled[0] + noise_ceiling[h[0] >> 24], scaled[1] + noise_ceiling[h[1] >> 24],
                     scaled[2] + noise_ceiling[h[2] >> 24], scaled[3] + noise_ceiling[h[3] >> 24]};
        v4i look = ((bound > beat) & (scaled >= lowest)) | (scaled != scaled);
        memcpy(w, &look, sizeof w);
        if (__builtin_expect(!(w[0] | w[1]), 1)) continue;
        for (int l = 0; l < 4; l++) {
            if (scaled[l] != scaled[l]) return i + l;
            if (scaled[l] < floor || (min_p && !(scaled[l] - top >= log_min_p))) continue;
            float score = scaled[l] + gumbel_of(h[l]);
            if (score > best) {
                best = score;
                pick = i + l;
            }
        }
    }
    for (; i < n; i++) {
        float scaled = x[i] / temperature;
        if (scaled != scaled) return i;
        if (scaled < floor || (min_p && !(scaled - top >= log_min_p))) continue;
        float score = scaled + gumbel_of(noise_bits(key1, key2, (uint32_t)i));
        if (score > best) {
            best = score;
            pick = i;
        }
    }
    /* The tail's ids, whatever the scan skipped (the first index still wins a tie). */
    for (uint32_t b = 0; b < TAIL; b++) {
        uint32_t bits = 0xFFFFFFFFU - b, id = unmix32(unmix32(bits) ^ key2) ^ key1;
        if ((int64_t)id >= n) continue;
        float scaled = x[id] / temperature;
        if (scaled < floor || (min_p && !(scaled - top >= log_min_p))) continue;
        float score = scaled + gumbel_of(bits);
        if (score > best || (score == best && (int64_t)id < pick)) {
            best = score;
            pick = id;
        }
    }
    return pick;
}

/* torch.logsumexp of v[0:n]: the largest, plus the log of the sum of the exponentials of
 * the differences (with 0 for an infinite largest) */
static float log_sum_exp(const float* v, int64_t n) {
    float top = v[0];
    for (int64_t i = 1; i < n; i++) top = v[i] > top ? v[i] : top;
    float shift = isinf(top) ? 0.0f : top, total = 0.0f;
    for (int64_t i = 0; i < n; i++) total += expf(v[i] - shift);
    return logf(total) + shift;
}

/* whether a token whose probability is `weight` stays in a nucleus of `top_p` when the
 * tokens before it hold `mass` (below top_p, as transformers'): torch's mass before it,
 * (its cumsum) - weight in float */
static inline int fits(double mass, float weight, float top_p) { return (float)(mass + weight) - weight < top_p; }

/* The bins of nucleus_floor: BINS of equal width over the values within SPAN of the row's
 * largest (a token further below has a probability under e^-40 of the largest's), and one
 * for the rest. */
enum { BINS = 4096 };
#define SPAN 40.0f

/* The smallest value x / temperature of a row's top-p nucleus (the tokens, by decreasing
 * value, whose probability mass before them is below top_p, the first always; the caller
 * keeps the tokens tied with it too), NaN if
 * the row holds a NaN; `top` receives the largest value. No sort of the row: one pass
 * finds the largest, one sums the exponentials into the softmax normaliser and into bins
 * of equal width in value, and a third collects the tokens of the bin where the mass
 * passes top_p, which are sorted and walked with torch's probabilities. */
static float nucleus_floor(const float* x, int64_t n, float temperature, float top_p, double* bins, item* buf,
                           float* top_out) {
    float top = -INFINITY;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        float scaled = x[i] / temperature;
        nan |= scaled != scaled;
        top = scaled > top ? scaled : top;
    }
    *top_out = top;
    if (nan) return NAN;
    if (isinf(top)) return top; /* (all masked: every token ties; an infinite one: it alone) */
    float scale = BINS / SPAN;
    memset(bins, 0, sizeof(double) * (BINS + 1));
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) {
        float scaled = x[i] / temperature, e = expf(scaled - top), distance = (top - scaled) * scale;
        total += e;
        bins[distance < BINS ? (int)distance : BINS] += e;
    }
    float normaliser = (float)log(total) + top; /* torch.logsumexp's, in double */
    double taken = 0.0;
    int bin = 0;
    while (bin < BINS && taken + bins[bin] / total <= top_p) taken += bins[bin++] / total;
    if (bin == BINS && taken + bins[BINS] / total <= top_p) return -INFINITY; /* (the whole row) */
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        float scaled = x[i] / temperature, distance = (top - scaled) * scale;
        if ((distance < BINS ? (int)distance : BINS) == bin) buf[count++] = (item){scaled, i};
    }
    sort_items(buf, count);
    for (int64_t j = 0; j < count; j++) {
        float prob = expf(buf[j].v - normaliser);
        if (!fits(taken, prob, top_p) && (bin > 0 || j > 0)) return j > 0 ? buf[j - 1].v : nextafterf(buf[0].v, INFINITY);
        taken += prob;
    }
    return buf[count - 1].v;
}

/* A row with a top-k, a top-p or both (aiocb.runner.draw: the filters, then the Gumbel-max
 * pick): a top-k row from its k largest, a top-p row without one over the tokens its
 * nucleus keeps (nucleus_floor). */
static void draw_filtered_row(const job* jb, int64_t r, item* buf, float* gmax, float* scaled, double* bins) {
    const float* x = jb->logits + r * jb->stride;
    int64_t n = jb->vocab, k = jb->top_k[r];
    float temperature = jb->temperature[r], top_p = jb->top_p[r];
    float floor = jb->log_min_p ? jb->log_min_p[r] : -INFINITY;
    uint32_t key1, key2;
    row_keys(jb->seed[r], jb->offset[r], &key1, &key2);
    if (k <= 0 || k >= n) {
        float top, smallest = nucleus_floor(x, n, temperature, top_p, bins, buf, &top);
        jb->tokens[r] = whole_argmax(x, n, temperature, key1, key2, smallest, jb->log_min_p != NULL, top, floor);
        return;
    }
    int nucleus = top_p < 1.0f;
    int64_t count = top_k(x, n, k, buf, gmax);
    for (int64_t i = 0; i < count; i++) scaled[i] = buf[i].v / temperature;
    /* the nucleus's smallest value: the tokens tied with it stay too */
    float smallest = -INFINITY;
    if (nucleus) {
        float normaliser = log_sum_exp(scaled, count);
        double mass = 0.0;
        for (int64_t i = 0; i < count; i++) {
            float prob = expf(scaled[i] - normaliser);
            if (i > 0 && !fits(mass, prob, top_p)) break; /* (the first always stays, whatever top_p is) */
            smallest = scaled[i];
            mass += prob;
        }
    }
    float best = -INFINITY;
    int64_t pick = 0;
    int found = 0;
    for (int64_t i = 0; i < count; i++) {
        if (nucleus && !(scaled[i] >= smallest)) continue;
        if (jb->log_min_p && !(scaled[i] - scaled[0] >= floor)) continue;
        uint32_t bits = noise_bits(key1, key2, (uint32_t)buf[i].i);
        /* no logarithms for a candidate that cannot win even with its bucket's largest noise */
        if (found && scaled[i] == scaled[i] && !(scaled[i] + noise_ceiling[bits >> 24] > best)) continue;
        float score = scaled[i] + gumbel_of(bits);
        /* the first largest, a NaN before any number (as torch.max) */
        if (!found || score > best || (score != score && best == best)) {
            best = score;
            pick = i;
            found = 1;
        }
    }
    jb->tokens[r] = buf[pick].i;
}

/* A row with the temperature alone, or with a min-p too (against the row's largest value,
 * as aiocb.runner.draw's candidates apply it: a difference of logits). */
static void draw_whole_row(const job* jb, int64_t r) {
    const float* x = jb->logits + r * jb->stride;
    float temperature = jb->temperature[r], top = -INFINITY;
    int min_p = jb->log_min_p != NULL;
    if (min_p)
        for (int64_t i = 0; i < jb->vocab; i++) {
            float scaled = x[i] / temperature;
            top = scaled > top ? scaled : top;
        }
    uint32_t key1, key2;
    row_keys(jb->seed[r], jb->offset[r], &key1, &key2);
    float log_min_p = min_p ? jb->log_min_p[r] : 0.0f;
    /* min-p's cut as a floor too, loosened by its rounding (the exact test follows), so
     * that the tokens below it skip the hash: with the noise reaching 22.9, most of a
     * peaked row's vocabulary is otherwise hashed */
    float floor = min_p && isfinite(top) && isfinite(log_min_p)
                      ? top + log_min_p - (fabsf(top) + fabsf(log_min_p)) * 1e-6f - 1e-6f
                      : -INFINITY;
    jb->tokens[r] = whole_argmax(x, jb->vocab, temperature, key1, key2, floor, min_p, top, log_min_p);
}

static void run(const job* jb) {
    if (!jb->top_k) {
        for (int64_t r = jb->first; r < jb->last; r++)
            draw_whole_row(jb, r);
        return;
    }
    int64_t groups = (2 * jb->most_k + 7) / 8 * 8;
    item* buf = malloc(sizeof(item) * (size_t)jb->vocab);
    float* gmax = malloc(sizeof(float) * (size_t)groups);
    float* scaled = malloc(sizeof(float) * (size_t)jb->vocab); /* (a top-k's ties may go past k) */
    double* bins = malloc(sizeof(double) * (BINS + 1));
    if (buf && gmax && scaled && bins)
        for (int64_t r = jb->first; r < jb->last; r++) draw_filtered_row(jb, r, buf, gmax, scaled, bins);
    else
        for (int64_t r = jb->first; r < jb->last; r++) jb->tokens[r] = -1;
    free(buf);
    free(gmax);
    free(scaled);
    free(bins);
}

typedef struct {
    job shape;
    int64_t rows;
} draw_rows;

static void draw_part(void* arg, int index, int count) {
    const draw_rows* all = (const draw_rows*)arg;
    job part = all->shape;
    part.first = all->rows * index / count;
    part.last = all->rows * (index + 1) / count;
    run(&part);
}

/* the rows of `shape` split over up to `threads` threads (see native_parallel.h) */
static void run_rows(job shape, int64_t rows, int threads) {
    pthread_once(&ceiling_once, fill_noise_ceiling);
    /* a thread per 128 Ki logits at most: waking one costs about what a row of 4,096 does */
    const int64_t worth = rows * shape.vocab / (1 << 17);
    if (threads > worth) threads = worth > 0 ? (int)worth : 1;
    if (threads > rows) threads = (int)rows;
    draw_rows all = {shape, rows};
    aiocb_parallel(draw_part, &all, threads);
}

/* Draw tokens[r] for every row r of logits [rows, vocab] (float32, rows `stride` apart),
 * each with a top-k (top_k[r] in [1, vocab)), a top-p (top_p[r] < 1) or both, the noise
 * of seed[r] (32-bit) at offset[r]. log_min_p may be NULL. A row whose scratch memory could not be allocated gets -1. */
void aiocb_draw_filtered(const float* logits, int64_t rows, int64_t vocab, int64_t stride, const float* temperature,
                         const int64_t* top_k, const float* top_p, const float* log_min_p, const int64_t* seed,
                         const int64_t* offset, int64_t* tokens, int threads) {
    int64_t most_k = 1; /* the largest top-k */
    for (int64_t r = 0; r < rows; r++)
        if (top_k[r] < vocab) most_k = top_k[r] > most_k ? top_k[r] : most_k;
    job shape = {logits, vocab, stride, temperature, top_p, log_min_p, top_k, seed, offset, tokens, 0, 0, most_k};
    run_rows(shape, rows, threads);
}

/* Draw tokens[r] for every row r of logits [rows, vocab] from the whole vocabulary, at
 * temperature[r], with a min-p where log_min_p is not NULL (no top-k or top-p). */
void aiocb_draw_whole(const float* logits, int64_t rows, int64_t vocab, int64_t stride, const float* temperature,
                      const float* log_min_p, const int64_t* seed, const int64_t* offset, int64_t* tokens,
                      int threads) {
    job shape = {logits, vocab, stride, temperature, NULL, log_min_p, NULL, seed, offset, tokens, 0, 0, 1};
    run_rows(shape, rows, threads);
}
