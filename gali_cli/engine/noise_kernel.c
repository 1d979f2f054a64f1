/* GALI's logit noise added to a tile of logits, and the softmax numerators, in two sweeps over each row.
 *
 * Built at first use by native_noise.py (the system C compiler, -O3; the loops are written so that it vectorises
 * them) and held to the PyTorch path (noise.py) before it is used. The logits of keys 2m and 2m + 1 come in two arrays,
 * `even` and `odd`, because the two keys of a pair share one hashed pair of uniforms (Box-Muller's cosine and sine
 * branches): each pair is transformed once. Hash and uniforms are noise.py's, bit for bit (uint32 arithmetic wraps
 * as its masked int64 products do); log, sine, cosine and exp are short polynomials after exact range reduction,
 * so the normals agree with noise.py's to float32 rounding.
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

/* The noisy logits of pair m of a row, written back; returns the larger of the two. */
static inline float add_pair_noise(float *e, float *o, int64_t m, uint32_t hash, int32_t index,
                                   const int32_t *pair_hash, const float *even_weight, const float *odd_weight) {
    float cosine, sine;
    box_muller(mix32(hash ^ (uint32_t)pair_hash[m]), &cosine, &sine);
    float distance = (float)(index - 2 * (int32_t)m);
    float a = e[m] + cosine * (distance * even_weight[m]);
    float b = o[m] + sine * ((distance - 1.0f) * odd_weight[m]);
    e[m] = a;
    o[m] = b;
    return a > b ? a : b;
}

/* exp(logit - maximum) of pair m of a row, written back; returns their sum. */
static inline float exponentiate_pair(float *e, float *o, int64_t m, float maximum) {
    float a = exp_nonpositive(e[m] - maximum), b = exp_nonpositive(o[m] - maximum);
    e[m] = a;
    o[m] = b;
    return a + b;
}

/* Rows [row_begin, row_end) of `even` and `odd` (row stride `stride`, `pairs` columns each, keys 2m and 2m + 1):
 * add the noise, sigma = (i - j) * weight_j, then replace each logit by exp(logit - row maximum); the row's maximum
 * and the sum of its numerators go to top[row] and total[row].
 *
 * row_stream[row]: the stream of the row's batch row and head (noise.head_streams); row_index[row]: its query's
 * token index i; pair_hash[m] = mix32(m ^ GOLDEN); even_weight[m], odd_weight[m]: noise scale / T for a noisy key
 * (c != 0), else 0. Maxima and sums are kept per lane of LANES columns, so that the compiler vectorises them. */
void gali_noisy_softmax(float *restrict even, float *restrict odd, int64_t stride, const int32_t *row_stream,
                        const int32_t *row_index, const int32_t *pair_hash, const float *even_weight,
                        const float *odd_weight,
                        int64_t row_begin, int64_t row_end, int64_t pairs, float *top, float *total) {
    int64_t whole = pairs - pairs % LANES;
    for (int64_t row = row_begin; row < row_end; row++) {
        float *e = even + row * stride, *o = odd + row * stride;
        int32_t index = row_index[row];
        uint32_t hash = mix32((uint32_t)row_stream[row] ^ mix32((uint32_t)index)); /* noise.py's `rows` */
        float lane_max[LANES], lane_sum[LANES];
        for (int lane = 0; lane < LANES; lane++) {
            lane_max[lane] = -__builtin_inff();
            lane_sum[lane] = 0.0f;
        }
        for (int64_t start = 0; start < whole; start += LANES) {
            for (int lane = 0; lane < LANES; lane++) {
                float larger = add_pair_noise(e, o, start + lane, hash, index, pair_hash, even_weight, odd_weight);
                lane_max[lane] = larger > lane_max[lane] ? larger : lane_max[lane];
            }
        }
        for (int64_t m = whole; m < pairs; m++) {
            float larger = add_pair_noise(e, o, m, hash, index, pair_hash, even_weight, odd_weight);
            lane_max[0] = larger > lane_max[0] ? larger : lane_max[0];
        }
        float maximum = lane_max[0];
        for (int lane = 1; lane < LANES; lane++) maximum = lane_max[lane] > maximum ? lane_max[lane] : maximum;
        for (int64_t start = 0; start < whole; start += LANES) {
            for (int lane = 0; lane < LANES; lane++) lane_sum[lane] += exponentiate_pair(e, o, start + lane, maximum);
        }
        for (int64_t m = whole; m < pairs; m++) lane_sum[0] += exponentiate_pair(e, o, m, maximum);
        float sum = 0.0f;
        for (int lane = 0; lane < LANES; lane++) sum += lane_sum[lane];
        top[row] = maximum;
        total[row] = sum;
    }
}
