/* The CPU draw of rows with a top-k: aiocb.runner.draw's pick from a row's k largest
 * logits, one row at a time, without a sort of the vocabulary or [rows, vocab] temporaries.
 *
 * A row's k largest logits are found in two passes over it: the first takes the maxima of
 * 2k interleaved groups (element j belongs to group j mod G), the second keeps every value
 * not below the k-th largest of those maxima (at least k groups hold such a value, so the
 * row's k largest are among them); a selection and a sort of those few finish it. Then, as
 * in aiocb.runner.draw: temperature, the top-p mass over the k (a cumulative sum in double,
 * as torch's CPU cumsum accumulates), min-p, and the Gumbel-max pick with the counter-hash
 * noise of aiocb.runner.noise (the same 32-bit values; the logarithms are the C library's).
 *
 * Built by aiocb.runner.native with the system's C compiler and called through ctypes,
 * which releases the GIL for the call. Rows are split over `threads` POSIX threads.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* The k first of row x[0:n] in rank order, sorted, into buf[0:k]; gmax holds 2k + 8 floats.
 * Returns how many there are (k, or n if that is fewer). */
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
        v4f tv = {t, t, t, t};
        int64_t i = 0;
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
        count = k;
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

static inline float gumbel(uint32_t key1, uint32_t key2, int64_t id) {
    uint32_t bits = mix32(mix32((uint32_t)id ^ key1) ^ key2);
    float u = ((float)(bits >> 9) + 0.5f) * (1.0f / 8388608.0f);
    return -logf(-logf(u));
}

typedef struct {
    const float* logits;
    int64_t vocab, stride;
    const float *temperature, *top_p, *log_min_p;
    const int64_t* top_k;
    const int32_t *key1, *key2;
    int64_t* tokens;
    int64_t first, last, most_k;
} job;

static void draw_row(const job* jb, int64_t r, item* buf, float* gmax, float* scaled) {
    int64_t k = top_k(jb->logits + r * jb->stride, jb->vocab, jb->top_k[r], buf, gmax);
    float temperature = jb->temperature[r], top_p = jb->top_p[r];
    for (int64_t i = 0; i < k; i++) scaled[i] = buf[i].v / temperature;
    int nucleus = top_p < 1.0f;
    float normaliser = 0.0f;
    if (nucleus) {
        /* torch.logsumexp: the largest, plus the log of the sum of the exponentials of the
           differences (with 0 for an infinite largest) */
        float top = scaled[0];
        for (int64_t i = 1; i < k; i++) top = scaled[i] > top ? scaled[i] : top;
        float shift = isinf(top) ? 0.0f : top, total = 0.0f;
        for (int64_t i = 0; i < k; i++) total += expf(scaled[i] - shift);
        normaliser = logf(total) + shift;
    }
    float floor = jb->log_min_p ? jb->log_min_p[r] : -INFINITY;
    uint32_t key1 = (uint32_t)jb->key1[r], key2 = (uint32_t)jb->key2[r];
    double mass = 0.0; /* the cumulative probability, accumulated as torch's CPU cumsum does */
    float best = -INFINITY;
    int64_t pick = 0;
    int found = 0;
    for (int64_t i = 0; i < k; i++) {
        if (nucleus) {
            float prob = expf(scaled[i] - normaliser);
            mass += prob;
            /* the first always stays, whatever top_p is */
            if (i > 0 && !((float)mass - prob <= top_p)) continue;
        }
        if (jb->log_min_p && !(scaled[i] - scaled[0] >= floor)) continue;
        float score = scaled[i] + gumbel(key1, key2, buf[i].i);
        /* the first largest, a NaN before any number (as torch.max) */
        if (!found || score > best || (score != score && best == best)) {
            best = score;
            pick = i;
            found = 1;
        }
    }
    jb->tokens[r] = buf[pick].i;
}

static void* run(void* arg) {
    job* jb = (job*)arg;
    int64_t groups = (2 * jb->most_k + 7) / 8 * 8;
    item* buf = malloc(sizeof(item) * (size_t)jb->vocab);
    float* gmax = malloc(sizeof(float) * (size_t)groups);
    float* scaled = malloc(sizeof(float) * (size_t)jb->most_k);
    if (buf && gmax && scaled)
        for (int64_t r = jb->first; r < jb->last; r++) draw_row(jb, r, buf, gmax, scaled);
    else
        for (int64_t r = jb->first; r < jb->last; r++) jb->tokens[r] = -1;
    free(buf);
    free(gmax);
    free(scaled);
    return NULL;
}

/* Draw tokens[r] for every row r of logits [rows, vocab] (float32, rows `stride` apart),
 * with 1 <= top_k[r] <= vocab. log_min_p may be NULL. A row whose scratch memory could not
 * be allocated gets -1. */
void aiocb_draw_top_k(const float* logits, int64_t rows, int64_t vocab, int64_t stride, const float* temperature,
                      const int64_t* top_k, const float* top_p, const float* log_min_p, const int32_t* key1,
                      const int32_t* key2, int64_t* tokens, int threads) {
    enum { MOST_THREADS = 64 };
    job jobs[MOST_THREADS];
    pthread_t ids[MOST_THREADS];
    int started[MOST_THREADS] = {0};
    int64_t most_k = 1;
    for (int64_t r = 0; r < rows; r++) most_k = top_k[r] > most_k ? top_k[r] : most_k;
    /* a thread per 128 Ki logits at most: starting one costs about what a row of 4,096 does */
    int64_t worth = rows * vocab / (1 << 17);
    if (threads > worth) threads = worth > 0 ? (int)worth : 1;
    if (threads > rows) threads = (int)rows;
    if (threads > MOST_THREADS) threads = MOST_THREADS;
    if (threads < 1) threads = 1;
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job){logits, vocab, stride, temperature, top_p, log_min_p, top_k, key1, key2, tokens,
                        rows * t / threads, rows * (t + 1) / threads, most_k};
        if (t) started[t] = pthread_create(&ids[t], NULL, run, &jobs[t]) == 0;
    }
    run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run(&jobs[t]);  /* (no thread: this one does its rows) */
    }
}
