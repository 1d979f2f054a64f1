/* What the native kernels share (native_noise.c, native_decode.c, native_grids.c), as static inline functions each
 * file compiles into itself: GALI's noise, drawn by the noisy softmax and the decoding step alike (the hash, the
 * Box-Muller pair and exp), and the vector types and helpers of the loops that compilers do not vectorise by
 * themselves (the decoding step's and the grid products'). No kernel file defines what another one also needs.
 *
 * The kernels are built together into one library at first use by native_library.py (the system C compiler, -O3,
 * OpenMP where it has it; the loops are written so that it vectorises them), which passes this file's constants.
 *
 * The noise: keys 2m and 2m + 1 share one hashed pair of uniforms (Box-Muller's cosine and sine branches), so each
 * pair is transformed once. Hash and uniforms are noise.py's, bit for bit (uint32 arithmetic wraps as its masked
 * int64 products do); log, sine, cosine and exp are short polynomials after exact range reduction, so the normals
 * agree with noise.py's to float32 rounding.
 */
#ifndef GALI_NATIVE_COMMON_H
#define GALI_NATIVE_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

/* ---- GALI's noise ---- */

/* The noise's constants are engine/math/noise.py's, passed by the build (native_library.py) as -D flags: the noise is
 * defined in one place, and these kernels are held to it by the kernel checks. */
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

/* ---- Vectors ---- */

/* VECTOR floats as one vector register (GCC's and Clang's vector extensions): AVX-512's, AVX2's, else SSE's or
 * NEON's: the loops that compilers do not vectorise by themselves are written in them. */
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

#endif
