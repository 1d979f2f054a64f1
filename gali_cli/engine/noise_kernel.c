/* GALI's logit noise added to a tile of logits, and the softmax numerators, in two sweeps over each row.
 *
 * Built at first use by native_noise.py (the system C compiler, -O3, OpenMP where it has it; the loops are written
 * so that it vectorises them) and held to the PyTorch path (noise.py) before it is used. Keys 2m and 2m + 1 share
 * one hashed pair of uniforms (Box-Muller's cosine and sine branches): each pair is transformed once. Hash and
 * uniforms are noise.py's, bit for bit (uint32 arithmetic wraps as its masked int64 products do); log, sine, cosine
 * and exp are short polynomials after exact range reduction, so the normals agree with noise.py's to float32
 * rounding.
 */
#include <stdint.h>

#define LANES 16

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x5BD1E995u;
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

    uint32_t turn = mix32(bits ^ 0x9E3779B9u) >> 8;                  /* the angle, in 2**-24 turns */
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
