/* The CPU's native kernels: GALI's logit noise added to a tile of logits with the softmax numerators, in two sweeps
 * over each row (gali_noisy_softmax, for prefill); and one decoded query's attention over the KV cache, each key
 * rotated as it is read, GALI's noise drawn as it goes (gali_decode_attention, for the static decoding step).
 *
 * Built at first use by native_library.py (the system C compiler, -O3, OpenMP where it has it; the loops are written
 * so that it vectorises them) and held to the PyTorch path (noise.py) before it is used. Keys 2m and 2m + 1 share
 * one hashed pair of uniforms (Box-Muller's cosine and sine branches): each pair is transformed once. Hash and
 * uniforms are noise.py's, bit for bit (uint32 arithmetic wraps as its masked int64 products do); log, sine, cosine
 * and exp are short polynomials after exact range reduction, so the normals agree with noise.py's to float32
 * rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

/* The noise's constants are engine/math/noise.py's, passed by the build (native_library.py) as -D flags: the noise is
 * defined in one place, and this file is held to it by the kernel checks. */
#if !defined(GALI_MULTIPLIER_A) || !defined(GALI_MULTIPLIER_B) || !defined(GALI_GOLDEN)
#error "build with gali_cli/engine/kernels/native_library.py, which passes the noise's constants"
#endif

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= GALI_MULTIPLIER_A;
    x ^= x >> 15;
    x *= GALI_MULTIPLIER_B;
    return x ^ (x >> 16);
}

static inline float from_bits(uint32_t bits) {
    union { uint32_t u; float f; } value = {bits};
    return value.f;
}

static inline uint32_t to_bits(float f) {
    union { float f; uint32_t u; } value = {f};
    return value.u;
}

/* cos(x) for |x| <= pi/4 (Taylor to x^10, error < 3e-11) */
static inline float cos_small(float x2) {
    return 1.0f + x2 * (-0.5f + x2 * (1.0f / 24 + x2 * (-1.0f / 720 + x2 * (1.0f / 40320 - x2 * (1.0f / 3628800)))));
}

/* sin(x) for |x| <= pi/4 (Taylor to x^11) */
static inline float sin_small(float x, float x2) {
    return x * (1.0f + x2 * (-1.0f / 6 + x2 * (1.0f / 120 + x2 * (-1.0f / 5040 + x2 * (1.0f / 362880 - x2 * (1.0f / 39916800))))));
}

/* The normals of one hashed pair: radius sqrt(-2 ln u) and angle 2 pi v, u and v from the top 24 bits. */
static inline void box_muller(uint32_t bits, float *cosine, float *sine) {
    float u = ((float)(bits >> 8) + 0.5f) * 5.9604644775390625e-08f; /* as noise.py: (a + 0.5) * 2**-24 */
    uint32_t word = to_bits(u);
    float mantissa = from_bits((word & 0x7FFFFFu) | 0x3F800000u); /* u = 2**e * mantissa, mantissa in [1, 2) */
    float exponent = (float)((int32_t)(word >> 23) - 127);
    int high = mantissa > 1.41421356f;
    mantissa = high ? mantissa * 0.5f : mantissa;
    exponent = high ? exponent + 1.0f : exponent;
    float t = (mantissa - 1.0f) / (mantissa + 1.0f); /* ln m = 2 atanh t, |t| < 0.172 */
    float t2 = t * t;
    float log_u = exponent * 0.69314718f + 2.0f * t * (1.0f + t2 * (1.0f / 3 + t2 * (1.0f / 5 + t2 * (1.0f / 7 + t2 * (1.0f / 9)))));
    float radius = __builtin_sqrtf(-2.0f * log_u);

    uint32_t turn = mix32(bits ^ GALI_GOLDEN) >> 8;                  /* the angle, in 2**-24 turns */
    uint32_t quadrant = turn >> 22;
    float phi = ((float)(turn & 0x3FFFFFu) * 2.384185791015625e-07f - 0.5f) * 1.5707963267948966f; /* |phi| <= pi/4 */
    float phi2 = phi * phi;
    float c = cos_small(phi2), s = sin_small(phi, phi2);
    float cos_in = (c - s) * 0.70710678118654752f, sin_in = (c + s) * 0.70710678118654752f; /* at phi + pi/4 */
    float first = (quadrant & 1u) ? sin_in : cos_in, second = (quadrant & 1u) ? cos_in : sin_in;
    *cosine = radius * ((quadrant == 1u || quadrant == 2u) ? -first : first);
    *sine = radius * ((quadrant >= 2u) ? -second : second);
}

/* exp(y) for y <= 0: 2**n * 2**f, f in (-0.5, 0.5], a degree-6 polynomial (relative error < 2e-7); 0 below -87. */
static inline float exp_nonpositive(float y) {
    float z = (y < -87.0f ? -87.0f : y) * 1.4426950408889634f;
    int32_t n = -(int32_t)(0.5f - z); /* round(z), z <= 0 */
    float f = (z - (float)n) * 0.69314718055994531f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    float scaled = p * from_bits((uint32_t)(n + 127) << 23);
    return y < -87.0f ? 0.0f : scaled;
}

/* The noisy logits of keys 2m and 2m + 1 of a row, scaled and written back; returns the larger of the two.
 * even_weight, odd_weight: sigma / (i - j) of the two keys (noise scale / T, or 0 where c = 0). */
static inline float add_pair_noise(float *row, int64_t m, float scale, uint32_t hash, int32_t index,
                                   const int32_t *pair_hash, float even_weight, float odd_weight) {
    float cosine, sine;
    box_muller(mix32(hash ^ (uint32_t)pair_hash[m]), &cosine, &sine);
    float distance = (float)(index - 2 * (int32_t)m);
    float a = row[2 * m] * scale + cosine * (distance * even_weight);
    float b = row[2 * m + 1] * scale + sine * ((distance - 1.0f) * odd_weight);
    row[2 * m] = a;
    row[2 * m + 1] = b;
    return a > b ? a : b;
}

/* Where the noise goes: key j gets sigma = (i - j) * unit where c != 0, i.e. j < grouped and j % group != 0. */
typedef struct {
    int32_t group, grouped;
    float unit;
} Grouping;

static inline float weight_of(int64_t j, int32_t residue, Grouping noisy) {
    return (j < noisy.grouped && residue != 0) ? noisy.unit : 0.0f;
}

/* One row of `keys` logits: scaled, the noise added and the maximum found; then exp(logit - maximum) and their sum. */
static void noisy_softmax_row(float *restrict row, int64_t keys, float scale, uint32_t stream, int32_t index,
                              const int32_t *pair_hash, Grouping noisy, float *top, float *total) {
    int64_t pairs = keys / 2, whole = pairs - pairs % LANES;
    uint32_t hash = mix32(stream ^ mix32((uint32_t)index)); /* noise.py's `rows` */
    float lane_max[LANES], lane_sum[LANES];
    /* j % group for the lanes' even and odd keys, stepped by 2 LANES keys at a time (no division in the loop) */
    int32_t even_residue[LANES], odd_residue[LANES], step = (2 * LANES) % noisy.group;
    for (int lane = 0; lane < LANES; lane++) {
        lane_max[lane] = -__builtin_inff();
        lane_sum[lane] = 0.0f;
        even_residue[lane] = (2 * lane) % noisy.group;
        odd_residue[lane] = (2 * lane + 1) % noisy.group;
    }
    for (int64_t start = 0; start < whole; start += LANES) {
        for (int lane = 0; lane < LANES; lane++) {
            int64_t m = start + lane;
            float larger = add_pair_noise(row, m, scale, hash, index, pair_hash,
                                          weight_of(2 * m, even_residue[lane], noisy),
                                          weight_of(2 * m + 1, odd_residue[lane], noisy));
            lane_max[lane] = larger > lane_max[lane] ? larger : lane_max[lane];
            even_residue[lane] += step;
            even_residue[lane] -= even_residue[lane] >= noisy.group ? noisy.group : 0;
            odd_residue[lane] += step;
            odd_residue[lane] -= odd_residue[lane] >= noisy.group ? noisy.group : 0;
        }
    }
    for (int64_t m = whole; m < pairs; m++) {
        float larger = add_pair_noise(row, m, scale, hash, index, pair_hash,
                                      weight_of(2 * m, (int32_t)((2 * m) % noisy.group), noisy),
                                      weight_of(2 * m + 1, (int32_t)((2 * m + 1) % noisy.group), noisy));
        lane_max[0] = larger > lane_max[0] ? larger : lane_max[0];
    }
    if (keys % 2) { /* the last key alone: the cosine branch of its pair */
        float cosine, sine;
        box_muller(mix32(hash ^ (uint32_t)pair_hash[pairs]), &cosine, &sine);
        float weight = weight_of(keys - 1, (int32_t)((keys - 1) % noisy.group), noisy);
        float a = row[keys - 1] * scale + cosine * ((float)(index - (int32_t)(keys - 1)) * weight);
        row[keys - 1] = a;
        lane_max[0] = a > lane_max[0] ? a : lane_max[0];
    }
    float maximum = lane_max[0];
    for (int lane = 1; lane < LANES; lane++) maximum = lane_max[lane] > maximum ? lane_max[lane] : maximum;
    int64_t whole_keys = keys - keys % LANES;
    for (int64_t start = 0; start < whole_keys; start += LANES) {
        for (int lane = 0; lane < LANES; lane++) {
            float numerator = exp_nonpositive(row[start + lane] - maximum);
            row[start + lane] = numerator;
            lane_sum[lane] += numerator;
        }
    }
    for (int64_t j = whole_keys; j < keys; j++) {
        float numerator = exp_nonpositive(row[j] - maximum);
        row[j] = numerator;
        lane_sum[0] += numerator;
    }
    float sum = 0.0f;
    for (int lane = 0; lane < LANES; lane++) sum += lane_sum[lane];
    *top = maximum;
    *total = sum;
}

/* Rows [row_begin, row_end) of a tile of unscaled logits q.k (row stride `stride`, `keys` columns, key j in column
 * j): scale them, add the noise, sigma = (i - j) * unit where c != 0 (key j < grouped, j % group != 0), then replace
 * each logit by exp(logit - row maximum); the row's maximum and the sum of its numerators go to top[row] and
 * total[row].
 *
 * The tile holds the query heads sharing one key head stacked, `queries` rows each, from stacked row `tile_start`:
 * its row r is query s % queries (token index first_query + s % queries) of the key head's query head s / queries,
 * s = tile_start + r, whose noise stream is head_stream[s / queries] (noise.head_streams). pair_hash[m] =
 * mix32(m ^ GOLDEN) for m < (keys + 1) / 2. Rows are shared among `threads` threads: OpenMP's, when built with it
 * (the runtime torch itself loaded, so its idle threads take the work instead of competing with it), else the
 * caller splits them. */
void gali_noisy_softmax(float *logits, int64_t stride, int64_t keys, float scale, const int32_t *head_stream,
                        int64_t queries, int64_t first_query, int64_t tile_start, const int32_t *pair_hash,
                        int32_t group, int32_t grouped, float unit, int64_t row_begin, int64_t row_end, float *top,
                        float *total, int threads) {
    Grouping noisy = {group, grouped, unit};
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t row = row_begin; row < row_end; row++) {
        int64_t stacked = tile_start + row;
        noisy_softmax_row(logits + row * stride, keys, scale, (uint32_t)head_stream[stacked / queries],
                          (int32_t)(first_query + stacked % queries), pair_hash, noisy, top + row, total + row);
    }
}

/* 1 when built with OpenMP (gali_noisy_softmax shares rows among threads itself), else 0. */
int gali_noisy_softmax_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ---- Vectors ---- */

/* VECTOR floats as one vector register (GCC's and Clang's vector extensions): AVX-512's, AVX2's, else SSE's or
 * NEON's: the loops below that compilers do not vectorise by themselves are written in them. */
#if defined(__AVX512F__)
#define VECTOR 16
#elif defined(__AVX2__)
#define VECTOR 8
#else
#define VECTOR 4
#endif
typedef float floats __attribute__((vector_size(VECTOR * sizeof(float))));
typedef int32_t ints __attribute__((vector_size(VECTOR * sizeof(int32_t))));

static inline floats load_floats(const float *p) {
    floats v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The sum of a vector's lanes: the instructions' own reduction where there is one (a few shuffles), else halves added
 * to halves through memory. A decoding step reduces one vector per key and query head: a lane at a time through
 * memory made SmolLM2's attention a third slower. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline float lanes_sum(floats v) { return _mm512_reduce_add_ps((__m512)v); }
#elif defined(__AVX2__)
#include <immintrin.h>
static inline float lanes_sum(floats v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
static inline float lanes_sum(floats v) { return vaddvq_f32((float32x4_t)v); }
#else
static inline float lanes_sum(floats v) {
    float lanes[VECTOR];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = VECTOR / 2; width > 0; width /= 2)
        for (int lane = 0; lane < width; lane++) lanes[lane] += lanes[lane + width];
    return lanes[0];
}
#endif

/* ---- One decoded query's attention over the KV cache (native_decode.py) ---- */

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

/* ---- Matrix-vector products over weights that lie on a grid (grid_weights.py) ---- */

#define GRID_BLOCK 32   /* weights per block: one step and one base each */
#define GRID_LEVELS 255 /* the largest code */

/* Whether the block's weights w[0..31] are all base + step * code for integer codes 0..255, to `tolerance`; writes
 * the codes (meaningful where it returns 1). Branch-free over the block, so that compilers vectorise it: packing
 * reads every weight of the model before its first product. */
static int on_grid(const float *restrict w, float base, float step, double tolerance, uint8_t *restrict codes) {
    float inverse = step > 0.0f ? 1.0f / step : 0.0f;
    int fits = 1;
    for (int j = 0; j < GRID_BLOCK; j++) {
        float code = rintf((w[j] - base) * inverse);
        /* in double, the grid point exactly (a product of two floats fits a double); NaN fits nothing */
        fits &= (code >= 0.0f) & (code <= (float)GRID_LEVELS) &
                (fabs((double)base + (double)step * (double)code - (double)w[j]) <= tolerance);
        codes[j] = (uint8_t)(code < 0.0f ? 0.0f : code > (float)GRID_LEVELS ? (float)GRID_LEVELS : code);
    }
    return fits;
}

/* The smallest difference between two of the block's weights larger than `tolerance` (0 if none): a grid's step
 * when two of its weights lie on neighbouring levels. */
static float smallest_gap(const float *w, float tolerance) {
    float sorted[GRID_BLOCK], gap = 0.0f;
    for (int j = 0; j < GRID_BLOCK; j++) { /* insertion sort: 32 values */
        int i = j;
        for (; i > 0 && sorted[i - 1] > w[j]; i--) sorted[i] = sorted[i - 1];
        sorted[i] = w[j];
    }
    for (int j = 1; j < GRID_BLOCK; j++) {
        float difference = sorted[j] - sorted[j - 1];
        if (difference > tolerance && (gap == 0.0f || difference < gap)) gap = difference;
    }
    return gap;
}

/* Rows [row_begin, row_end) of a float32 weight matrix (rows of `columns`, a multiple of GRID_BLOCK) as codes
 * (uint8, the same shape) and, per block of GRID_BLOCK weights of a row, a step and a base such that each weight is
 * base + step * code to within `relative` of the block's largest magnitude (checked in double). The step tried: the
 * block's range over 255 (GGUF's Q4_0/Q4_1 blocks and any grid whose span divides 255), its largest magnitude over
 * 127 (Q8_0), else the smallest gap between its weights (any other grid on which two of them are neighbours).
 * Returns the number of blocks on none of these grids (0: the matrix is held exactly). */
int64_t gali_grid_pack(const float *weight, int64_t columns, int64_t row_begin, int64_t row_end, float relative,
                       uint8_t *codes, float *step, float *base, int threads) {
    int64_t blocks = columns / GRID_BLOCK, missed = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) reduction(+ : missed)
#endif
    for (int64_t row = row_begin; row < row_end; row++) {
        for (int64_t k = 0; k < blocks; k++) {
            int64_t at = row * columns + k * GRID_BLOCK, slot = row * blocks + k;
            const float *w = weight + at;
            float low = w[0], high = w[0];
            for (int j = 1; j < GRID_BLOCK; j++) {
                low = w[j] < low ? w[j] : low;
                high = w[j] > high ? w[j] : high;
            }
            float largest = fabsf(low) > fabsf(high) ? fabsf(low) : fabsf(high);
            double tolerance = (double)relative * (double)largest;
            float candidates[3] = {(high - low) / GRID_LEVELS, largest / 127.0f, 0.0f}, chosen = 0.0f;
            /* a constant block is step 0 (comparisons skip a NaN: on_grid refuses it) */
            int found = high == low && on_grid(w, low, 0.0f, tolerance, codes + at);
            for (int c = 0; c < 3 && !found; c++) {
                if (c == 2) candidates[2] = smallest_gap(w, (float)tolerance);
                if (candidates[c] > 0.0f && on_grid(w, low, candidates[c], tolerance, codes + at)) {
                    found = 1;
                    chosen = candidates[c];
                }
            }
            step[slot] = chosen;
            base[slot] = low;
            missed += !found;
        }
    }
    return missed;
}

/* 1 where the grid products are built for vector registers that make them faster than PyTorch's float32 ones:
 * AVX2 or AVX-512 (x86 without them widens bytes one at a time), NEON. */
int gali_grid_vectorised(void) {
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__ARM_NEON)
    return 1;
#else
    return 0;
#endif
}

static inline floats load_codes(const uint8_t *p) {
    ints wide;
    for (int lane = 0; lane < VECTOR; lane++) wide[lane] = p[lane]; /* vpmovzxbd: GCC 12 scalarises a conversion */
    return __builtin_convertvector(wide, floats);
}

/* codes . x over one block of `block` weights (16 or 32, a multiple of VECTOR), in lanes */
static inline __attribute__((always_inline)) floats block_products(const uint8_t *restrict c, const float *restrict x,
                                                                   const int block) {
    floats sum = load_codes(c) * load_floats(x);
    for (int part = VECTOR; part < block; part += VECTOR) sum += load_codes(c + part) * load_floats(x + part);
    return sum;
}

/* One row of a packed matrix times x: the sum over blocks of step * (codes . x) + base * (the block's sum of x),
 * `block_sums` holding the latter sums. Two accumulators each, alternate blocks: each block's multiply-add would
 * otherwise wait on the previous one's. Inlined with `block` a constant (grid_row_of), so its loops unroll. */
static inline __attribute__((always_inline)) float grid_row_sized(
    const uint8_t *restrict codes, const float *restrict step, const float *restrict base, const float *restrict x,
    const float *restrict block_sums, int64_t blocks, const int block) {
    floats even = {0}, odd = {0};
    float even_offsets = 0.0f, odd_offsets = 0.0f;
    int64_t k = 0;
    for (; k + 1 < blocks; k += 2) {
        even += step[k] * block_products(codes + k * block, x + k * block, block);
        odd += step[k + 1] * block_products(codes + (k + 1) * block, x + (k + 1) * block, block);
        even_offsets += base[k] * block_sums[k];
        odd_offsets += base[k + 1] * block_sums[k + 1];
    }
    if (k < blocks) {
        even += step[k] * block_products(codes + k * block, x + k * block, block);
        even_offsets += base[k] * block_sums[k];
    }
    return lanes_sum(even + odd) + (even_offsets + odd_offsets);
}

static inline float grid_row(const uint8_t *restrict codes, const float *restrict step, const float *restrict base,
                             const float *restrict x, const float *restrict block_sums, int64_t blocks, int block) {
    if (block == 16) return grid_row_sized(codes, step, base, x, block_sums, blocks, 16);
    return grid_row_sized(codes, step, base, x, block_sums, blocks, GRID_BLOCK);
}

/* out (batch, outputs) = x (batch, columns) times the packed matrix (codes, and a step and a base per block of
 * `block` weights, 16 or 32, as gali_grid_pack writes them or a GGUF's blocks read; `rows` rows), for output rows [row_begin, row_end). `norm` (NULL: none): x is first RMS-normalised as a Llama's RMSNorm
 * does it (x / sqrt(mean(x^2) + epsilon) * norm, each row of x). `gated`: the matrix holds a gated MLP's gate rows
 * then its up rows (outputs = rows / 2), and the result is silu(gate) * up, as a Llama MLP feeds its down
 * projection. `accumulate`: the result is added to out (a residual stream) instead of written. Each row of the
 * matrix is read from memory once, whatever the batch. Rows are shared among `threads` threads (OpenMP), else the
 * caller splits them. Returns 0, -1 when its scratch memory could not be allocated, -2 for another block size
 * (nothing written). */
int gali_grid_matvec(const float *x, int64_t batch, int64_t columns, const float *norm, float epsilon,
                     const uint8_t *codes, const float *step, const float *base, int64_t block, int64_t rows,
                     int gated, int accumulate, int64_t row_begin, int64_t row_end, float *out, int threads) {
    if (block != 16 && block != GRID_BLOCK) return -2;
    int64_t blocks = columns / block, outputs = gated ? rows / 2 : rows;
    float *scratch = malloc(sizeof(float) * (size_t)(batch * (blocks + (norm ? columns : 0))));
    if (!scratch) return -1;
    float *block_sums = scratch, *normed = scratch + batch * blocks;
    if (norm) {
        for (int64_t b = 0; b < batch; b++) {
            const float *row = x + b * columns;
            float squares = 0.0f;
            for (int64_t m = 0; m < columns; m++) squares += row[m] * row[m];
            float inverse = 1.0f / sqrtf(squares / (float)columns + epsilon);
            for (int64_t m = 0; m < columns; m++) normed[b * columns + m] = norm[m] * (row[m] * inverse);
        }
        x = normed;
    }
    for (int64_t b = 0; b < batch; b++)
        for (int64_t k = 0; k < blocks; k++) {
            float sum = 0.0f;
            for (int j = 0; j < block; j++) sum += x[b * columns + k * block + j];
            block_sums[b * blocks + k] = sum;
        }
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t row = row_begin; row < row_end; row++) {
        for (int64_t b = 0; b < batch; b++) {
            const float *xb = x + b * columns, *sums = block_sums + b * blocks;
            float value = grid_row(codes + row * columns, step + row * blocks, base + row * blocks, xb, sums, blocks,
                                   (int)block);
            if (gated) {
                int64_t up = row + outputs;
                float other = grid_row(codes + up * columns, step + up * blocks, base + up * blocks, xb, sums, blocks,
                                       (int)block);
                value = value / (1.0f + expf(-value)) * other;
            }
            out[b * outputs + row] = accumulate ? out[b * outputs + row] + value : value;
        }
    }
    free(scratch);
    return 0;
}

/* Rows [row_begin, row_end) of a packed matrix (codes, and a step and a base per block of `block` weights) as float32
 * weights base + step * code into out (row_end - row_begin, columns): what a prefill multiplies by, a tile at a time.
 * step * code is exact in float32 for every GGUF grid, so a fused multiply-add rounds as the separate two do. Rows are
 * shared among `threads` threads (OpenMP), else the caller splits them. */
void gali_grid_unpack(const uint8_t *codes, const float *step, const float *base, int64_t columns, int64_t block,
                      int64_t row_begin, int64_t row_end, int64_t first_row, float *out, int threads) {
    int64_t blocks = columns / block;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t row = row_begin; row < row_end; row++) {
        const uint8_t *c = codes + row * columns;
        float *o = out + (row - first_row) * columns;
        for (int64_t k = 0; k < blocks; k++) {
            float s = step[row * blocks + k], b = base[row * blocks + k];
            for (int64_t j = 0; j < block; j++) o[k * block + j] = b + s * (float)c[k * block + j];
        }
    }
}
