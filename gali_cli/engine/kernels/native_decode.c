/* One decoded query's attention over the KV cache on the CPU, for the static decoding step (gali_decode_attention and
 * gali_merge_runs; native_decode.py calls them): each key rotated as it is read, GALI's noise drawn as it goes
 * (native_common.h's, as the prefill's noisy softmax draws it), an online softmax over tiles of keys; keys and values
 * stored in float32, or in 16 bits (float16, bfloat16) widened to float32 as each row is loaded.
 *
 * Built at first use by native_library.py with the other kernels into one library, and held to the PyTorch path
 * before it is used.
 */
#include "native_common.h"

#define TILE 64        /* keys whose logits are held at once */
#define MAX_GROUP 16   /* query heads per key head */
#define MAX_DIM 256    /* head dim, a multiple of LANES */

/* How the KV cache stores its keys and values (native_decode.py's KV_KINDS): float32, or 16-bit rows (--kv-dtype,
 * half the memory) widened to float32 as they are loaded. */
#define KV_FLOAT32 0
#define KV_FLOAT16 1
#define KV_BFLOAT16 2

/* An IEEE half as a float, exactly (subnormals, infinities and NaN too) and without branches, so that a loop over a
 * row vectorises: the half's exponent and mantissa shifted into a float's place, scaled by 2^112 (the difference of
 * the two exponent biases), which also makes a half's subnormal a normal float. */
static inline float half_to_float(uint16_t half) {
    uint32_t sign = (uint32_t)(half & 0x8000u) << 16, rest = half & 0x7FFFu;
    uint32_t bits = rest >= 0x7C00u ? (rest << 13) | 0x7F800000u : to_bits(from_bits(rest << 13) * 0x1p112f);
    return from_bits(bits | sign);
}

/* dim halves (a multiple of 16) widened into floats: eight at a time by the CPU's own instruction where it has one
 * (F16C: exact, as every half is a float), else by half_to_float (the compiler does not vectorise it well: it made
 * a float16 cache's attention 1.6x the float32 one's on AVX2). */
#if defined(__F16C__)
#include <immintrin.h>
static inline void widen_halves(const uint16_t *restrict row, int64_t dim, float *restrict into) {
    for (int64_t d = 0; d < dim; d += 8)
        _mm256_storeu_ps(into + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + d))));
}
#else
static inline void widen_halves(const uint16_t *restrict row, int64_t dim, float *restrict into) {
    for (int64_t d = 0; d < dim; d++) into[d] = half_to_float(row[d]);
}
#endif

/* dim bfloat16s (a multiple of 16) widened into floats, each a float's upper half: eight at a time with AVX2 (the
 * plain loop left a bfloat16 cache's attention 1.15x the float32 one's), else one at a time. */
#if defined(__AVX2__)
static inline void widen_bfloat16s(const uint16_t *restrict row, int64_t dim, float *restrict into) {
    for (int64_t d = 0; d < dim; d += 8) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + d)));
        _mm256_storeu_ps(into + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
}
#else
static inline void widen_bfloat16s(const uint16_t *restrict row, int64_t dim, float *restrict into) {
    for (int64_t d = 0; d < dim; d++) into[d] = from_bits((uint32_t)row[d] << 16);
}
#endif

/* Row n (stride `stride` elements) of a key head's keys or values as float32: the stored floats in place, or a 16-bit
 * row widened into `into` (dim floats). Inlined where `kind` is a constant KV_FLOAT32, it is the pointer alone. */
static inline __attribute__((always_inline)) const float *row_floats(const void *base, int64_t n, int64_t stride,
                                                                     int kind, int64_t dim, float *restrict into) {
    if (kind == KV_FLOAT32) return (const float *)base + n * stride;
    const uint16_t *row = (const uint16_t *)base + n * stride;
    if (kind == KV_FLOAT16)
        widen_halves(row, dim, into);
    else
        widen_bfloat16s(row, dim, into);
    return into;
}

/* a . b over dim floats, dim a multiple of VECTOR */
static inline float vector_dot(const float *restrict a, const float *restrict b, int64_t dim) {
    floats sum = load_floats(a) * load_floats(b);
    for (int64_t d = VECTOR; d < dim; d += VECTOR) sum += load_floats(a + d) * load_floats(b + d);
    return lanes_sum(sum);
}

/* Keys [start, end) of one key head for its `group` query rows (row r at q + r * q_stride), keys and values stored
 * as `kind` says (row_floats): an online softmax over tiles of TILE keys, each key rotated first where cos/sin are
 * given ([k1, k2] -> [k1 c - k2 s, k2 c + k1 s], c and s `half` values: the table's row j for key j, or row
 * table_row[j] where that is given, and then, where mix[j] is not 0, interpolated towards the next row by mix[j]),
 * GALI's noise added after scaling where sigma is given (the draw of noise.standard_normal for the row's hash and
 * key j, times sigma[j]). Writes the rows' normalised outputs and log-sum-exps (-inf for an empty run). Always
 * inlined: its callers pass the stored type and the common head dims as literals, and the loops over dim are then
 * unrolled (10% faster on SmolLM2's heads). */
static inline __attribute__((always_inline)) void decode_run(
    const float *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v, int64_t v_stride, int kind,
    const float *cos, const float *sin, int64_t table_stride, const int32_t *table_row, const float *mix,
    const float *sigma, const uint32_t *row_hash, int64_t group, int64_t dim, int64_t start, int64_t end,
    float scale, float *out, float *lse) {
    const int64_t half = dim / 2;
    float acc[MAX_GROUP][MAX_DIM], top[MAX_GROUP], total[MAX_GROUP];
    float logits[MAX_GROUP][TILE], turned[MAX_DIM], strength[TILE], widened[MAX_DIM];
    for (int64_t r = 0; r < group; r++) {
        top[r] = -__builtin_inff();
        total[r] = 0.0f;
        for (int64_t d = 0; d < dim; d++) acc[r][d] = 0.0f;
    }
    for (int64_t first = start; first < end; first += TILE) {
        int64_t n = end - first < TILE ? end - first : TILE;
        for (int64_t t = 0; t < n; t++) {
            const float *key = row_floats(k, first + t, k_stride, kind, dim, widened);
            if (cos) {
                int64_t row = table_row ? table_row[first + t] : first + t;
                const float *restrict c = cos + row * table_stride, *restrict s = sin + row * table_stride;
                float w = mix ? mix[first + t] : 0.0f;
                if (w != 0.0f) { /* GALI: (1 - w) R(p) + w R(p - 1), the next row, mixed as the key turns */
                    const float *restrict c1 = c + table_stride, *restrict s1 = s + table_stride;
                    for (int64_t d = 0; d < half; d++) {
                        float cd = c[d] + w * (c1[d] - c[d]), sd = s[d] + w * (s1[d] - s[d]);
                        turned[d] = key[d] * cd - key[d + half] * sd;
                        turned[d + half] = key[d + half] * cd + key[d] * sd;
                    }
                } else {
                    for (int64_t d = 0; d < half; d++) {
                        turned[d] = key[d] * c[d] - key[d + half] * s[d];
                        turned[d + half] = key[d + half] * c[d] + key[d] * s[d];
                    }
                }
                key = turned;
            }
            for (int64_t r = 0; r < group; r++) logits[r][t] = vector_dot(q + r * q_stride, key, dim) * scale;
        }
        for (int64_t r = 0; r < group; r++)
            for (int64_t t = n; t < TILE; t++) logits[r][t] = -__builtin_inff(); /* padding: weighs nothing */
        if (sigma) { /* keys 2m, 2m + 1 share one hashed pair of uniforms: Box-Muller's cosine and sine branches */
            for (int64_t t = 0; t < TILE; t++) strength[t] = t < n ? sigma[first + t] : 0.0f;
            for (int64_t r = 0; r < group; r++) {
                for (int64_t pair = 0; pair < TILE / 2; pair++) {
                    float cosine, sine;
                    uint32_t m = (uint32_t)((first >> 1) + pair); /* first is even: runs start on whole pairs */
                    box_muller(mix32(row_hash[r] ^ mix32(m ^ GALI_GOLDEN)), &cosine, &sine);
                    logits[r][2 * pair] += cosine * strength[2 * pair];
                    logits[r][2 * pair + 1] += sine * strength[2 * pair + 1];
                }
            }
        }
        for (int64_t r = 0; r < group; r++) {
            float lane_max[LANES], lane_sum[LANES];
            for (int lane = 0; lane < LANES; lane++) lane_max[lane] = top[r], lane_sum[lane] = 0.0f;
            for (int64_t t = 0; t < TILE; t += LANES)
                for (int lane = 0; lane < LANES; lane++)
                    lane_max[lane] = logits[r][t + lane] > lane_max[lane] ? logits[r][t + lane] : lane_max[lane];
            float maximum = lane_max[0];
            for (int lane = 1; lane < LANES; lane++) maximum = lane_max[lane] > maximum ? lane_max[lane] : maximum;
            for (int64_t t = 0; t < TILE; t += LANES)
                for (int lane = 0; lane < LANES; lane++) {
                    float numerator = exp_nonpositive(logits[r][t + lane] - maximum);
                    logits[r][t + lane] = numerator;
                    lane_sum[lane] += numerator;
                }
            float rescale = exp_nonpositive(top[r] - maximum), sum = 0.0f; /* top[r] = -inf at first: 0 */
            for (int lane = 0; lane < LANES; lane++) sum += lane_sum[lane];
            total[r] = total[r] * rescale + sum;
            for (int64_t d = 0; d < dim; d++) acc[r][d] *= rescale;
            top[r] = maximum;
        }
        for (int64_t t = 0; t < n; t++) {
            const float *value = row_floats(v, first + t, v_stride, kind, dim, widened);
            for (int64_t r = 0; r < group; r++) {
                float weight = logits[r][t];
                for (int64_t d = 0; d < dim; d++) acc[r][d] += weight * value[d];
            }
        }
    }
    for (int64_t r = 0; r < group; r++) {
        float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] = acc[r][d] * inverse;
        lse[r] = total[r] > 0.0f ? top[r] + logf(total[r]) : -__builtin_inff();
    }
}

/* The runs' partial outputs (pairs, runs, group, dim) and log-sum-exps (pairs, runs, group) of gali_decode_attention
 * merged into out (pairs, group, dim): each run weighted by exp(lse - log-sum-exp over the runs); an empty run
 * (-inf) weighs nothing, and the first run holds key 0, which every token sees. */
void gali_merge_runs(const float *partial, const float *lse, int64_t pairs, int64_t runs, int64_t group,
                     int64_t dim, float *out) {
    for (int64_t pair = 0; pair < pairs; pair++) {
        for (int64_t r = 0; r < group; r++) {
            float top = -__builtin_inff(), total = 0.0f, *row = out + (pair * group + r) * dim;
            for (int64_t run = 0; run < runs; run++) {
                float value = lse[(pair * runs + run) * group + r];
                top = value > top ? value : top;
            }
            for (int64_t d = 0; d < dim; d++) row[d] = 0.0f;
            for (int64_t run = 0; run < runs; run++) {
                float weight = exp_nonpositive(lse[(pair * runs + run) * group + r] - top);
                const float *part = partial + ((pair * runs + run) * group + r) * dim;
                total += weight;
                for (int64_t d = 0; d < dim; d++) row[d] += weight * part[d];
            }
            for (int64_t d = 0; d < dim; d++) row[d] /= total;
        }
    }
}

/* A work item of a 16-bit cache: decode_run with the type and the common head dims as constants, as for a float32
 * cache (each constant made the attention about 1.4x faster than read at run time; and the same head dims unrolled
 * for both types keep their products rounded alike, so a 16-bit cache attends exactly as a float32 one holding the
 * same rounded rows), other dims read at run time. Out of line, so that gali_decode_attention keeps the float32
 * loops as the compiler built them before 16-bit caches (in one larger function it left helpers out of line: the
 * float32 attention ran 3% slower). */
static __attribute__((noinline)) void decode_sixteen_bits(
    const float *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v, int64_t v_stride, int kind,
    const float *cos, const float *sin, int64_t table_stride, const int32_t *table_row, const float *mix,
    const float *sigma, const uint32_t *row_hash, int64_t group, int64_t dim, int64_t start, int64_t end,
    float scale, float *out, float *lse) {
#define SIXTEEN_BITS(type, width)                                                                                 \
    decode_run(q, q_stride, k, k_stride, v, v_stride, type, cos, sin, table_stride, table_row, mix, sigma, row_hash, \
               group, width, start, end, scale, out, lse)
    if (kind == KV_FLOAT16 && dim == 64)
        SIXTEEN_BITS(KV_FLOAT16, 64);
    else if (kind == KV_FLOAT16 && dim == 128)
        SIXTEEN_BITS(KV_FLOAT16, 128);
    else if (dim == 64)
        SIXTEEN_BITS(KV_BFLOAT16, 64);
    else if (dim == 128)
        SIXTEEN_BITS(KV_BFLOAT16, 128);
    else
        SIXTEEN_BITS(kind, dim);
#undef SIXTEEN_BITS
}

/* A decoded query's attention over keys 0..index of a KV cache stored as `kv_kind` says (KV_FLOAT32, KV_FLOAT16,
 * KV_BFLOAT16), as work items [item_begin, item_end) of (batch, key head, run): each key head's keys up to the index
 * are cut into `runs` runs of whole pairs, and item w = (b * kv_heads + h) * runs + run writes its rows' partial
 * output (group, dim) at out + w * group * dim and their log-sum-exps at lse + w * group, merged by the caller.
 * rows (B, Hkv, group, dim), keys and values (B, Hkv, C, dim) have contiguous last dims (strides in elements);
 * cos/sin (rows, >= dim / 2) rotate each key (NULL: attended as they are) by row j for key j, or by row table_row[j]
 * (C,) mixed with the next by mix[j] (C,) where those are given (the caller has checked that every row read lies in
 * the table); sigma (C,) and head_stream (B * H,) add GALI's noise (NULL: none). Items are shared among `threads`
 * threads as gali_noisy_softmax shares its rows. */
void gali_decode_attention(const float *rows, int64_t row_b, int64_t row_h, int64_t row_g, const void *keys,
                           int64_t key_b, int64_t key_h, int64_t key_n, const void *values, int64_t value_b,
                           int64_t value_h, int64_t value_n, int kv_kind, const float *cos, const float *sin,
                           int64_t table_n, const int32_t *table_row, const float *mix, const float *sigma,
                           const int32_t *head_stream, int64_t kv_heads, int64_t group,
                           int64_t dim, int64_t index, float scale, int64_t runs, int64_t item_begin,
                           int64_t item_end, float *out, float *lse, int threads) {
    int64_t count = index + 1, per_run = (count + runs - 1) / runs;
    per_run += per_run % 2;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t item = item_begin; item < item_end; item++) {
        int64_t pair = item / runs, run = item % runs, b = pair / kv_heads, h = pair % kv_heads;
        int64_t start = run * per_run, end = start + per_run < count ? start + per_run : count;
        uint32_t row_hash[MAX_GROUP];
        for (int64_t r = 0; sigma && r < group; r++) /* noise.py's `rows` for query head h * group + r */
            row_hash[r] = mix32((uint32_t)head_stream[b * kv_heads * group + h * group + r] ^ mix32((uint32_t)index));
        const float *q = rows + b * row_b + h * row_h;
        int64_t width = kv_kind == KV_FLOAT32 ? 4 : 2; /* bytes an element */
        const void *k = (const char *)keys + (b * key_b + h * key_h) * width;
        const void *v = (const char *)values + (b * value_b + h * value_h) * width;
        int64_t stop = start < end ? end : start;
        float *run_out = out + item * group * dim, *run_lse = lse + item * group;
        if (kv_kind != KV_FLOAT32)
            decode_sixteen_bits(q, row_g, k, key_n, v, value_n, kv_kind, cos, sin, table_n, table_row, mix, sigma,
                                row_hash, group, dim, start, stop, scale, run_out, run_lse);
        else if (dim == 64) /* the common head dims as constants (decode_run is inlined): its loops over dim unrolled */
            decode_run(q, row_g, k, key_n, v, value_n, KV_FLOAT32, cos, sin, table_n, table_row, mix, sigma, row_hash,
                       group, 64, start, stop, scale, run_out, run_lse);
        else if (dim == 128)
            decode_run(q, row_g, k, key_n, v, value_n, KV_FLOAT32, cos, sin, table_n, table_row, mix, sigma, row_hash,
                       group, 128, start, stop, scale, run_out, run_lse);
        else
            decode_run(q, row_g, k, key_n, v, value_n, KV_FLOAT32, cos, sin, table_n, table_row, mix, sigma, row_hash,
                       group, dim, start, stop, scale, run_out, run_lse);
    }
}
