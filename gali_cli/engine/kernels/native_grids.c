/* Matrix-vector products over weights that lie on a grid, for the CPU decoding step's projections (grid_weights.py,
 * packed_modules.py): each block of weights held as a byte a weight, base + step * code (gali_grid_pack finds the
 * grid of a float32 matrix; a GGUF's blocks are one already), multiplied as they are (gali_grid_matvec, with a
 * Llama's RMSNorm, gated MLP and residual addition fused in) or widened back to float32 for a prefill
 * (gali_grid_unpack). The vector types and lanes_sum are native_common.h's.
 *
 * Built at first use by native_library.py with the other kernels into one library.
 */
#include "native_common.h"

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
