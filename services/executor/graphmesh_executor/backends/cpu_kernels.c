/* The torch backend's hand-written CPU kernels (f32, AVX2 + FMA, or AVX-512 where cpu_kernels.py builds for it),
 * for what a step of a few rows spends its time on: x @ w.T over f32 weights (gemm_fpanels) and over GGUF blocks
 * (gemm_qpanels), and paged attention (paged_decode_attention). cpu_kernels.py builds them.
 *
 * Both products read their weight in panels of PANEL weight rows laid out column by column, [k][PANEL], made
 * once when the weight is set: a panel is one sequential stream that the hardware prefetcher keeps ahead of the
 * arithmetic, and a tile of 4 x rows by one panel is 12 accumulators fed by one broadcast of x and three weight
 * vectors, with no horizontal sums.
 *
 * The vector width changes only how many outputs a lane group holds, never an output's sum: each output is one
 * FMA chain over k in order from zero in both builds, so the AVX2 and the AVX-512 products give the same bits.
 * Attention and the norms keep their 8-lane sums (with horizontal adds) in both builds for the same reason. */
#include <immintrin.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

/* The two builds differ only in their register width: VL lanes, the intrinsics' prefix (V(op): _mm512_op or
 * _mm256_op, VI(op): the integer ops' _mm512_op_si512 or _mm256_op_si256), and how many bytes a load of VL f16
 * values (HALVES) or of VL bytes (BYTES) reads; every body below is written once over these. */
#ifdef __AVX512F__
#define VL 16 /* lanes of the products' vectors */
typedef __m512 vec;
typedef __m512i ivec;
#define V(op) _mm512_##op
#define VI(op) _mm512_##op##_si512
#define HALVES(p) _mm256_loadu_si256((const __m256i *)(p))
#define BYTES(p) _mm_loadu_si128((const __m128i *)(p))
#else
#define VL 8
typedef __m256 vec;
typedef __m256i ivec;
#define V(op) _mm256_##op
#define VI(op) _mm256_##op##_si256
#define HALVES(p) _mm_loadu_si128((const __m128i *)(p))
#define BYTES(p) _mm_loadl_epi64((const __m128i *)(p))
#endif
#define vzero V(setzero_ps)
#define vload V(loadu_ps)
#define vstore V(storeu_ps)
#define vfmadd V(fmadd_ps)
#define vmul V(mul_ps)
#define vset1 V(set1_ps)
/* VL f16 values from p, as f32 */
static inline vec load_f16(const unsigned short *p) { return V(cvtph_ps)(HALVES(p)); }
/* VL unsigned bytes from p, as f32 of their low and high nibbles */
static inline void load_nibbles(const unsigned char *p, vec *lo, vec *hi) {
    ivec pair = V(cvtepu8_epi32)(BYTES(p));
    *lo = V(cvtepi32_ps)(VI(and)(pair, V(set1_epi32)(15)));
    *hi = V(cvtepi32_ps)(V(srli_epi32)(pair, 4));
}
/* VL signed bytes from p, as f32 */
static inline vec load_i8(const unsigned char *p) { return V(cvtepi32_ps)(V(cvtepi8_epi32)(BYTES(p))); }
/* Integer lanes, for the K-quants' 6-bit scales and codes: VL unsigned bytes from p as int32 */
static inline ivec load_u8i(const unsigned char *p) { return V(cvtepu8_epi32)(BYTES(p)); }
#define iand VI(and)
#define ior VI(or)
#define isub V(sub_epi32)
#define isrl V(srli_epi32)
#define isll V(slli_epi32)
#define iset1 V(set1_epi32)
#define itof V(cvtepi32_ps)
#define PANEL (3 * VL) /* weight rows of a panel: three vectors */

/* What this build is, for cpu_kernels.py: its panel width and its vector lanes. */
int panel_width(void) { return PANEL; }
int vector_lanes(void) { return VL; }

/* Bytes [p, p + n) into L2: a tile or slice the product reads next. */
static inline void prefetch_l2(const void *p, size_t n) {
    for (size_t o = 0; o < n; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T1);
}

/* The same into L1: what a product reads within a few hundred cycles. */
static inline __attribute__((always_inline)) void prefetch_l1(const void *p, size_t n) {
    for (size_t o = 0; o < n; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* acc[mr rows][PANEL] (+)= x[mr rows, 0..kc) . w[0..kc)[PANEL]; acc starts from zero on a panel's first slice. */
static inline __attribute__((always_inline)) void panel_tile(int mr, int kc, const float *x, size_t ldx,
                                                             const float *w, float *acc_rows, int first) {
    vec acc[4][3];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 3; j++) acc[i][j] = first ? vzero() : vload(acc_rows + i * PANEL + VL * j);
    for (int p = 0; p < kc; p++) {
        vec w0 = vload(w + p * PANEL), w1 = vload(w + p * PANEL + VL), w2 = vload(w + p * PANEL + 2 * VL);
        for (int i = 0; i < mr; i++) {
            vec xv = vset1(x[i * ldx + p]);
            acc[i][0] = vfmadd(xv, w0, acc[i][0]);
            acc[i][1] = vfmadd(xv, w1, acc[i][1]);
            acc[i][2] = vfmadd(xv, w2, acc[i][2]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 3; j++) vstore(acc_rows + i * PANEL + VL * j, acc[i][j]);
}

/* out[m, n..n + cols) = x[m, 0..k) . panel[0..k)[PANEL] for a panel held whole as f32, any m: each tile keeps its
 * accumulators in registers over all of k. A lone last row goes with the quad before it as 3 + 2: one row alone
 * keeps only 3 FMA chains busy. */
static void panel_rows(int m, int k, const float *x, int ldx, const float *panel, float *out, int ldo, int n,
                       int cols) {
    float acc[4 * PANEL] __attribute__((aligned(64)));
    for (int i = 0; i < m;) {
        int mr = m - i >= 4 ? (m - i == 5 ? 3 : 4) : m - i;
        const float *xs = x + (size_t)i * ldx;
        if (mr == 4) panel_tile(4, k, xs, ldx, panel, acc, 1);
        else if (mr == 3) panel_tile(3, k, xs, ldx, panel, acc, 1);
        else if (mr == 2) panel_tile(2, k, xs, ldx, panel, acc, 1);
        else panel_tile(1, k, xs, ldx, panel, acc, 1);
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < cols; j++) out[(size_t)(i + r) * ldo + n + j] = acc[r * PANEL + j];
        i += mr;
    }
}

/* gemm_fpanels: out[m, n] = sum_k x[m, k] * w[n, k] for an f32 weight held as panels (repack_f32), any m.
 * Each tile keeps its 12 accumulators in registers over the whole of k, so each output is one FMA chain over k
 * in order, from zero: a row's outputs never depend on how many rows share the call, where the row sits, or
 * how the columns are split over threads (nor on whether it is a prompt's row or a decode's). The weights
 * they replace were read row-major, 6 or 3 weight rows a tile, each output 8 lanes and a horizontal sum; on
 * SmolLM2's layers (18 of them, one core, cold) that took 30 ms for 8 rows where panels take 19-22 ms, 59
 * against 32-40 ms for 16, and on its 49152x576 head MKL's one-row product took 9.2 ms against 3.6; for
 * prompt chunks the panels beat MKL's blocked gemm too (640 rows: 86 against 79 GFLOP/s). */

/* f32 rows [n, k] -> panels [ceil(n / PANEL)][k][PANEL]; rows past n are zero. */
void repack_f32(int n, int k, const float *w, float *dst) {
    for (int panel = 0; panel < (n + PANEL - 1) / PANEL; panel++)
        for (int r = 0; r < PANEL; r++) {
            int row = panel * PANEL + r;
            float *col = dst + (size_t)panel * k * PANEL + r;
            for (int c = 0; c < k; c++) col[(size_t)c * PANEL] = row < n ? w[(size_t)row * k + c] : 0.0f;
        }
}

/* Rows [n0, n1) of the output's columns (n0 a multiple of PANEL: callers split n across threads). Strides in
 * elements. */
void gemm_fpanels(int m, int k, const float *x, int ldx, const float *w, float *out, int ldo, int n0, int n1) {
    size_t panel_floats = (size_t)k * PANEL;
    for (int n = n0; n < n1; n += PANEL)
        panel_rows(m, k, x, ldx, w + (size_t)(n / PANEL) * panel_floats, out, ldo, n, n1 - n < PANEL ? n1 - n : PANEL);
}

/* gemm_qpanels: out[m, n] = sum_k x[m, k] * w[n, k] for a weight held as GGUF blocks of 32 (q4_0: f16 d and
 * nibbles, d * (q - 8); q4_1: f16 d, f16 m, nibbles, d * q + m; q8_0: f16 d, int8, d * q) or as K-quant
 * super-blocks of 256 (q4_k: f16 d and dmin, 6-bit scales sc and mins mn of 8 sub-blocks of 32, nibbles,
 * (d * sc) * q - dmin * mn; q6_k: f16 d, int8 scales of 16 sub-blocks of 16, 6-bit codes, (d * sc) * (q - 32)),
 * reading 0.6 to 1.1 bytes a weight where its f32 form reads 4.
 * The blocks are laid out again once (repack_blocks) in panels of PANEL weight rows: for each block of 32
 * columns, the panel's PANEL scales, its PANEL mins, then its codes column by column (q4: a byte holds two
 * neighbouring columns of one row); a K-quant super-block likewise keeps each field PANEL rows at a time
 * (see repack_kblocks). A KC-column slice of a panel is then dequantized with whole-vector
 * operations straight into the order the product reads, [KC][PANEL] in L1, and every x row takes its
 * products from it: quads of rows, each a 4 x PANEL tile of 12 accumulators fed by one broadcast of x and three
 * weight vectors. The row-major GGUF rows took a horizontal sum per output and a tile per 6 rows: SmolLM2's
 * 30 layers, Q4_1, one core, 8 rows 46 -> 31 ms, 1 row 20 -> 16 ms.
 * The dequantized values are exactly gguf's (gguf.quants.dequantize): d * q + m rounds once, as the fused
 * multiply-add does, and d * q alone is exact; the K-quants' sub-block scales are gguf's f32 products, and
 * (d * sc) * q - dmin * mn is an exact product less a value, rounded once, as the fused multiply-add of the
 * negated min is. Every out[m, n] is one FMA chain over k in order, from zero, whatever M is and wherever row m
 * sits: a session's numbers never depend on which other sessions share its step. */
enum { SCHEME_Q4_0 = 0, SCHEME_Q4_1 = 1, SCHEME_Q8_0 = 2, SCHEME_Q4_K = 3, SCHEME_Q6_K = 4 };
#define KC (192 * 24 / PANEL) /* columns dequantized at a time, a multiple of 32: a [KC][PANEL] slice is 18 KiB of L1 */
#define PANEL_ROWS 32 /* rows that keep their partial sums between slices; more take a whole panel */
#define QK_K 256 /* columns of a K-quant super-block */

static int kquant(int scheme) { return scheme == SCHEME_Q4_K || scheme == SCHEME_Q6_K; }

/* Columns of one GGUF block of `scheme`: 32, or a K-quant's 256. */
static int block_cols(int scheme) { return kquant(scheme) ? QK_K : 32; }

static size_t gguf_block_bytes(int scheme) {
    switch (scheme) {
    case SCHEME_Q8_0: return 34;
    case SCHEME_Q4_1: return 20;
    case SCHEME_Q4_K: return 144;
    case SCHEME_Q6_K: return 210;
    default: return 18;
    }
}

/* Bytes of one block of a panel (block_cols(scheme) columns): for blocks of 32, PANEL f16 scales and PANEL f16
 * mins (none for q8_0), then codes; for the K-quants see repack_kblocks. */
size_t panel_block_bytes(int scheme) {
    switch (scheme) {
    case SCHEME_Q8_0: return 2 * PANEL + 32 * PANEL;
    case SCHEME_Q4_K: return 148 * PANEL;
    case SCHEME_Q6_K: return 210 * PANEL;
    default: return 4 * PANEL + 16 * PANEL;
    }
}

/* K-quant super-blocks [n, k / 256] -> panels [ceil(n / PANEL)][k / 256][panel_block_bytes], each field PANEL
 * rows at a time (row r at byte r of each PANEL-byte group, or bytes 2r, 2r + 1 of an f16 group):
 *   q4_k: d f16 [PANEL], dmin f16 [PANEL], sc [8][PANEL], mn [8][PANEL] (6-bit values unpacked, gguf's
 *         get_scale_min), codes [128][PANEL]: byte c holds columns 2c (low nibble) and 2c + 1;
 *   q6_k: d f16 [PANEL], scales int8 [16][PANEL], low nibbles [128][PANEL] as q4_k's, high bits [64][PANEL]:
 *         byte c holds the top 2 bits of columns 4c .. 4c + 3 at bits 0, 2, 4, 6.
 * Rows past n are zero. */
/* Column x of a Q6_K super-block: its low 4 bits (top = 0) or its top 2 (top = 1). Half h = x / 128, i = x % 128;
 * the low bits in ql[64 h + i % 64] (the high nibble for i >= 64), the top in qh[32 h + i % 32] at bits 2 (i / 32). */
static int q6_bits(const unsigned char *ql, const unsigned char *qh, int x, int top) {
    int h = x / 128, i = x % 128;
    return top ? (qh[32 * h + i % 32] >> (2 * (i / 32))) & 3 : (ql[64 * h + i % 64] >> (4 * (i / 64))) & 15;
}

static void repack_kblocks(int scheme, int n, int k, const unsigned char *src, unsigned char *dst) {
    int blocks = k / QK_K, q6 = scheme == SCHEME_Q6_K;
    size_t row_bytes = (size_t)blocks * gguf_block_bytes(scheme), bb = panel_block_bytes(scheme);
    for (int panel = 0; panel < (n + PANEL - 1) / PANEL; panel++)
        for (int b = 0; b < blocks; b++) {
            unsigned char *out = dst + ((size_t)panel * blocks + b) * bb;
            if ((panel + 1) * PANEL > n) memset(out, 0, bb); /* the padding rows: zero products, never stored */
            for (int r = 0; r < PANEL && panel * PANEL + r < n; r++) {
                int row = panel * PANEL + r;
                const unsigned char *blk = src + (size_t)row * row_bytes + (size_t)b * gguf_block_bytes(scheme);
                if (q6) {
                    const unsigned char *ql = blk, *qh = blk + 128, *sc = blk + 192;
                    out[2 * r] = blk[208], out[2 * r + 1] = blk[209]; /* d */
                    for (int s = 0; s < 16; s++) out[(2 + s) * PANEL + r] = sc[s];
                    /* 128 bytes of two columns' low 4 bits, then 64 of four columns' top 2 bits */
                    for (int c = 0; c < 192; c++) {
                        int top = c >= 128, per = top ? 4 : 2, first = top ? 4 * (c - 128) : 2 * c, byte = 0;
                        for (int t = 0; t < per; t++) byte |= q6_bits(ql, qh, first + t, top) << ((top ? 2 : 4) * t);
                        out[(18 + c) * PANEL + r] = (unsigned char)byte;
                    }
                    continue;
                }
                const unsigned char *s = blk + 4, *qs = blk + 16;
                out[2 * r] = blk[0], out[2 * r + 1] = blk[1];                         /* d */
                out[2 * (PANEL + r)] = blk[2], out[2 * (PANEL + r) + 1] = blk[3];     /* dmin */
                for (int j = 0; j < 8; j++) { /* gguf's Q4_K.get_scale_min */
                    int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 2) & 48);
                    int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 48);
                    out[(4 + j) * PANEL + r] = (unsigned char)sc;
                    out[(12 + j) * PANEL + r] = (unsigned char)mn;
                }
                /* column x: sub-block j = x / 32; qs[32 (j / 2) + x % 32], the high nibble for odd j */
                for (int c = 0; c < 128; c++) {
                    int lo = 0;
                    for (int t = 0; t < 2; t++) {
                        int x = 2 * c + t, j = x / 32;
                        lo |= ((qs[32 * (j / 2) + x % 32] >> (4 * (j & 1))) & 15) << (4 * t);
                    }
                    out[(20 + c) * PANEL + r] = (unsigned char)lo;
                }
            }
        }
}

/* GGUF rows [n, k / block_cols blocks] -> panels [ceil(n / PANEL)][k / block_cols][panel_block_bytes]; rows past
 * n are zero. */
void repack_blocks(int scheme, int n, int k, const unsigned char *src, unsigned char *dst) {
    if (kquant(scheme)) {
        repack_kblocks(scheme, n, k, src, dst);
        return;
    }
    int blocks = k / 32, q8 = scheme == SCHEME_Q8_0;
    size_t row_bytes = (size_t)blocks * gguf_block_bytes(scheme), bb = panel_block_bytes(scheme);
    for (int panel = 0; panel < (n + PANEL - 1) / PANEL; panel++)
        for (int b = 0; b < blocks; b++) {
            unsigned char *out = dst + ((size_t)panel * blocks + b) * bb;
            unsigned char *codes = out + (q8 ? 2 : 4) * PANEL;
            for (int r = 0; r < PANEL; r++) {
                int row = panel * PANEL + r;
                if (row >= n) { /* zero scale, min and codes: the padding's products are zeros, never stored */
                    out[2 * r] = out[2 * r + 1] = 0;
                    if (!q8) out[2 * (PANEL + r)] = out[2 * (PANEL + r) + 1] = 0;
                    for (int c = 0; c < (q8 ? 32 : 16); c++) codes[c * PANEL + r] = 0;
                    continue;
                }
                const unsigned char *blk = src + (size_t)row * row_bytes + (size_t)b * gguf_block_bytes(scheme);
                out[2 * r] = blk[0], out[2 * r + 1] = blk[1]; /* d */
                if (q8) {
                    for (int c = 0; c < 32; c++) codes[c * PANEL + r] = blk[2 + c];
                    continue;
                }
                if (scheme == SCHEME_Q4_1) out[2 * (PANEL + r)] = blk[2], out[2 * (PANEL + r) + 1] = blk[3]; /* m */
                else out[2 * (PANEL + r)] = out[2 * (PANEL + r) + 1] = 0; /* q4_0's min is -8 d, made at use */
                const unsigned char *qs = blk + (scheme == SCHEME_Q4_1 ? 4 : 2); /* byte j: column j low, j + 16 high */
                for (int c = 0; c < 16; c++) {
                    int lo = 2 * c < 16 ? qs[2 * c] & 15 : qs[2 * c - 16] >> 4;
                    int hi = 2 * c + 1 < 16 ? qs[2 * c + 1] & 15 : qs[2 * c + 1 - 16] >> 4;
                    codes[c * PANEL + r] = (unsigned char)(lo | hi << 4);
                }
            }
        }
}

/* Columns 32 j .. 32 j + 31 of a q4_k panel super-block as f32, [32][PANEL]: (d * sc) * q - dmin * mn, the
 * product exact and the difference rounded once, as gguf's two numpy operations do (and -x is exact, so the
 * fused multiply-add of the negated min is the same subtraction). */
static void dequantize_q4_k(const unsigned char *sup, int j, float *dst) {
    const unsigned short *dd = (const unsigned short *)sup;
    const unsigned char *codes = sup + (size_t)(20 + 16 * j) * PANEL;
    vec d[3], neg_min[3];
    for (int g = 0; g < 3; g++) {
        d[g] = vmul(load_f16(dd + VL * g), itof(load_u8i(sup + (size_t)(4 + j) * PANEL + VL * g)));
        neg_min[g] = vmul(vmul(load_f16(dd + PANEL + VL * g), itof(load_u8i(sup + (size_t)(12 + j) * PANEL + VL * g))),
                          vset1(-1.0f));
    }
    for (int c = 0; c < 16; c++)
        for (int g = 0; g < 3; g++) {
            vec lo, hi;
            load_nibbles(codes + c * PANEL + VL * g, &lo, &hi);
            vstore(dst + 2 * c * PANEL + VL * g, vfmadd(d[g], lo, neg_min[g]));
            vstore(dst + (2 * c + 1) * PANEL + VL * g, vfmadd(d[g], hi, neg_min[g]));
        }
}

/* Columns 32 j .. 32 j + 31 of a q6_k panel super-block as f32, [32][PANEL]: (d * sc) * (q - 32), two rounded
 * products as gguf's. */
static void dequantize_q6_k(const unsigned char *sup, int j, float *dst) {
    const unsigned short *dd = (const unsigned short *)sup;
    const unsigned char *low = sup + (size_t)(18 + 16 * j) * PANEL, *high = sup + (size_t)(146 + 8 * j) * PANEL;
    const ivec fifteen = iset1(15), three = iset1(3), bias = iset1(32);
    for (int g = 0; g < 3; g++) {
        vec d = load_f16(dd + VL * g);
        vec scale[2] = {vmul(d, load_i8(sup + (size_t)(2 + 2 * j) * PANEL + VL * g)),
                        vmul(d, load_i8(sup + (size_t)(3 + 2 * j) * PANEL + VL * g))};
        for (int c = 0; c < 8; c++) { /* columns 4c .. 4c + 3 */
            ivec n0 = load_u8i(low + 2 * c * PANEL + VL * g), n1 = load_u8i(low + (2 * c + 1) * PANEL + VL * g);
            ivec h = load_u8i(high + c * PANEL + VL * g);
            ivec q[4] = {ior(iand(n0, fifteen), isll(iand(h, three), 4)),
                         ior(isrl(n0, 4), isll(iand(isrl(h, 2), three), 4)),
                         ior(iand(n1, fifteen), isll(iand(isrl(h, 4), three), 4)),
                         ior(isrl(n1, 4), isll(isrl(h, 6), 4))};
            for (int t = 0; t < 4; t++)
                vstore(dst + (4 * c + t) * PANEL + VL * g, vmul(scale[c / 4], itof(isub(q[t], bias))));
        }
    }
}

/* The scales d and mins m of a panel's block of 32 (q4_0's min is -8 d; q8_0 has none), three vectors each. */
static inline __attribute__((always_inline)) void block_scales(int scheme, const unsigned char *src, vec d[3],
                                                               vec m[3]) {
    const unsigned short *scales = (const unsigned short *)src;
    for (int g = 0; g < 3; g++) {
        d[g] = load_f16(scales + VL * g);
        m[g] = scheme == SCHEME_Q4_1 ? load_f16(scales + PANEL + VL * g)
             : scheme == SCHEME_Q4_0 ? vmul(d[g], vset1(-8.0f)) : vzero();
    }
}

/* Group g of columns 2c and 2c + 1 of the panel's block of 32 at src as f32, exactly gguf's values: q8_0's d * q,
 * q4's d * q + m rounded once. Both product paths dequantize through this, so their weights are the same bits. */
static inline __attribute__((always_inline)) void column_pair(int scheme, const unsigned char *src, const vec d[3],
                                                              const vec m[3], int c, int g, vec *w0, vec *w1) {
    if (scheme == SCHEME_Q8_0) {
        const unsigned char *codes = src + 2 * PANEL + VL * g;
        *w0 = vmul(d[g], load_i8(codes + 2 * c * PANEL));
        *w1 = vmul(d[g], load_i8(codes + (2 * c + 1) * PANEL));
        return;
    }
    vec lo, hi;
    load_nibbles(src + 4 * PANEL + c * PANEL + VL * g, &lo, &hi);
    *w0 = vfmadd(d[g], lo, m[g]);
    *w1 = vfmadd(d[g], hi, m[g]);
}

/* BODY once for each group g (of 3) of each column pair c (of 16) of the panel's block of 32 at src, with w0 and
 * w1 that group of columns 2c and 2c + 1 (column_pair): the order both product paths take a block's weights in. */
#define EACH_COLUMN_PAIR(scheme, src, BODY)                                                                        \
    do {                                                                                                           \
        vec d_[3], m_[3];                                                                                          \
        block_scales(scheme, src, d_, m_);                                                                         \
        for (int c = 0; c < 16; c++)                                                                               \
            for (int g = 0; g < 3; g++) {                                                                          \
                vec w0, w1;                                                                                        \
                column_pair(scheme, src, d_, m_, c, g, &w0, &w1);                                                  \
                BODY                                                                                               \
            }                                                                                                      \
    } while (0)

/* Columns kb .. kb + kc of a panel (both multiples of 32) as f32, [kc][PANEL]. */
static void dequantize_slice(int scheme, const unsigned char *panel, int kb, int kc, float *dst) {
    size_t bb = panel_block_bytes(scheme);
    if (kquant(scheme)) {
        for (int c = kb; c < kb + kc; c += 32, dst += 32 * PANEL) {
            const unsigned char *sup = panel + (size_t)(c / QK_K) * bb;
            if (scheme == SCHEME_Q4_K) dequantize_q4_k(sup, c % QK_K / 32, dst);
            else dequantize_q6_k(sup, c % QK_K / 32, dst);
        }
        return;
    }
    const unsigned char *src = panel + (size_t)(kb / 32) * bb;
    for (int b = 0; b < kc / 32; b++, src += bb, dst += 32 * PANEL)
        EACH_COLUMN_PAIR(scheme, src, {
            vstore(dst + 2 * c * PANEL + VL * g, w0);
            vstore(dst + (2 * c + 1) * PANEL + VL * g, w1);
        });
}

/* FUSED_ROWS rows at most (a few decodes, a short verified chunk) take their products straight from registers: a
 * slice made in L1 and read back costs a store and a load a weight, which many rows share but a few pay nearly
 * alone, and one row's 3 FMA chains a panel wait on each other's latency; so each block is dequantized into
 * registers and multiplied at once, one panel at a time (two side by side ran out of registers: their scales and
 * mins spilled). 3 accumulators a row, with the scales and mins, fit 5 rows in AVX-512's 32 registers and 3 in
 * AVX2's 16. The weights are the slice's values (the same operations) and each output the same FMA chain over k in
 * order, so the bits are those of the slice path. Blocks of 32 only (q4_0, q4_1, q8_0). */
/* Blocks of a panel asked into L1 ahead of the one multiplied: few rows make the product as fast as its weights
 * arrive, and a model's weights stream from memory at every step (they outgrow the caches). A panel's first blocks
 * are asked for before its first product: with the helper, the next panel a thread takes is not the one after. */
#define FUSED_AHEAD 4
/* Up to FUSED_MAX rows go FUSED_ROWS at a time over each panel (its blocks still in L1 or L2 for the next group)
 * rather than through a slice: with AVX-512 that is faster up to ~12 rows when the weights come from memory, with
 * AVX2's 3 rows a group it never is (bench/RESULTS.md, the CPU kernels). */
#if VL == 16
#define FUSED_ROWS 5
#define FUSED_MAX 10
#else
#define FUSED_ROWS 3
#define FUSED_MAX 3
#endif
static inline __attribute__((always_inline)) void fused_panel(int mr, int scheme, int k, const float *x, size_t ldx,
                                                              const unsigned char *panel, float *out, int ldo,
                                                              int cols) {
    size_t bb = panel_block_bytes(scheme);
    vec acc[FUSED_ROWS][3];
    for (int i = 0; i < mr; i++)
        for (int g = 0; g < 3; g++) acc[i][g] = vzero();
    for (int b = 0; b < FUSED_AHEAD && b < k / 32; b++) prefetch_l1(panel + (size_t)b * bb, bb);
    for (int b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        prefetch_l1(panel + (size_t)(b + FUSED_AHEAD) * bb, bb); /* past the panel: the next one's, or harmless */
        EACH_COLUMN_PAIR(scheme, panel + (size_t)b * bb, {
            for (int i = 0; i < mr; i++) {
                acc[i][g] = vfmadd(vset1(xb[i * ldx + 2 * c]), w0, acc[i][g]);
                acc[i][g] = vfmadd(vset1(xb[i * ldx + 2 * c + 1]), w1, acc[i][g]);
            }
        });
    }
    float tile[PANEL] __attribute__((aligned(64)));
    for (int i = 0; i < mr; i++) {
        for (int g = 0; g < 3; g++) vstore(tile + VL * g, acc[i][g]);
        memcpy(out + (size_t)i * ldo, tile, (size_t)cols * sizeof(float));
    }
}

static void fused_rows(int m, int k, const float *x, int ldx, const unsigned char *w, int scheme, float *out, int ldo,
                       int n0, int n1) {
    size_t panel_bytes = (size_t)(k / 32) * panel_block_bytes(scheme);
    int groups = (m + FUSED_ROWS - 1) / FUSED_ROWS;
    for (int n = n0; n < n1; n += PANEL) {
        const unsigned char *panel = w + (size_t)(n / PANEL) * panel_bytes;
        int cols = n1 - n < PANEL ? n1 - n : PANEL;
        for (int i = 0, g = groups; i < m; g--) {
            int mr = (m - i + g - 1) / g; /* groups as even as they go: 6 rows are 3 + 3, not 5 + 1 */
            const float *xs = x + (size_t)i * ldx;
            float *os = out + (size_t)i * ldo + n;
            switch (mr) { /* a constant row count per call: the row loops unroll */
            case 1: fused_panel(1, scheme, k, xs, ldx, panel, os, ldo, cols); break;
            case 2: fused_panel(2, scheme, k, xs, ldx, panel, os, ldo, cols); break;
            case 3: fused_panel(3, scheme, k, xs, ldx, panel, os, ldo, cols); break;
#if FUSED_ROWS > 3
            case 4: fused_panel(4, scheme, k, xs, ldx, panel, os, ldo, cols); break;
            default: fused_panel(5, scheme, k, xs, ldx, panel, os, ldo, cols); break;
#endif
            }
            i += mr;
        }
    }
}

/* Rows [n0, n1) of the output's columns (n0 a multiple of PANEL: callers split n across threads); w: repack_blocks'
 * panels; k a multiple of block_cols(scheme). Strides are in elements. Up to FUSED_MAX rows of blocks of 32 go
 * through fused_rows; up to PANEL_ROWS rows (a decode)
 * dequantize a KC slice at a time into L1 and keep their partial sums in acc between slices; more rows (a prompt
 * chunk) dequantize a whole panel once and run the f32 panels' tiles over it. The sums are the same either way,
 * and the same as gemm_fpanels' over gguf's dequantization: one FMA chain over k in order, from zero. */
void gemm_qpanels(int m, int k, const float *x, int ldx, const unsigned char *w, int scheme, float *out, int ldo,
                  int n0, int n1) {
    if (m <= FUSED_MAX && !kquant(scheme)) {
        fused_rows(m, k, x, ldx, w, scheme, out, ldo, n0, n1);
        return;
    }
    int cols = block_cols(scheme);
    size_t bb = panel_block_bytes(scheme), panel_bytes = (size_t)(k / cols) * bb;
    if (m > PANEL_ROWS) {
        float *whole = aligned_alloc(64, ((size_t)k * PANEL * sizeof(float) + 63) / 64 * 64);
        if (!whole) { /* no room for a panel: the rows go PANEL_ROWS at a time, with the same sums */
            for (int i = 0; i < m; i += PANEL_ROWS)
                gemm_qpanels(m - i < PANEL_ROWS ? m - i : PANEL_ROWS, k, x + (size_t)i * ldx, ldx, w, scheme,
                             out + (size_t)i * ldo, ldo, n0, n1);
            return;
        }
        for (int n = n0; n < n1; n += PANEL) {
            dequantize_slice(scheme, w + (size_t)(n / PANEL) * panel_bytes, 0, k, whole);
            panel_rows(m, k, x, ldx, whole, out, ldo, n, n1 - n < PANEL ? n1 - n : PANEL);
        }
        free(whole);
        return;
    }
    float acc[PANEL_ROWS * PANEL] __attribute__((aligned(64)));
    float slice[KC * PANEL] __attribute__((aligned(64)));
    for (int n = n0; n < n1; n += PANEL) {
        const unsigned char *panel = w + (size_t)(n / PANEL) * panel_bytes;
        for (int kb = 0; kb < k; kb += KC) {
            int kc = k - kb < KC ? k - kb : KC;
            /* The next slice's blocks, this panel's or the next panel's first, go to L2 while this one is
             * multiplied (a K-quant slice's whole super-blocks: their scales lead them). */
            int next_kb = kb + KC < k ? kb + KC : 0, next_kc = k - next_kb < KC ? k - next_kb : KC;
            const unsigned char *next = next_kb ? panel : n + PANEL < n1 ? panel + panel_bytes : 0;
            if (next) {
                size_t first = (size_t)(next_kb / cols), last = (size_t)((next_kb + next_kc - 1) / cols);
                prefetch_l2(next + first * bb, (last - first + 1) * bb);
            }
            dequantize_slice(scheme, panel, kb, kc, slice);
            const float *xs = x + kb;
            int i = 0;
            for (; i + 4 <= m; i += 4) panel_tile(4, kc, xs + (size_t)i * ldx, ldx, slice, acc + i * PANEL, kb == 0);
            if (m - i == 3) panel_tile(3, kc, xs + (size_t)i * ldx, ldx, slice, acc + i * PANEL, kb == 0);
            if (m - i == 2) panel_tile(2, kc, xs + (size_t)i * ldx, ldx, slice, acc + i * PANEL, kb == 0);
            if (m - i == 1) panel_tile(1, kc, xs + (size_t)i * ldx, ldx, slice, acc + i * PANEL, kb == 0);
        }
        int cols_out = n1 - n < PANEL ? n1 - n : PANEL;
        for (int i = 0; i < m; i++)
            for (int j = 0; j < cols_out; j++) out[(size_t)i * ldo + n + j] = acc[i * PANEL + j];
    }
}

/* Products over int8 activations (weights "packed-q8"), llama.cpp's arithmetic for its Q4/Q8 blocks: each row of
 * x is quantized once per product in blocks of 32 (quantize_rows_q8: d = amax / 127, q = x / d rounded to the
 * nearest even, and its sum), and a block's contribution to an output is its integer dot product with the weight's
 * codes, exact in 32 bits, times d_w * d_x, plus q4_1's min times d_x * sum(q). The integer dots take one
 * instruction per 4 codes and lane (AVX-512 VNNI's vpdpbusd, else vpmaddubsw + vpmaddwd: the same exact sums), where
 * the f32 products spend several per weight dequantizing it: a decode row reads its weights at the memory's pace.
 * Each output is one FMA chain over the blocks in order, from zero, in every build and for every row count: a row's
 * bits do not depend on the rows beside it, the build or the thread split.
 * The weights are laid out again (repack_q8) in panels of PANEL rows: per block of 32 columns, the PANEL f16 scales,
 * for q4_1 the PANEL f16 mins, then the codes in groups that a vector lane reads as one 32-bit word, PANEL words a
 * group: q4 groups of 8 columns (byte t of a word: column t in the low nibble, t + 4 in the high one), q8_0 groups of
 * 4 (byte t: column t, signed). */
#define Q8_BLOCK 32

size_t q8_panel_block_bytes(int scheme) {
    switch (scheme) {
    case SCHEME_Q8_0: return 2 * PANEL + 32 * PANEL;
    case SCHEME_Q4_1: return 4 * PANEL + 16 * PANEL;
    default: return 2 * PANEL + 16 * PANEL;
    }
}

/* GGUF rows [n, k / 32 blocks] of q4_0, q4_1 or q8_0 -> panels [ceil(n / PANEL)][k / 32][q8_panel_block_bytes];
 * rows past n are zero. */
void repack_q8(int scheme, int n, int k, const unsigned char *src, unsigned char *dst) {
    int blocks = k / 32, q8 = scheme == SCHEME_Q8_0, q41 = scheme == SCHEME_Q4_1;
    size_t row_bytes = (size_t)blocks * gguf_block_bytes(scheme), bb = q8_panel_block_bytes(scheme);
    for (int panel = 0; panel < (n + PANEL - 1) / PANEL; panel++)
        for (int b = 0; b < blocks; b++) {
            unsigned char *out = dst + ((size_t)panel * blocks + b) * bb;
            unsigned char *codes = out + (q41 ? 4 : 2) * PANEL;
            memset(out, 0, bb); /* the padding rows: zero scales and codes, products never stored */
            for (int r = 0; r < PANEL && panel * PANEL + r < n; r++) {
                const unsigned char *blk = src + (size_t)(panel * PANEL + r) * row_bytes + (size_t)b * gguf_block_bytes(scheme);
                out[2 * r] = blk[0], out[2 * r + 1] = blk[1]; /* d */
                if (q41) out[2 * (PANEL + r)] = blk[2], out[2 * (PANEL + r) + 1] = blk[3]; /* m */
                if (q8) {
                    for (int c = 0; c < 32; c++) codes[((c / 4) * PANEL + r) * 4 + c % 4] = blk[2 + c];
                    continue;
                }
                const unsigned char *qs = blk + (q41 ? 4 : 2); /* gguf: byte j holds column j (low), j + 16 (high) */
                for (int c = 0; c < 32; c++) {
                    int q = c < 16 ? qs[c] & 15 : qs[c - 16] >> 4, g = c / 8, t = c % 8;
                    codes[(g * PANEL + r) * 4 + t % 4] |= (unsigned char)(q << (t < 4 ? 0 : 4));
                }
            }
        }
}

/* Rows of x [m, k] (k a multiple of 32) as int8 blocks: q [m, k], per row and block its d in ds [m, k / 32] and
 * sum(q) in sums [m, k / 32]. The maximum is exact in any order and each code is x * (1 / d)
 * rounded to the nearest even (the vector conversion in the default rounding mode): the same in every build. */
void quantize_rows_q8(int m, int k, const float *x, int ldx, signed char *q, float *ds, int *sums) {
    int blocks = k / Q8_BLOCK;
    const vec sign = vset1(-0.0f);
    for (int i = 0; i < m; i++)
        for (int b = 0; b < blocks; b++) {
            const float *xb = x + (size_t)i * ldx + Q8_BLOCK * b;
            signed char *qb = q + (size_t)i * k + Q8_BLOCK * b;
            vec top = vzero();
            for (int j = 0; j < Q8_BLOCK; j += VL) top = V(max_ps)(top, V(andnot_ps)(sign, vload(xb + j)));
            float lanes[VL], amax = 0.0f;
            vstore(lanes, top);
            for (int j = 0; j < VL; j++) amax = fmaxf(amax, lanes[j]);
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int codes[Q8_BLOCK], sum = 0;
            for (int j = 0; j < Q8_BLOCK; j += VL)
                VI(storeu)((void *)(codes + j), V(cvtps_epi32)(vmul(vload(xb + j), vset1(id))));
            for (int j = 0; j < Q8_BLOCK; j++) qb[j] = (signed char)codes[j], sum += codes[j];
            size_t at = (size_t)i * blocks + b;
            ds[at] = d, sums[at] = sum;
        }
}

/* acc += the dot of each 32-bit lane's 4 unsigned bytes u with the 4 signed bytes s (|u * s + u' * s'| < 2^15
 * for the codes here, so the 16-bit pair sums never saturate). */
#ifdef __AVX512F__
#define DOT4_PLAIN(acc, u, s) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
#define DOT4_VNNI(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define ILOAD(p) _mm512_loadu_si512((const void *)(p))
#define BSET1(v) _mm512_set1_epi8(v)
/* s negated where w is negative, and |w|: u * s' = w * s for q8_0's signed codes */
#define SIGNED_PAIR(w, s, u, s2) do { u = _mm512_abs_epi8(w); \
    s2 = _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(w), _mm512_setzero_si512(), s); } while (0)
#else
#define DOT4_PLAIN(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define ILOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define BSET1(v) _mm256_set1_epi8(v)
#define SIGNED_PAIR(w, s, u, s2) do { u = _mm256_abs_epi8(w); s2 = _mm256_sign_epi8(s, w); } while (0)
#endif

/* One panel's outputs n .. n + cols for rows 0..m of the quantized x; DOT is DOT4_PLAIN or DOT4_VNNI. Rows go
 * Q8_ROWS at a time, so that a block's codes are unpacked and its scales read once for all of them. */
#ifdef __AVX512F__
#define Q8_ROWS 4 /* 12 dot and 6 code vectors of the 32 registers */
#else
#define Q8_ROWS 2 /* 6 dot and 6 code vectors of the 16 */
#endif
#define Q8_PANEL_BODY(DOT)                                                                                         \
    int blocks = k / Q8_BLOCK, q41 = scheme == SCHEME_Q4_1, q8 = scheme == SCHEME_Q8_0;                            \
    size_t bb = q8_panel_block_bytes(scheme);                                                                      \
    const ivec low = BSET1(15);                                                                                    \
    for (int i0 = 0; i0 < m; i0 += Q8_ROWS) {                                                                      \
        int rows = m - i0 < Q8_ROWS ? m - i0 : Q8_ROWS;                                                            \
        vec acc[Q8_ROWS][3];                                                                                       \
        for (int r = 0; r < Q8_ROWS; r++)                                                                          \
            for (int v = 0; v < 3; v++) acc[r][v] = vzero();                                                       \
        const unsigned char *blk = panel;                                                                          \
        for (int b = 0; b < blocks; b++, blk += bb) {                                                              \
            ivec dot[Q8_ROWS][3];                                                                                  \
            for (int r = 0; r < Q8_ROWS; r++)                                                                      \
                for (int v = 0; v < 3; v++) dot[r][v] = VI(setzero)();                                             \
            const unsigned char *codes = blk + (q41 ? 4 : 2) * PANEL;                                              \
            if (q8) {                                                                                              \
                for (int g = 0; g < 8; g++) {                                                                      \
                    ivec w[3];                                                                                     \
                    for (int v = 0; v < 3; v++) w[v] = ILOAD(codes + (g * PANEL + VL * v) * 4);                    \
                    for (int r = 0; r < Q8_ROWS; r++) {                                                            \
                        if (r >= rows) break;                                                                      \
                        int word;                                                                                  \
                        memcpy(&word, qx + (size_t)(i0 + r) * k + Q8_BLOCK * b + 4 * g, 4);                        \
                        ivec s = iset1(word);                                                                      \
                        for (int v = 0; v < 3; v++) {                                                              \
                            ivec u, s2;                                                                            \
                            SIGNED_PAIR(w[v], s, u, s2);                                                           \
                            dot[r][v] = DOT(dot[r][v], u, s2);                                                     \
                        }                                                                                          \
                    }                                                                                              \
                }                                                                                                  \
            } else {                                                                                               \
                for (int g = 0; g < 4; g++) {                                                                      \
                    ivec lo[3], hi[3];                                                                             \
                    for (int v = 0; v < 3; v++) {                                                                  \
                        ivec w = ILOAD(codes + (g * PANEL + VL * v) * 4);                                          \
                        lo[v] = iand(w, low), hi[v] = iand(V(srli_epi16)(w, 4), low);                              \
                    }                                                                                              \
                    for (int r = 0; r < Q8_ROWS; r++) {                                                            \
                        if (r >= rows) break;                                                                      \
                        int lo_word, hi_word;                                                                      \
                        const signed char *qb = qx + (size_t)(i0 + r) * k + Q8_BLOCK * b + 8 * g;                  \
                        memcpy(&lo_word, qb, 4);                                                                   \
                        memcpy(&hi_word, qb + 4, 4);                                                               \
                        ivec slo = iset1(lo_word), shi = iset1(hi_word);                                           \
                        for (int v = 0; v < 3; v++) dot[r][v] = DOT(DOT(dot[r][v], lo[v], slo), hi[v], shi);       \
                    }                                                                                              \
                }                                                                                                  \
            }                                                                                                      \
            const unsigned short *scales = (const unsigned short *)blk;                                            \
            vec d[3], mins[3];                                                                                     \
            for (int v = 0; v < 3; v++) {                                                                          \
                d[v] = load_f16(scales + VL * v);                                                                  \
                mins[v] = q41 ? load_f16(scales + PANEL + VL * v) : vzero();                                       \
            }                                                                                                      \
            for (int r = 0; r < Q8_ROWS; r++) {                                                                    \
                if (r >= rows) break;                                                                              \
                size_t at = (size_t)(i0 + r) * blocks + b;                                                         \
                vec dx = vset1(ds[at]), sx = vset1(ds[at] * (float)sums[at]);                                      \
                ivec bias = iset1(scheme == SCHEME_Q4_0 ? 8 * sums[at] : 0);                                       \
                for (int v = 0; v < 3; v++) {                                                                      \
                    acc[r][v] = vfmadd(itof(isub(dot[r][v], bias)), vmul(d[v], dx), acc[r][v]);                    \
                    if (q41) acc[r][v] = vfmadd(mins[v], sx, acc[r][v]);                                           \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < rows; r++) {                                                                           \
            float lanes[PANEL] __attribute__((aligned(64)));                                                       \
            for (int v = 0; v < 3; v++) vstore(lanes + VL * v, acc[r][v]);                                         \
            memcpy(out + (size_t)(i0 + r) * ldo + n, lanes, (size_t)cols * sizeof(float));                        \
        }                                                                                                          \
    }

static void q8_panel_plain(int m, int k, const signed char *qx, const float *ds, const int *sums,
                           const unsigned char *panel, int scheme, float *out, int ldo, int n, int cols) {
    Q8_PANEL_BODY(DOT4_PLAIN)
}
#ifdef __AVX512F__
__attribute__((target("avx512vnni"))) static void q8_panel_vnni(int m, int k, const signed char *qx, const float *ds,
        const int *sums, const unsigned char *panel, int scheme, float *out, int ldo, int n, int cols) {
    Q8_PANEL_BODY(DOT4_VNNI)
}
#endif

/* Whether the integer dots use VNNI: -1 until first asked (the CPU's answer), or as q8_use_vnni set it. */
static int use_vnni = -1;
void q8_use_vnni(int on) { use_vnni = on; }
int q8_vnni(void) {
#ifdef __AVX512F__
    if (use_vnni < 0) use_vnni = __builtin_cpu_supports("avx512vnni") ? 1 : 0;
    return use_vnni;
#else
    return 0;
#endif
}

/* out[m, n0..n1) = x . w.T over quantize_rows_q8's rows (qx, ds, sums) and repack_q8's panels of `scheme`;
 * n0 a multiple of PANEL. */
void gemm_q8panels(int m, int k, const signed char *qx, const float *ds, const int *sums, const unsigned char *w,
                   int scheme, float *out, int ldo, int n0, int n1) {
    size_t panel_bytes = (size_t)(k / Q8_BLOCK) * q8_panel_block_bytes(scheme);
    int vnni = q8_vnni();
    for (int n = n0; n < n1; n += PANEL) {
        const unsigned char *panel = w + (size_t)(n / PANEL) * panel_bytes;
        int cols = n1 - n < PANEL ? n1 - n : PANEL;
        if (n + PANEL < n1) prefetch_l2(panel + panel_bytes, panel_bytes);
#ifdef __AVX512F__
        if (vnni) {
            q8_panel_vnni(m, k, qx, ds, sums, panel, scheme, out, ldo, n, cols);
            continue;
        }
#endif
        (void)vnni;
        q8_panel_plain(m, k, qx, ds, sums, panel, scheme, out, ldo, n, cols);
    }
}

/* A helper thread for the products of one or two rows (a lone stream's decode) and of light steps (few sessions;
 * cpu_kernels.py's _helped): such a product is too short for a hand-off through Python's thread pool, and its stage
 * is then usually the only one computing on its host (the others wait on it), so an executor held to one thread may
 * still borrow one more core for it. The caller and
 * the helper take chunks of two panels from one atomic counter; the caller never waits for a chunk the helper has
 * not begun, so a helper that is descheduled (the host busy after all) costs nothing but its chunk in progress.
 * Columns are split, never sums: every output has the bits of the one-thread product.
 * The claim word holds the job's generation (24 bits), its chunk count and the next chunk (20 bits each). */
typedef struct {
    int m, k, ldx, scheme, ldo, n;
    const void *x; /* f32 rows, or quantize_rows_q8's codes (scheme >= Q8_JOB) */
    const void *w;
    float *out;
    const float *ds; /* quantize_rows_q8's scales and sums, for scheme >= Q8_JOB */
    const int *sums;
} shared_job;
#define Q8_JOB 16 /* a job's scheme + Q8_JOB: gemm_q8panels */
static shared_job job;
static _Atomic unsigned long long claim;
static _Atomic unsigned int generation; /* the futex word the helper sleeps on */
static _Atomic int finished;            /* chunks done in the current generation */
static _Atomic int helper_sleeping;
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER; /* one caller at a time; others go alone */
static int helper_started;
static _Atomic long long helped; /* chunks the helper has taken, for the tests */
static _Atomic int helper_resting; /* set by helper_rest: the step is over, sleep now */
/* ~0.5 ms: longer than any gap between a step's products (a layer's attention and ropes lie between two of them),
 * so it never sleeps inside a step and comes late to the next product; the step's end ends it sooner (helper_rest),
 * so it does not spin on into the core the next stage computes on. */
#define HELPER_SPIN_CYCLES 2000000ULL
#define CHUNK_COLS (2 * PANEL)

static void run_chunk(const shared_job *j, int c) {
    int n0 = c * CHUNK_COLS, n1 = n0 + CHUNK_COLS < j->n ? n0 + CHUNK_COLS : j->n;
    if (j->scheme >= Q8_JOB)
        gemm_q8panels(j->m, j->k, j->x, j->ds, j->sums, j->w, j->scheme - Q8_JOB, j->out, j->ldo, n0, n1);
    else if (j->scheme < 0) gemm_fpanels(j->m, j->k, j->x, j->ldx, j->w, j->out, j->ldo, n0, n1);
    else gemm_qpanels(j->m, j->k, j->x, j->ldx, j->w, j->scheme, j->out, j->ldo, n0, n1);
}

/* Chunks of generation g until none is left; the helper and the caller alike. */
static void take_chunks(unsigned g, int helper) {
    for (;;) {
        unsigned long long v = atomic_load(&claim);
        unsigned idx = v & 0xFFFFF, count = (v >> 20) & 0xFFFFF;
        if ((v >> 40) != (g & 0xFFFFFF) || idx >= count) return;
        if (!atomic_compare_exchange_weak(&claim, &v, v + 1)) continue;
        shared_job j = job; /* stable: its generation cannot end before this chunk is finished */
        run_chunk(&j, (int)idx);
        if (helper) atomic_fetch_add(&helped, 1);
        atomic_fetch_add(&finished, 1);
    }
}

static void *helper_main(void *unused) {
    (void)unused;
    unsigned seen = atomic_load(&generation);
    for (;;) {
        unsigned long long until = __rdtsc() + HELPER_SPIN_CYCLES;
        while (atomic_load(&generation) == seen && __rdtsc() < until && !atomic_load(&helper_resting)) _mm_pause();
        if (atomic_load(&generation) == seen) {
            atomic_store(&helper_sleeping, 1);
            while (atomic_load(&generation) == seen)
                syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_store(&helper_sleeping, 0);
        }
        seen = atomic_load(&generation);
        take_chunks(seen, 1);
    }
    return NULL;
}

/* Starts the helper (once); 0 when it runs. */
int start_helper(void) {
    pthread_mutex_lock(&caller);
    if (!helper_started) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        helper_started = pthread_create(&t, &attr, helper_main, NULL) == 0;
        pthread_attr_destroy(&attr);
    }
    pthread_mutex_unlock(&caller);
    return helper_started ? 0 : -1;
}

/* The caller's step is over: the helper sleeps until the next product instead of spinning on. */
void helper_rest(void) { atomic_store(&helper_resting, 1); }

long long helper_chunks(void) { return atomic_load(&helped); }

/* out[m, 0..n) = x . w.T with the helper: the job's product (run_chunk) over all of its columns. */
static void gemm_shared(shared_job whole) {
    int chunks = (whole.n + CHUNK_COLS - 1) / CHUNK_COLS;
    if (!helper_started || chunks < 2 || chunks > 0xFFFFF || pthread_mutex_trylock(&caller) != 0) {
        for (int c = 0; c < chunks; c++) run_chunk(&whole, c);
        return;
    }
    job = whole;
    atomic_store(&helper_resting, 0);
    atomic_store(&finished, 0);
    unsigned g = atomic_load(&generation) + 1;
    atomic_store(&claim, ((unsigned long long)(g & 0xFFFFFF) << 40) | ((unsigned long long)chunks << 20));
    atomic_store(&generation, g);
    if (atomic_load(&helper_sleeping)) syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    take_chunks(g, 0);
    for (int spins = 0; atomic_load(&finished) < chunks; spins++) {
        if (spins < 4096) _mm_pause();
        else sched_yield(); /* the helper's chunk in progress, its thread descheduled */
    }
    pthread_mutex_unlock(&caller);
}

void gemm_qpanels_shared(int m, int k, const float *x, int ldx, const unsigned char *w, int scheme, float *out,
                         int ldo, int n) {
    gemm_shared((shared_job){m, k, ldx, scheme, ldo, n, x, w, out, NULL, NULL});
}

void gemm_fpanels_shared(int m, int k, const float *x, int ldx, const float *w, float *out, int ldo, int n) {
    gemm_shared((shared_job){m, k, ldx, -1, ldo, n, x, w, out, NULL, NULL});
}

/* gemm_q8panels with the helper, of f32 rows x quantized here first (quantize_rows_q8, into this thread's scratch):
 * a lone row's product in one call from Python, where a quantizing call and its buffers cost as much as the
 * product saves. 0, or -1 where there was no memory for the codes (nothing is computed then). */
int gemm_q8panels_shared(int m, int k, const float *x, int ldx, const unsigned char *w, int scheme, float *out,
                         int ldo, int n) {
    static __thread signed char *qx;
    static __thread float *ds;
    static __thread int *sums;
    static __thread size_t room;
    size_t need = (size_t)m * k;
    if (need > room) {
        free(qx), free(ds), free(sums);
        qx = malloc(need), ds = malloc(need / Q8_BLOCK * sizeof(float)), sums = malloc(need / Q8_BLOCK * sizeof(int));
        room = qx && ds && sums ? need : 0;
        if (!room) {
            free(qx), free(ds), free(sums);
            qx = NULL, ds = NULL, sums = NULL;
            return -1;
        }
    }
    quantize_rows_q8(m, k, x, ldx, qx, ds, sums);
    gemm_shared((shared_job){m, k, k, scheme + Q8_JOB, ldo, n, qx, w, out, ds, sums});
    return 0;
}

/* Paged attention for decode, one query row per sequence (f32): out[s, h] = softmax(q[s, h] . K[s]^T * scale) V[s]
 * over the keys 0..pos[s] of sequence s, read in place from the pools through its block table. torch's version
 * gathers every block, permutes it for a batched matmul and masks the padding: two copies of the sequences' K
 * and V per layer, which cost SmolLM2 a sixth of a 16-row decode step. Every number depends on this sequence's
 * rows alone, computed in a fixed order.
 * The query heads that share a kv head go up to HEADS_AT_ONCE at a time, so each K and V row is loaded once for
 * all of them (SmolLM2: 3 query heads a kv head). A score is one 8-lane FMA chain over d and a fixed horizontal
 * sum, four keys at once so that independent chains hide the FMA latency. The softmax runs 8 keys a vector with
 * exp as a polynomial (within 1 ulp of the exact value: 0.92 at worst over [-105, 0]). The weighted sum is each
 * lane one FMA chain over the keys in order. In a real step the KV comes from memory (16 sessions' KV is far larger
 * than the caches), so the order of the reads bounds it: see paged_decode_attention. */

#define KEYS_AT_ONCE 4
#define HEADS_AT_ONCE 3 /* 3 heads x 4 keys: 12 accumulators, 3 query vectors and a key vector in 16 ymm registers */
#define PREFETCH_SLOTS 8 /* keys ahead whose slots go to L2 while these are scored or summed */

/* scores[h * stride + r] = q[h] . k[r] for nh heads and KEYS_AT_ONCE keys. */
static inline __attribute__((always_inline)) void dots(int nh, const float *q, size_t ldq, const float *const *k,
                                                       int d, float *scores, size_t stride) {
    __m256 acc[HEADS_AT_ONCE][KEYS_AT_ONCE];
    for (int h = 0; h < nh; h++)
        for (int r = 0; r < KEYS_AT_ONCE; r++) acc[h][r] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) {
        __m256 qv[HEADS_AT_ONCE];
        for (int h = 0; h < nh; h++) qv[h] = _mm256_loadu_ps(q + h * ldq + i);
        for (int r = 0; r < KEYS_AT_ONCE; r++) {
            __m256 kv = _mm256_loadu_ps(k[r] + i);
            for (int h = 0; h < nh; h++) acc[h][r] = _mm256_fmadd_ps(qv[h], kv, acc[h][r]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int r = 0; r < KEYS_AT_ONCE; r++) {
            float s = hsum(acc[h][r]);
            for (int j = i; j < d; j++) s += q[h * ldq + j] * k[r][j];
            scores[h * stride + r] = s;
        }
}

/* The same for the keys past the last whole group of KEYS_AT_ONCE, one at a time. */
static inline __attribute__((always_inline)) void dot_1(int nh, const float *q, size_t ldq, const float *k, int d,
                                                        float *scores, size_t stride) {
    for (int h = 0; h < nh; h++) {
        __m256 acc = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * ldq + i), _mm256_loadu_ps(k + i), acc);
        float s = hsum(acc);
        for (; i < d; i++) s += q[h * ldq + i] * k[i];
        scores[h * stride] = s;
    }
}

/* e^x for x <= 0, 8 lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact to float
 * precision), e^r by its degree-7 Taylor polynomial (truncation below 1e-8 relative), times 2^n built in the
 * exponent bits. Below -87.3 (where 2^n would leave the normal range) the result is 0, as expf's is near there. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), ln2_hi = _mm256_set1_ps(0.693359375f),
                 ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, ln2_lo, _mm256_fnmadd_ps(n, ln2_hi, x));
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* p[0..keys) = softmax(p * scale) in place; p has room for a whole last vector (the caller's buffer is padded). */
static void softmax(float *p, int keys, float scale) {
    int vecs = (keys + 7) / 8, tail = keys - 8 * (vecs - 1);
    __m256 sc = _mm256_set1_ps(scale), top = _mm256_set1_ps(-INFINITY);
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 last = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(tail), lane)); /* real lanes of the last */
    for (int v = 0; v < vecs; v++) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + 8 * v), sc);
        if (v == vecs - 1) x = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, last);
        _mm256_storeu_ps(p + 8 * v, x);
        top = _mm256_max_ps(top, x);
    }
    __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
    t4 = _mm_max_ss(t4, _mm_movehdup_ps(t4));
    __m256 m = _mm256_set1_ps(_mm_cvtss_f32(t4)), total = _mm256_setzero_ps();
    for (int v = 0; v < vecs; v++) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + 8 * v), m));
        if (v == vecs - 1) e = _mm256_and_ps(e, last);
        _mm256_storeu_ps(p + 8 * v, e);
        total = _mm256_add_ps(total, e);
    }
    __m256 sum = _mm256_set1_ps(hsum(total));
    for (int v = 0; v < vecs; v++) _mm256_storeu_ps(p + 8 * v, _mm256_div_ps(_mm256_loadu_ps(p + 8 * v), sum));
}

/* q, out [t, hq, d]; k_pool, v_pool [slots, hkv, d]; table [t, blocks] pool block ids; pos [t]; scores: a
 * caller's buffer of hq * (blocks * block + 8) floats; rows: one of 2 * blocks * block pointers. A key's slot is
 * table[s, j / block] * block + j % block. window > 0: row s sees only its last `window` keys (a sliding window);
 * softcap > 0: scores become softcap * tanh(score * scale / softcap).
 * A row's keys are read slot by slot, every kv head of a slot one after the other: a block's slots are one run
 * of memory, and the slots PREFETCH_SLOTS keys ahead are fetched into L2 while these are used: a kv head at a
 * time read a slice of each slot from blocks anywhere in the pool and waited on memory for most of a step's
 * attention. The weighted sum keeps every head's output in L1 (out), each lane still one FMA chain over the keys
 * in order from zero, so the numbers are those of a head at a time. */
void paged_decode_attention(int t, int hq, int hkv, int d, int block, int blocks, const float *q,
                            const float *k_pool, const float *v_pool, const long long *table, const long long *pos,
                            float scale, int window, float softcap, float *out, float *scores, const float **rows) {
    int group = hq / hkv, d8 = d & ~7;
    size_t stride = (size_t)blocks * block + 8, slot_floats = (size_t)hkv * d, slot_bytes = slot_floats * sizeof(float);
    const float **k_rows = rows, **v_rows = rows + (size_t)blocks * block; /* each key's slot, all its kv heads */
    for (int s = 0; s < t; s++) {
        int first = window > 0 && pos[s] + 1 > window ? (int)pos[s] + 1 - window : 0; /* the window's first key */
        int keys = (int)pos[s] + 1 - first;
        const long long *table_row = table + (size_t)s * blocks;
        for (int j = 0; j < keys; j++) {
            size_t slot = (size_t)table_row[(first + j) / block] * block + (first + j) % block;
            k_rows[j] = k_pool + slot * slot_floats;
            v_rows[j] = v_pool + slot * slot_floats;
        }
        const float *qs = q + (size_t)s * hq * d;
        float *os = out + (size_t)s * hq * d;
        int j = 0;
        for (int r = 0; r < PREFETCH_SLOTS && r < keys; r++) prefetch_l2(k_rows[r], slot_bytes);
        for (; j + KEYS_AT_ONCE <= keys; j += KEYS_AT_ONCE)
            for (int kv = 0; kv < hkv; kv++) {
                if (kv == 0)
                    for (int r = j + PREFETCH_SLOTS; r < j + PREFETCH_SLOTS + KEYS_AT_ONCE && r < keys; r++)
                        prefetch_l2(k_rows[r], slot_bytes);
                const float *k[KEYS_AT_ONCE];
                for (int r = 0; r < KEYS_AT_ONCE; r++) k[r] = k_rows[j + r] + (size_t)kv * d;
                for (int h = kv * group, nh; h < (kv + 1) * group; h += nh) {
                    nh = (kv + 1) * group - h < HEADS_AT_ONCE ? (kv + 1) * group - h : HEADS_AT_ONCE;
                    /* a constant head count each, so dots unrolls for it */
                    if (nh == 3) dots(3, qs + (size_t)h * d, d, k, d, scores + h * stride + j, stride);
                    else if (nh == 2) dots(2, qs + (size_t)h * d, d, k, d, scores + h * stride + j, stride);
                    else dots(1, qs + (size_t)h * d, d, k, d, scores + h * stride + j, stride);
                }
            }
        for (; j < keys; j++)
            for (int kv = 0; kv < hkv; kv++)
                dot_1(group, qs + (size_t)kv * group * d, d, k_rows[j] + (size_t)kv * d, d,
                      scores + kv * group * stride + j, stride);
        float row_scale = scale;
        if (softcap > 0.0f) { /* Gemma 2's soft-cap of the scaled scores, scalar tanhf: the same code in both builds */
            for (int h = 0; h < hq; h++)
                for (int jj = 0; jj < keys; jj++)
                    scores[h * stride + jj] = softcap * tanhf(scores[h * stride + jj] * scale / softcap);
            row_scale = 1.0f;
        }
        for (int h = 0; h < hq; h++) softmax(scores + h * stride, keys, row_scale);
        memset(os, 0, (size_t)hq * d * sizeof(float));
        for (int r = 0; r < PREFETCH_SLOTS && r < keys; r++) prefetch_l2(v_rows[r], slot_bytes);
        for (int jj = 0; jj < keys; jj++)
            for (int kv = 0; kv < hkv; kv++) {
                if (kv == 0 && jj + PREFETCH_SLOTS < keys) prefetch_l2(v_rows[jj + PREFETCH_SLOTS], slot_bytes);
                const float *v = v_rows[jj] + (size_t)kv * d;
                for (int h = kv * group; h < (kv + 1) * group; h++) {
                    __m256 p = _mm256_broadcast_ss(scores + h * stride + jj);
                    float *o = os + (size_t)h * d;
                    for (int c = 0; c < d8; c += 8)
                        _mm256_storeu_ps(o + c, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + c), _mm256_loadu_ps(o + c)));
                }
            }
        for (int h = 0; h < hq; h++) /* the lanes past the last whole vector: a scalar chain each */
            for (int i = d8; i < d; i++) {
                float acc = 0.0f;
                for (int jj = 0; jj < keys; jj++) acc += scores[h * stride + jj] * v_rows[jj][(size_t)(h / group) * d + i];
                os[(size_t)h * d + i] = acc;
            }
    }
}

/* The elementwise ops of a decoder layer that torch runs as several kernels with tens of microseconds of dispatch
 * each, on a handful of rows (SmolLM2, 8 rows: rms_norm 55-70 us, rope 40-45 us a call, 60 of each a step). */

/* RMS norm of each of `rows` rows of width d: out = (x * (1 / sqrt(mean(x^2) + eps))) * w, the order of
 * transformers' LlamaRMSNorm. The sum of squares is 8 lanes over the row and a fixed horizontal sum: a row's
 * bits depend on that row alone. */
void rms_norm(int rows, int d, const float *x, const float *w, float eps, float *out) {
    for (int r = 0; r < rows; r++, x += d, out += d) {
        __m256 acc = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= d; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float sum = hsum(acc);
        for (; i < d; i++) sum += x[i] * x[i];
        float scale = 1.0f / sqrtf(sum / (float)d + eps);
        __m256 s = _mm256_set1_ps(scale);
        for (i = 0; i + 8 <= d; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), _mm256_loadu_ps(w + i)));
        for (; i < d; i++) out[i] = (x[i] * scale) * w[i];
    }
}

/* sum = x + y and out = rms_norm(sum) (rows of d): an add and the norm of its sum in one call, the bits of the two
 * apart (torch's add rounds each sum as this does). */
void add_rms_norm(int rows, int d, const float *x, const float *y, const float *w, float eps, float *sum, float *out) {
    for (size_t i = 0; i < (size_t)rows * d; i++) sum[i] = x[i] + y[i];
    rms_norm(rows, d, sum, w, eps, out);
}

/* Rotary embedding over whole heads, "half" style: out = x * cos + roll(x, d / 2) * sin for each of `heads` heads
 * of d of each of `rows` rows, cos and sin [rows][d] (sin signed, see the torch backend's _half_table). Two
 * products and a sum, each rounded, as torch's three kernels do: the same bits. Rows of x are ldx floats apart
 * (a slice of a joined q, k, v product); out is contiguous. */
__attribute__((optimize("fp-contract=off"))) void rope_half(int rows, int heads, int d, const float *x, int ldx,
                                                            const float *cos, const float *sin, float *out) {
    int half = d / 2;
    for (int r = 0; r < rows; r++, cos += d, sin += d, x += ldx - heads * d)
        for (int h = 0; h < heads; h++, x += d, out += d) {
            int i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + half + i);
                _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                                        _mm256_mul_ps(hi, _mm256_loadu_ps(sin + i))));
                _mm256_storeu_ps(out + half + i, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + i)),
                                                               _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + i))));
            }
            for (; i < half; i++) {
                out[i] = x[i] * cos[i] + x[half + i] * sin[i];
                out[half + i] = x[half + i] * cos[half + i] + x[i] * sin[half + i];
            }
        }
}

/* Two rope_halfs at the same positions (a layer's q and k) in one call. */
void rope_half_pair(int rows, int hx, int hy, int d, const float *x, int ldx, const float *y, int ldy,
                    const float *cos, const float *sin, float *out_x, float *out_y) {
    rope_half(rows, hx, d, x, ldx, cos, sin, out_x);
    rope_half(rows, hy, d, y, ldy, cos, sin, out_y);
}

/* out[r] = the index of the first maximum of row r of x [rows][n] (the first NaN where the row has one), as
 * torch.argmax and numpy pick it: greedy decoding's token. torch's CPU argmax compares one element at a time; a
 * vector max and a scan for its first occurrence are several times faster. */
void argmax_rows(int rows, int n, const float *x, long long *out) {
    for (int r = 0; r < rows; r++, x += n) {
        __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            top = _mm256_max_ps(top, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float best = -INFINITY;
        float lanes[8];
        _mm256_storeu_ps(lanes, top);
        for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
        int has_nan = _mm256_movemask_ps(nan) != 0;
        for (int j = i; j < n; j++) {
            if (x[j] != x[j]) has_nan = 1;
            else if (x[j] > best) best = x[j];
        }
        long long at = 0;
        if (has_nan) {
            while (x[at] == x[at]) at++;
        } else {
            __m256 b = _mm256_set1_ps(best);
            int j = 0;
            for (; j + 8 <= n; j += 8) {
                int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), b, _CMP_EQ_OQ));
                if (hit) break;
            }
            while (x[j] != best) j++;
            at = j;
        }
        out[r] = at;
    }
}
