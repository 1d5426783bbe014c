/* Attention on the CPU over the paged cache in place: each single-token row (decode)
 * attends over its own keys, read where the cache holds them through its block table (no
 * gathered copy of the keys); multi-token rows likewise, at the end of this file.
 *
 * The cache of a layer is [slots, kv_heads, head_dim] float32 (slot = block * page +
 * offset); row r's keys are positions first[r] .. first[r] + count[r] - 1, the block of
 * position p being table[p / page] (modulo `ring` blocks for a sliding window's ring).
 * A unit of work is one row and its query heads (up to LANES floats of them: every head,
 * in models of usual shapes): a tile of keys at a time, it scores every head against eight
 * keys at once (all KV heads of a position are contiguous in the cache, so each key is read
 * once, and eight keys' products are summed across together instead of one horizontal sum
 * per key), then adds up the tile's values head by head, the head's output held in
 * registers, with the running maximum and sum of the online softmax (flash decoding's
 * recurrence). A batch of some size reads the cache from main memory, so the loop asks
 * for its keys and values a few positions ahead.
 *
 * Built by aiocb.runner.native with the sampler's kernels and called through ctypes,
 * which releases the GIL for the call. Units are split over up to `threads` threads (see
 * native_parallel.h) by their number of keys.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_parallel.h"

/* 8-float vectors: one AVX register in the clone built for AVX2, two SSE (or NEON) ones in
 * the baseline build */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
enum { W = 8 };

#if defined(__x86_64__) && defined(__linux__)
/* one build of the kernel for AVX2 processors and one for any x86-64, picked at load time */
#define WIDE __attribute__((target_clones("avx2", "default")))
#else
#define WIDE
#endif
#define INLINE static inline __attribute__((always_inline))

/* A unit holds the query (and output) of up to MOST_UNIT_HEADS heads in LANES floats; a
 * tile of up to MOST_TILE keys, about TILE_BYTES of them (its values as many: together they
 * stay in a first-level cache), is read from the cache at a time; reads are requested
 * AHEAD keys early, a cache line (LINE floats) at a time. */
enum { LANES = 4096, MOST_UNIT_HEADS = 64, MOST_TILE = 64, TILE_BYTES = 16 << 10, AHEAD = 8, LINE = 16 };

typedef struct {
    const float* query; /* [rows, heads, dim] */
    const float* key;   /* [slots, kv_heads, dim] */
    const float* value;
    const int32_t* table; /* [.., table_stride] block ids */
    int64_t table_stride;
    const int64_t* table_row; /* [rows] row of `table` per query row; NULL: the same row */
    const int64_t* first;     /* [rows] */
    const int64_t* count;     /* [rows] */
    int64_t rows, heads, kv_heads, dim, page, ring;
    float scale, softcap;
    float* out;                /* [rows, heads, dim] */
    int64_t unit_heads, parts; /* heads per unit, units per row */
    int64_t tile;              /* keys per tile */
    int64_t keys;              /* the rows' keys in all */
    const float* sinks;        /* [heads]: a logit per head in each softmax's denominator; NULL: none */
} job;

INLINE vf load(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store(float* p, vf v) { memcpy(p, &v, sizeof v); }

/* (as a shuffle of one lane: GCC builds the vector written out element by element with an
 * insertion per element) */
INLINE vf splat(float x) {
    const vf one = {x};
    return __builtin_shuffle(one, (vi){0, 0, 0, 0, 0, 0, 0, 0});
}

INLINE float sum(vf v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* e^x for x <= 0 (x below -87 is taken as -87: a weight of about 1e-38 beside the row's
 * largest, which is 1): Cephes' expf, within two units in the last place */
INLINE vf exp_of(vf x) {
    const vf lowest = splat(-87.0f);
    const vi below = x < lowest; /* (a NaN stays: it compares false) */
    x = (vf)(((vi)lowest & below) | ((vi)x & ~below));
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * 1.44269504088896341f + magic) - magic;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf y = 1.9875691500e-4f * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    return y * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

INLINE float dot(const float* a, const float* b, int64_t dim) {
    vf s0 = {0}, s1 = {0};
    int64_t i = 0;
    for (; i + 2 * W <= dim; i += 2 * W) {
        s0 += load(a + i) * load(b + i);
        s1 += load(a + i + W) * load(b + i + W);
    }
    if (i + W <= dim) {
        s0 += load(a + i) * load(b + i);
        i += W;
    }
    float s = sum(s0 + s1);
    for (; i < dim; i++) s += a[i] * b[i];
    return s;
}

/* [a0 + a1, a2 + a3, b0 + b1, b2 + b3, a4 + a5, a6 + a7, b4 + b5, b6 + b7] */
INLINE vf pair_sums(vf a, vf b) {
    const vi even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* The dot products of `q` with 8 keys (each at k[j] + offset), as one vector: each key's
 * products go to a vector of their own, and the 8 vectors are summed across at the end
 * (a fixed tree), rather than one horizontal sum per key. */
INLINE vf dot8(const float* q, const float* const* k, int64_t offset, int64_t dim) {
    vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, s4 = {0}, s5 = {0}, s6 = {0}, s7 = {0};
    int64_t i = 0;
    for (; i + W <= dim; i += W) {
        const vf x = load(q + i);
        const int64_t at = offset + i;
        s0 += x * load(k[0] + at);
        s1 += x * load(k[1] + at);
        s2 += x * load(k[2] + at);
        s3 += x * load(k[3] + at);
        s4 += x * load(k[4] + at);
        s5 += x * load(k[5] + at);
        s6 += x * load(k[6] + at);
        s7 += x * load(k[7] + at);
    }
    const vf low = pair_sums(pair_sums(s0, s1), pair_sums(s2, s3));
    const vf high = pair_sums(pair_sums(s4, s5), pair_sums(s6, s7));
    const vi first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};
    vf total = __builtin_shuffle(low, high, first) + __builtin_shuffle(low, high, second);
    for (; i < dim; i++)
        for (int j = 0; j < W; j++) total[j] += q[i] * k[j][offset + i];
    return total;
}

/* acc[0 .. dim) += sum over j < n of w[j] * v[j][offset ..], four vectors of dimensions at
 * a time held in registers over the keys */
INLINE void add_weighted(float* acc, const float* w, const float* const* v, int64_t n, int64_t offset, int64_t dim) {
    int64_t i = 0;
    for (; i + 4 * W <= dim; i += 4 * W) {
        vf a0 = load(acc + i), a1 = load(acc + i + W), a2 = load(acc + i + 2 * W), a3 = load(acc + i + 3 * W);
        for (int64_t j = 0; j < n; j++) {
            const vf x = splat(w[j]);
            const float* p = v[j] + offset + i;
            a0 += x * load(p);
            a1 += x * load(p + W);
            a2 += x * load(p + 2 * W);
            a3 += x * load(p + 3 * W);
        }
        store(acc + i, a0);
        store(acc + i + W, a1);
        store(acc + i + 2 * W, a2);
        store(acc + i + 3 * W, a3);
    }
    for (; i + W <= dim; i += W) {
        vf a = load(acc + i);
        for (int64_t j = 0; j < n; j++) a += splat(w[j]) * load(v[j] + offset + i);
        store(acc + i, a);
    }
    for (; i < dim; i++) {
        float a = acc[i];
        for (int64_t j = 0; j < n; j++) a += w[j] * v[j][offset + i];
        acc[i] = a;
    }
}

/* the largest of w[0 .. n) and `top` (a NaN is passed over) */
INLINE float largest(const float* w, int64_t n, float top) {
    vf most = splat(top);
    int64_t j = 0;
    for (; j + W <= n; j += W) {
        const vf x = load(w + j);
        most = (vf)(((vi)x & (x > most)) | ((vi)most & ~(x > most)));
    }
    for (int i = 0; i < W; i++) top = most[i] > top ? most[i] : top;
    for (; j < n; j++) top = w[j] > top ? w[j] : top;
    return top;
}

/* w[0 .. n) = e^(w - top), returning their sum */
INLINE float exponentiate(float* w, int64_t n, float top) {
    const vf shift = splat(top);
    vf total = {0};
    int64_t j = 0;
    for (; j + W <= n; j += W) {
        const vf e = exp_of(load(w + j) - shift);
        store(w + j, e);
        total += e;
    }
    float s = sum(total);
    if (j < n) {
        float rest[W] = {0};
        memcpy(rest, w + j, sizeof(float) * (size_t)(n - j));
        const vf e = exp_of(load(rest) - shift);
        for (int64_t i = 0; i < n - j; i++) {
            w[j + i] = e[i];
            s += e[i];
        }
    }
    return s;
}

/* out[i] = where position `position + i` is in the key cache, for i < n: one division per
 * call, not one per position */
INLINE void locate(const job* jb, const int32_t* table, int64_t position, int64_t n, const float** out) {
    const int64_t page = jb->page, slot_floats = jb->kv_heads * jb->dim;
    int64_t column = position / page, offset = position % page;
    for (int64_t i = 0; i < n; column++, offset = 0) {
        const int64_t block = table[jb->ring ? column % jb->ring : column];
        const float* base = jb->key + (block * page + offset) * slot_floats;
        const int64_t run = page - offset < n - i ? page - offset : n - i;
        for (int64_t k = 0; k < run; k++) out[i + k] = base + k * slot_floats;
        i += run;
    }
}

static const int32_t* table_of(const job* jb, int64_t row) {
    return jb->table + (jb->table_row ? jb->table_row[row] : row) * jb->table_stride;
}

static WIDE void attend_unit(const job* jb, int64_t unit) {
    const int64_t dim = jb->dim, per_kv = jb->heads / jb->kv_heads, tile = jb->tile;
    const int64_t row = unit / jb->parts, head0 = unit % jb->parts * jb->unit_heads;
    const int64_t heads = jb->heads - head0 < jb->unit_heads ? jb->heads - head0 : jb->unit_heads;
    const int32_t* table = table_of(jb, row);
    const int64_t first = jb->first[row], count = jb->count[row];
    const int64_t to_value = jb->value - jb->key, slot_floats = jb->kv_heads * dim;

    float q[LANES] __attribute__((aligned(32)));
    float acc[LANES] __attribute__((aligned(32)));
    float weight[MOST_UNIT_HEADS][MOST_TILE] __attribute__((aligned(32)));
    float peak[MOST_UNIT_HEADS], total[MOST_UNIT_HEADS];
    int64_t kv_offset[MOST_UNIT_HEADS]; /* where head h's KV head starts within a slot */
    /* the tile's keys and the AHEAD positions after it (read early), then the tile's values */
    const float* keys[MOST_TILE + AHEAD];
    const float* values[MOST_TILE];
    const float* source = jb->query + (row * jb->heads + head0) * dim;
    for (int64_t i = 0; i < heads * dim; i++) q[i] = source[i] * jb->scale;
    memset(acc, 0, sizeof(float) * (size_t)(heads * dim));
    for (int64_t h = 0; h < heads; h++) {
        kv_offset[h] = (head0 + h) / per_kv * dim;
        peak[h] = -INFINITY;
        total[h] = 0.0f;
    }
    for (int64_t start = 0; start < count; start += tile) {
        const int64_t n = count - start < tile ? count - start : tile;
        const int64_t known = count - start < tile + AHEAD ? count - start : tile + AHEAD;
        locate(jb, table, first + start, known, keys);
        for (int64_t j = 0; j < n; j++) values[j] = keys[j] + to_value;
        /* eight keys at a time (each read once for all heads while it is in the first-level
         * cache), then value by value */
        for (int64_t j = 0; j < n; j += W) {
            const int64_t m = n - j < W ? n - j : W;
            /* Ask for the keys AHEAD positions on, and these keys' values (read after the
             * tile's scores): a steady stream of requests keeps more of them in flight than
             * the processor's own prefetching does (about a fifth faster here, the cache
             * being read from main memory). */
            for (int64_t a = j + AHEAD; a < j + AHEAD + m && a < known; a++)
                for (int64_t b = 0; b < slot_floats; b += LINE) __builtin_prefetch(keys[a] + b, 0, 3);
            for (int64_t a = j; a < j + m; a++)
                for (int64_t b = 0; b < slot_floats; b += LINE) __builtin_prefetch(values[a] + b, 0, 3);
            if (m == W) {
                for (int64_t h = 0; h < heads; h++) store(weight[h] + j, dot8(q + h * dim, keys + j, kv_offset[h], dim));
            } else {
                for (int64_t a = j; a < j + m; a++)
                    for (int64_t h = 0; h < heads; h++) weight[h][a] = dot(q + h * dim, keys[a] + kv_offset[h], dim);
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            float* w = weight[h];
            if (jb->softcap > 0.0f)
                for (int64_t j = 0; j < n; j++) w[j] = tanhf(w[j] / jb->softcap) * jb->softcap;
            const float top = largest(w, n, peak[h]);
            /* (the first tile's keep multiplies zeros; a NaN score leaves top as it was and
             * turns the row's output to NaN through its weight, as a softmax would) */
            const float keep = peak[h] == -INFINITY ? 0.0f : expf(peak[h] - top);
            peak[h] = top;
            total[h] = total[h] * keep + exponentiate(w, n, top);
            if (keep != 1.0f)
                for (int64_t i = 0; i < dim; i++) acc[h * dim + i] *= keep;
            add_weighted(acc + h * dim, w, values, n, kv_offset[h], dim);
        }
    }
    float* target = jb->out + (row * jb->heads + head0) * dim;
    for (int64_t h = 0; h < heads; h++) {
        /* (a sink far above every score makes the sum infinite, the output the zero it tends to) */
        const float inverse = 1.0f / (jb->sinks ? total[h] + expf(jb->sinks[head0 + h] - peak[h]) : total[h]);
        for (int64_t i = 0; i < dim; i++) target[h * dim + i] = acc[h * dim + i] * inverse;
    }
}

/* Part `index` of `count` of the units, split by their keys (a unit's cost). */
static void attend_part(void* arg, int index, int count) {
    const job* jb = (const job*)arg;
    const int64_t units = jb->rows * jb->parts;
    const int64_t from = jb->keys * index / count, to = jb->keys * (index + 1) / count;
    int64_t done = 0; /* keys of the rows before the unit's */
    for (int64_t unit = 0; unit < units; unit++) {
        const int64_t keys = jb->count[unit / jb->parts];
        /* a unit belongs to the part its first key's share falls in (for every head range
         * of the row in turn, so spread over the row's keys) */
        const int64_t at = done + keys * (unit % jb->parts) / jb->parts;
        if (at >= from && at < to) attend_unit(jb, unit);
        if (unit % jb->parts == jb->parts - 1) done += keys;
    }
}

/* out[r] = softmax(query[r] . keys) . values for every row r of query [rows, heads, dim]
 * (float32), its keys the cache's positions first[r] .. first[r] + count[r] - 1 (count >= 1)
 * through block-table row table_row[r] (NULL: row r) of `table`; scores are multiplied by
 * `scale`, then capped with tanh at `softcap` when it is positive; `sinks` [heads] (NULL:
 * none) join each head's softmax denominator, weighing no value. dim <= LANES. */
void aiocb_decode_attention(const float* query, const float* key, const float* value, const int32_t* table,
                            int64_t table_stride, const int64_t* table_row, const int64_t* first,
                            const int64_t* count, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                            int64_t page, int64_t ring, float scale, float softcap, const float* sinks, float* out,
                            int threads) {
    int64_t unit_heads = LANES / dim < MOST_UNIT_HEADS ? LANES / dim : MOST_UNIT_HEADS;
    if (unit_heads > heads) unit_heads = heads;
    int64_t tile = TILE_BYTES / (int64_t)sizeof(float) / (kv_heads * dim);
    tile = tile < 8 ? 8 : tile > MOST_TILE ? MOST_TILE : tile;
    int64_t keys = 0;
    for (int64_t r = 0; r < rows; r++) keys += count[r];
    job jb = {query, key,  value,   table, table_stride, table_row,  first,
              count, rows, heads,   kv_heads, dim,       page,       ring,
              scale, softcap, out,  unit_heads, (heads + unit_heads - 1) / unit_heads, tile, keys, sinks};
    /* a thread per Mi multiply-adds at most: waking one costs about what that many do */
    const int64_t worth = keys * heads * dim / (1 << 20);
    aiocb_parallel(attend_part, &jb, threads < worth ? threads : worth > 0 ? (int)worth : 1);
}

/* ---- Multi-token rows (prompt chunks, proposed tokens): causal attention in place ----
 *
 * Row r's queries are the tokens token[r] .. token[r] + length[r] - 1 of `query`, at
 * positions start[r] .. start[r] + length[r] - 1; each attends over the row's keys at
 * positions 0 .. its own, which the step has already written to the cache. A unit of work
 * is a tile of up to `queries` consecutive queries of one row and a range of heads (a KV
 * head's group where it fits): each tile of keys is read once for all of them, while it
 * stays in the first-level cache, and each (query, head) keeps its own online softmax. */

enum { MOST_QUERIES = 32 };

typedef struct {
    job base; /* the cache, the table, the shapes, scale, softcap, out, sinks (no ring) */
    const int64_t* token;
    const int64_t* start;
    const int64_t* length;
    int64_t token_stride, head_stride; /* of the query, in floats */
    int64_t queries; /* queries per unit */
    int64_t cost;    /* every unit's cost (query-key pairs), in all */
} prefill_job;

static WIDE void prefill_unit(const prefill_job* pj, int64_t row, int64_t q0, int64_t part) {
    const job* jb = &pj->base;
    const int64_t dim = jb->dim, per_kv = jb->heads / jb->kv_heads, tile = jb->tile;
    const int64_t head0 = part * jb->unit_heads;
    const int64_t heads = jb->heads - head0 < jb->unit_heads ? jb->heads - head0 : jb->unit_heads;
    const int64_t nq = pj->length[row] - q0 < pj->queries ? pj->length[row] - q0 : pj->queries;
    const int64_t pos0 = pj->start[row] + q0, token0 = pj->token[row] + q0;
    const int64_t count = pos0 + nq; /* keys: positions 0 .. the tile's last query's */
    const int32_t* table = table_of(jb, row);
    const int64_t to_value = jb->value - jb->key;

    float q[LANES] __attribute__((aligned(32)));
    float acc[LANES] __attribute__((aligned(32)));
    float weight[MOST_TILE] __attribute__((aligned(32)));
    float peak[MOST_UNIT_HEADS], total[MOST_UNIT_HEADS]; /* per (query, head) */
    int64_t kv_offset[MOST_UNIT_HEADS];
    const float* keys[MOST_TILE];
    const float* values[MOST_TILE];
    for (int64_t i = 0; i < nq; i++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t s = i * heads + h;
            const float* source = jb->query + (token0 + i) * pj->token_stride + (head0 + h) * pj->head_stride;
            for (int64_t d = 0; d < dim; d++) q[s * dim + d] = source[d] * jb->scale;
            peak[s] = -INFINITY;
            total[s] = 0.0f;
        }
    memset(acc, 0, sizeof(float) * (size_t)(nq * heads * dim));
    for (int64_t h = 0; h < heads; h++) kv_offset[h] = (head0 + h) / per_kv * dim;
    for (int64_t first = 0; first < count; first += tile) {
        const int64_t n = count - first < tile ? count - first : tile;
        locate(jb, table, first, n, keys);
        for (int64_t j = 0; j < n; j++) values[j] = keys[j] + to_value;
        for (int64_t i = 0; i < nq; i++) {
            const int64_t seen = pos0 + i - first + 1; /* the tile's keys this query may see */
            const int64_t m = seen < n ? seen : n;
            if (m <= 0) continue;
            for (int64_t h = 0; h < heads; h++) {
                const int64_t s = i * heads + h;
                const float* qv = q + s * dim;
                int64_t j = 0;
                for (; j + W <= m; j += W) store(weight + j, dot8(qv, keys + j, kv_offset[h], dim));
                for (; j < m; j++) weight[j] = dot(qv, keys[j] + kv_offset[h], dim);
                if (jb->softcap > 0.0f)
                    for (j = 0; j < m; j++) weight[j] = tanhf(weight[j] / jb->softcap) * jb->softcap;
                const float top = largest(weight, m, peak[s]);
                const float keep = peak[s] == -INFINITY ? 0.0f : expf(peak[s] - top);
                peak[s] = top;
                total[s] = total[s] * keep + exponentiate(weight, m, top);
                float* a = acc + s * dim;
                if (keep != 1.0f)
                    for (int64_t d = 0; d < dim; d++) a[d] *= keep;
                add_weighted(a, weight, values, m, kv_offset[h], dim);
            }
        }
    }
    for (int64_t i = 0; i < nq; i++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t s = i * heads + h;
            const float inverse = 1.0f / (jb->sinks ? total[s] + expf(jb->sinks[head0 + h] - peak[s]) : total[s]);
            float* target = jb->out + ((token0 + i) * jb->heads + head0 + h) * dim;
            for (int64_t d = 0; d < dim; d++) target[d] = acc[s * dim + d] * inverse;
        }
}

/* A unit's cost: its queries' keys (the causal triangle's part in its tile). */
static int64_t prefill_cost(const prefill_job* pj, int64_t row, int64_t q0) {
    const int64_t nq = pj->length[row] - q0 < pj->queries ? pj->length[row] - q0 : pj->queries;
    const int64_t pos0 = pj->start[row] + q0;
    return nq * (pos0 + 1) + nq * (nq - 1) / 2;
}

/* Part `index` of `count` of the units, split by their cost. */
static void prefill_part(void* arg, int index, int count) {
    const prefill_job* pj = (const prefill_job*)arg;
    const int64_t from = pj->cost * index / count, to = pj->cost * (index + 1) / count;
    int64_t done = 0; /* the cost of the units before */
    for (int64_t row = 0; row < pj->base.rows; row++)
        for (int64_t q0 = 0; q0 < pj->length[row]; q0 += pj->queries) {
            const int64_t cost = prefill_cost(pj, row, q0);
            for (int64_t part = 0; part < pj->base.parts; part++) {
                /* (each head range of a tile starts at its share of the tile's cost) */
                const int64_t at = done + cost * part / pj->base.parts;
                if (at >= from && at < to) prefill_unit(pj, row, q0, part);
            }
            done += cost;
        }
}

/* Causal attention of multi-token rows over the paged cache in place: row r's queries are
 * tokens token[r] .. token[r] + length[r] - 1 of query [tokens, heads, dim] (float32, its
 * tokens and heads `token_stride` and `head_stride` floats apart, each head contiguous), at
 * positions start[r] .., each over the keys at positions 0 .. its own through block-table
 * row table_row[r] (NULL: row r) of `table` (layers without a sliding window); scores are
 * multiplied by `scale`, then capped with tanh at `softcap` when it is positive; `sinks`
 * as for single-token rows. Writes those tokens' rows of out [tokens, heads, dim]. dim <= LANES. */
void aiocb_prefill_attention(const float* query, int64_t token_stride, int64_t head_stride, const float* key,
                             const float* value, const int32_t* table, int64_t table_stride,
                             const int64_t* table_row, const int64_t* token,
                             const int64_t* start, const int64_t* length, int64_t rows, int64_t heads,
                             int64_t kv_heads, int64_t dim, int64_t page, float scale, float softcap,
                             const float* sinks, float* out, int threads) {
    const int64_t per_kv = heads / kv_heads;
    int64_t unit_heads = per_kv < MOST_UNIT_HEADS ? per_kv : MOST_UNIT_HEADS;
    if (unit_heads > LANES / dim) unit_heads = LANES / dim;
    int64_t queries = MOST_UNIT_HEADS / unit_heads;
    if (queries > LANES / (unit_heads * dim)) queries = LANES / (unit_heads * dim);
    if (queries > MOST_QUERIES) queries = MOST_QUERIES;
    int64_t tile = TILE_BYTES / (int64_t)sizeof(float) / (kv_heads * dim);
    tile = tile < 8 ? 8 : tile > MOST_TILE ? MOST_TILE : tile;
    prefill_job pj = {{query, key, value, table, table_stride, table_row, NULL, NULL, rows, heads, kv_heads, dim, page,
                       0, scale, softcap, out, unit_heads, (heads + unit_heads - 1) / unit_heads, tile, 0, sinks},
                      token, start, length, token_stride, head_stride, queries, 0};
    for (int64_t row = 0; row < rows; row++)
        for (int64_t q0 = 0; q0 < length[row]; q0 += queries) pj.cost += prefill_cost(&pj, row, q0);
    /* a thread per Mi multiply-adds at most, as for single-token rows */
    const int64_t worth = pj.cost * heads * dim / (1 << 20);
    aiocb_parallel(prefill_part, &pj, threads < worth ? threads : worth > 0 ? (int)worth : 1);
}
