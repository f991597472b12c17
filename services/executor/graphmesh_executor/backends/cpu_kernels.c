/* The torch backend's hand-written CPU kernels (f32, AVX2 + FMA), for what a decode step of a few rows spends
 * its time on: x @ w.T (gemm_xwt) and paged attention (paged_decode_attention). cpu_kernels.py builds them.
 *
 * gemm_xwt: out[m, n] = sum_k x[m, k] * w[n, k] for a few rows x and a weight w stored [n, k] row-major.
 * Decode multiplies a handful of rows by weights far bigger than the cache: the cost is reading w once from
 * memory, and MKL's small-M gemm on this machine (Zen 3) reads it at half the speed of its one-row product.
 * Here each tile of weight rows is read from memory once and kept in L1 while every group of x rows takes its
 * 12 dot products from it, and the next tile is prefetched meanwhile so its memory reads overlap this tile's
 * arithmetic (8 rows: 75 -> 55-62 ms for SmolLM2's layers; past 16 rows it costs more than it saves). Below 8
 * rows a tile is 6 weight rows for pairs of x rows; from 8 rows on it is 3 weight rows for quads: each weight
 * vector loaded then feeds 4 FMAs instead of 2, and a tile and the x rows fit L1 together (16 rows of
 * SmolLM2's 1536x576 weights, one core: 126 -> 92-108 ms).
 * Every out[m, n] is summed in the same order whatever M is and wherever row m sits in the batch (8 lanes
 * over k, then a fixed horizontal sum), so a session's numbers never depend on which other sessions share its
 * step. */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#define NT 6 /* weight rows per tile */
#define MT 2 /* x rows per tile: 12 accumulators + 6 weight vectors + 1 x vector fit the 16 ymm registers */
#define QUAD_ROWS 8 /* from this many x rows on, tiles are QNT x QMT: 12 accumulators + 3 + 1 vectors */
#define QNT 3
#define QMT 4
#define PREFETCH_ROWS 16 /* up to this many x rows, the next 6-row tile is prefetched */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* An mt x nt tile of out (mt <= QMT, nt <= NT); the compiler unrolls it for each constant pair below. */
static inline __attribute__((always_inline)) void tile(int mt, int nt, const float *x, size_t ldx,
                                                       const float *w, size_t ldw, float *out, size_t ldo,
                                                       size_t k8, size_t k, const float *next) {
    __m256 acc[QMT][NT];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm256_setzero_ps();
    for (size_t p = 0; p < k8; p += 8) {
        __m256 wv[NT];
        if (next && (p & 15) == 0) /* one 64-byte line of each of the next tile's rows every 16 floats */
            for (int j = 0; j < NT; j++) _mm_prefetch((const char *)(next + j * ldw + p), _MM_HINT_T0);
        for (int j = 0; j < nt; j++) wv[j] = _mm256_loadu_ps(w + j * ldw + p);
        for (int i = 0; i < mt; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * ldx + p);
            for (int j = 0; j < nt; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) {
            float s = hsum(acc[i][j]);
            for (size_t p = k8; p < k; p++) s += x[i * ldx + p] * w[j * ldw + p];
            out[i * ldo + j] = s;
        }
}

static void tile_2_6(const float *x, size_t ldx, const float *w, size_t ldw, float *out, size_t ldo, size_t k8,
                     size_t k, const float *next) { tile(2, 6, x, ldx, w, ldw, out, ldo, k8, k, next); }
static void tile_1_6(const float *x, size_t ldx, const float *w, size_t ldw, float *out, size_t ldo, size_t k8,
                     size_t k, const float *next) { tile(1, 6, x, ldx, w, ldw, out, ldo, k8, k, next); }
static void tile_2_1(const float *x, size_t ldx, const float *w, size_t ldw, float *out, size_t ldo, size_t k8,
                     size_t k, const float *next) { tile(2, 1, x, ldx, w, ldw, out, ldo, k8, k, next); }
static void tile_1_1(const float *x, size_t ldx, const float *w, size_t ldw, float *out, size_t ldo, size_t k8,
                     size_t k, const float *next) { tile(1, 1, x, ldx, w, ldw, out, ldo, k8, k, next); }

/* gemm_xwt with 3-row weight tiles for quads of x rows (m >= QUAD_ROWS). The rows a quad leaves go as one group
 * of 3 or 2, and a lone last row joins the quad before it as 3 + 2: one row alone keeps only 3 FMA chains busy. */
#define QUAD_TILES(N)                                                                                        \
    static void tiles_##N(int m, const float *x, size_t ldx, const float *w, size_t ldw, float *out, size_t ldo, \
                          size_t k8, size_t k, const float *next) {                                          \
        int quads = m / QMT, rest = m % QMT;                                                                 \
        if (rest == 1) quads--, rest = QMT + 1;                                                              \
        int i = 0;                                                                                           \
        for (; i < quads * QMT; i += QMT) tile(4, N, x + i * ldx, ldx, w, ldw, out + i * ldo, ldo, k8, k, next); \
        if (rest == 5) {                                                                                     \
            tile(3, N, x + i * ldx, ldx, w, ldw, out + i * ldo, ldo, k8, k, next);                           \
            i += 3, rest = 2;                                                                                \
        }                                                                                                    \
        if (rest == 3) tile(3, N, x + i * ldx, ldx, w, ldw, out + i * ldo, ldo, k8, k, next);                \
        if (rest == 2) tile(2, N, x + i * ldx, ldx, w, ldw, out + i * ldo, ldo, k8, k, next);                \
    }
QUAD_TILES(3)
QUAD_TILES(1)

static void gemm_xwt_quads(int m, size_t k8, int k, const float *x, int ldx, const float *w, int ldw, float *out,
                           int ldo, int n0, int n1) {
    int n = n0;
    for (; n + QNT <= n1; n += QNT) {
        /* Prefetched at any m: without it 17 rows ran slower than in pairs of 6-row tiles (195 vs 171 ms). */
        const float *next = n + 2 * QNT <= n1 ? w + (size_t)(n + QNT) * ldw : 0;
        tiles_3(m, x, ldx, w + (size_t)n * ldw, ldw, out + n, ldo, k8, k, next);
    }
    for (; n < n1; n++) tiles_1(m, x, ldx, w + (size_t)n * ldw, ldw, out + n, ldo, k8, k, 0);
}

/* Rows [n0, n1) of the output's columns: callers split n across threads. Strides are in elements. */
void gemm_xwt(int m, int k, const float *x, int ldx, const float *w, int ldw, float *out, int ldo, int n0, int n1) {
    size_t k8 = (size_t)k & ~(size_t)7;
    if (m >= QUAD_ROWS) {
        gemm_xwt_quads(m, k8, k, x, ldx, w, ldw, out, ldo, n0, n1);
        return;
    }
    int n = n0;
    for (; n + NT <= n1; n += NT) {
        const float *next = m <= PREFETCH_ROWS && n + 2 * NT <= n1 ? w + (size_t)(n + NT) * ldw : 0;
        int i = 0;
        for (; i + MT <= m; i += MT)
            tile_2_6(x + (size_t)i * ldx, ldx, w + (size_t)n * ldw, ldw, out + (size_t)i * ldo + n, ldo, k8, k, next);
        for (; i < m; i++)
            tile_1_6(x + (size_t)i * ldx, ldx, w + (size_t)n * ldw, ldw, out + (size_t)i * ldo + n, ldo, k8, k, next);
    }
    for (; n < n1; n++) {
        int i = 0;
        for (; i + MT <= m; i += MT)
            tile_2_1(x + (size_t)i * ldx, ldx, w + (size_t)n * ldw, ldw, out + (size_t)i * ldo + n, ldo, k8, k, 0);
        for (; i < m; i++)
            tile_1_1(x + (size_t)i * ldx, ldx, w + (size_t)n * ldw, ldw, out + (size_t)i * ldo + n, ldo, k8, k, 0);
    }
}

/* gemm_xwt over GGUF blocks: out[m, n] = sum_k x[m, k] * w[n, k] where w is stored as packed GGUF blocks of 32
 * (q4_0: f16 d, 16 bytes of nibbles; q4_1: f16 d, f16 m, nibbles; q8_0: f16 d, 32 int8). A decode step is the
 * cost of reading the weights, and a Q4_1 weight is 0.625 bytes where its f32 form is 4: each tile of weight
 * rows is expanded into an L1 buffer once, then gemm_xwt's own tiles multiply every x row by it. The expanded
 * values are exactly the f32 weights gguf's dequantization gives (d * q + m rounds once, as the fused
 * multiply-add does; d * q alone is exact), and the sums are gemm_xwt's, so the product equals gemm_xwt over the
 * dequantized weight bit for bit. */
enum { SCHEME_Q4_0 = 0, SCHEME_Q4_1 = 1, SCHEME_Q8_0 = 2 };
#define PACKED_TILE 6 /* weight rows expanded at a time: a multiple of both tile widths (NT and QNT) */

static inline __m256 f16(const unsigned char *p) {
    unsigned short h = (unsigned short)(p[0] | (p[1] << 8));
    return _mm256_set1_ps(_cvtsh_ss(h));
}

/* u8 or i8 lanes 0..7 of v as f32 */
static inline __m256 u8_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline __m256 i8_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

static void expand_row(int scheme, const unsigned char *b, int blocks, float *dst) {
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int j = 0; j < blocks; j++, dst += 32) {
        __m256 d = f16(b), v[4];
        if (scheme == SCHEME_Q8_0) {
            __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2)), q1 = _mm_loadu_si128((const __m128i *)(b + 18));
            v[0] = i8_ps(q0), v[1] = i8_ps(_mm_srli_si128(q0, 8)), v[2] = i8_ps(q1), v[3] = i8_ps(_mm_srli_si128(q1, 8));
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(d, v[i]));
            b += 34;
            continue;
        }
        const unsigned char *qs = b + (scheme == SCHEME_Q4_1 ? 4 : 2);
        __m128i raw = _mm_loadu_si128((const __m128i *)qs);
        __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low); /* 0..15, 16..31 */
        v[0] = u8_ps(lo), v[1] = u8_ps(_mm_srli_si128(lo, 8)), v[2] = u8_ps(hi), v[3] = u8_ps(_mm_srli_si128(hi, 8));
        if (scheme == SCHEME_Q4_1) {
            __m256 m = f16(b + 2);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + 8 * i, _mm256_fmadd_ps(d, v[i], m));
            b += 20;
        } else {
            const __m256 eight = _mm256_set1_ps(8.0f);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(d, _mm256_sub_ps(v[i], eight)));
            b += 18;
        }
    }
}

/* Rows [n0, n1) of the output's columns, as gemm_xwt; w [n, k / 32 blocks], k a multiple of 32; buf: a caller's
 * buffer of PACKED_TILE * k floats. */
void gemm_xwt_packed(int m, int k, const float *x, int ldx, const unsigned char *w, int scheme, float *out, int ldo,
                     int n0, int n1, float *buf) {
    int blocks = k / 32;
    size_t row_bytes = (size_t)blocks * (scheme == SCHEME_Q8_0 ? 34 : scheme == SCHEME_Q4_1 ? 20 : 18);
    for (int n = n0; n < n1; n += PACKED_TILE) {
        int rows = n1 - n < PACKED_TILE ? n1 - n : PACKED_TILE;
        for (int r = 0; r < rows; r++) expand_row(scheme, w + (size_t)(n + r) * row_bytes, blocks, buf + (size_t)r * k);
        gemm_xwt(m, k, x, ldx, buf, k, out + n, ldo, 0, rows);
    }
}

/* Paged attention for decode, one query row per sequence (f32): out[s, h] = softmax(q[s, h] . K[s]^T * scale) V[s]
 * over the keys 0..pos[s] of sequence s, read in place from the pools through its block table. torch's version
 * gathers every block, permutes it for a batched matmul and masks the padding: two copies of the sequences' K
 * and V per layer, which cost SmolLM2 a sixth of a 16-row decode step. Scores and the weighted sum run in key
 * order and depend on this sequence's rows alone.
 * Each score is one 8-lane FMA chain over d and a fixed horizontal sum; four keys go at once, so four chains
 * hide the FMA latency that one chain per key waited on. The weighted sum keeps its output in registers, a
 * chunk of OUT_CHUNK floats at a time, instead of a load and a store of it per key (a store-to-load chain).
 * Every number is the one the one-key-at-a-time loop gave: the same products summed in the same order. */

#define KEYS_AT_ONCE 4
#define OUT_CHUNK 64 /* floats of a head's output kept in 8 ymm registers while every key adds to them */

static inline float dot(const float *a, const float *b, int d) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

/* scores[r] = q . k[r] for KEYS_AT_ONCE keys, each exactly dot(q, k[r], d). */
static inline void dots(const float *q, const float *const *k, int d, float *scores) {
    __m256 acc[KEYS_AT_ONCE];
    for (int r = 0; r < KEYS_AT_ONCE; r++) acc[r] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int r = 0; r < KEYS_AT_ONCE; r++) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[r] + i), acc[r]);
    }
    for (int r = 0; r < KEYS_AT_ONCE; r++) {
        float s = hsum(acc[r]);
        for (int j = i; j < d; j++) s += q[j] * k[r][j];
        scores[r] = s;
    }
}

/* o[0..width) = sum over keys j, in order, of p[j] * v[j][at..at + width), each lane one FMA chain from zero. */
static inline void weighted_sum(const float *p, const float *const *v, size_t at, int keys, int width, float *o) {
    __m256 acc[OUT_CHUNK / 8];
    int lanes = width / 8;
    for (int c = 0; c < lanes; c++) acc[c] = _mm256_setzero_ps();
    for (int j = 0; j < keys; j++) {
        __m256 pj = _mm256_set1_ps(p[j]);
        for (int c = 0; c < lanes; c++) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v[j] + at + 8 * c), acc[c]);
    }
    for (int c = 0; c < lanes; c++) _mm256_storeu_ps(o + 8 * c, acc[c]);
    for (int i = 8 * lanes; i < width; i++) {
        float s = 0.0f;
        for (int j = 0; j < keys; j++) s += p[j] * v[j][at + i];
        o[i] = s;
    }
}

/* q, out [t, hq, d]; k_pool, v_pool [slots, hkv, d]; table [t, blocks] pool block ids; pos [t]; scores: a
 * caller's buffer of blocks * block floats; rows: one of 2 * blocks * block pointers. A key's slot is
 * table[s, j / block] * block + j % block. */
void paged_decode_attention(int t, int hq, int hkv, int d, int block, int blocks, const float *q,
                            const float *k_pool, const float *v_pool, const long long *table, const long long *pos,
                            float scale, float *out, float *scores, const float **rows) {
    int group = hq / hkv;
    const float **k_rows = rows, **v_rows = rows + (size_t)blocks * block;
    for (int s = 0; s < t; s++) {
        int keys = (int)pos[s] + 1;
        const long long *table_row = table + (size_t)s * blocks;
        for (int kv = 0; kv < hkv; kv++) {
            size_t head = (size_t)kv * d;
            for (int j = 0; j < keys; j++) {
                size_t slot = (size_t)table_row[j / block] * block + j % block;
                k_rows[j] = k_pool + slot * hkv * d + head;
                v_rows[j] = v_pool + slot * hkv * d + head;
            }
            for (int h = kv * group; h < (kv + 1) * group; h++) {
                const float *qh = q + ((size_t)s * hq + h) * d;
                int j = 0;
                for (; j + KEYS_AT_ONCE <= keys; j += KEYS_AT_ONCE) dots(qh, k_rows + j, d, scores + j);
                for (; j < keys; j++) scores[j] = dot(qh, k_rows[j], d);
                float top = -INFINITY;
                for (j = 0; j < keys; j++) {
                    scores[j] *= scale;
                    top = scores[j] > top ? scores[j] : top;
                }
                float total = 0.0f;
                for (j = 0; j < keys; j++) total += scores[j] = expf(scores[j] - top);
                for (j = 0; j < keys; j++) scores[j] /= total;
                float *o = out + ((size_t)s * hq + h) * d;
                for (int c = 0; c < d; c += OUT_CHUNK)
                    weighted_sum(scores, v_rows, (size_t)c, keys, d - c < OUT_CHUNK ? d - c : OUT_CHUNK, o + c);
            }
        }
    }
}
