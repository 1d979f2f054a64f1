/* GALI's logit noise added to a tile of logits with the softmax numerators, for prefill on the CPU
 * (gali_noisy_softmax; native_noise.py calls it): each row swept twice while it is in cache, the noise added and the
 * maximum found, then exp(logit - maximum) and the sum. The noise itself (hash, Box-Muller, exp) is native_common.h's,
 * shared with the decoding step (native_decode.c).
 *
 * Built at first use by native_library.py with the other kernels into one library, and held to the PyTorch path
 * (noise.py) before it is used.
 */
#include "native_common.h"

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

/* 1 when built with OpenMP (gali_noisy_softmax shares rows among threads itself, as the library's other kernels do:
 * they are built in the same compiler run, with the same flags), else 0. */
int gali_noisy_softmax_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
