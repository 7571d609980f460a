/*
 * Fused AdamW step with block-wise dynamic 8-bit moments and folded gradient clipping: the "native" backend of
 * lazytrain_hf.optim (see kernels.py for the math and native.py for how this file is built and called).
 *
 * Per block of `block_size` elements, in one visit while the block sits in L1:
 *   1. dequantize m and v (code map value * block absmax), scale the gradient by the clip coefficient, AdamW
 *      with decoupled weight decay and bias correction, write p (and its bf16 copy); new m and v go to a stack
 *      buffer, since the block's new absmax is only known once every element is updated;
 *   2. new absmax of m and v (integer max over the float bits with the sign cleared);
 *   3. scale into [-1, 1] (x * (1 / absmax); the generic path clamps as the numba kernel does, a clamp that
 *      never acts on finite values, so the AVX-512 path leaves it out) and store the nearest code: bucketize over
 *      the 255 fp32 midpoints of the map, ties to the lower code (count of midpoints strictly below x). The
 *      rounding rule lives in the midpoints the caller passes: the unsigned map's first one is 0.0, so a positive
 *      v never takes code 0 (quant.py, Note: [A non-zero second moment keeps a non-zero code]).
 *
 * Floating point: every operation is the float32 operation of the numba kernel, in the same order, with no
 * multiply-add contraction (build with -ffp-contract=off; the intrinsics below use separate mul and add), IEEE
 * sqrt and division. Results are therefore bit-identical to the numba backend for finite inputs. They can differ
 * only for NaN inputs (min/max on NaN follow the instruction set here), which the optimizer never stores.
 *
 * Code paths, chosen at run time:
 *   - AVX-512 (F, BW, VL, DQ, VBMI): table lookups in registers, 64 elements at a time. Dequantize: the
 *     256-entry float table is split into 4 byte planes; vpermi2b looks up 64 codes per plane (two 128-entry
 *     halves + a blend on the code's top bit) and the planes are interleaved back into floats. Encode (encode64):
 *     an 8-bit bucket key from the float's exponent group and top mantissa bits, then three 256-entry byte-plane
 *     lookups (base code, first and second midpoint of the bucket) and two comparisons. Without key tables
 *     (a custom map that needs more than 256 buckets) and for the tail of 16 of a partial block: an 8-level
 *     branch-free binary search (encode16). Elements left over after whole vectors use the generic code.
 *   - generic C: the bucket tables of quant.CodeLookup (code of the lowest value of a 2**15-ulp bucket plus one
 *     comparison with the bucket's midpoint), exactly as the numba kernel; also used for the elements of a
 *     block that do not fill a whole vector group.
 * Threads: pthreads, dynamic scheduling over chunks of blocks (atomic counter); the calling thread works too.
 */

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define LT_X86 1
#include <immintrin.h>
#else
#define LT_X86 0
#endif

#define LT_API __attribute__((visibility("default")))
#define LT_LOOKUP_SHIFT 15
#define LT_MAX_BLOCK 4096
#define LT_MAX_THREADS 256

/* Keep in sync with native.py (_Args). */
typedef struct {
    float *p;
    const float *g;
    uint8_t *m_codes;
    float *m_absmax;
    uint8_t *v_codes;
    float *v_absmax;
    uint16_t *out16; /* NULL: no bf16 copy */
    int64_t n;
    int64_t block_size;
    int64_t chunk_blocks;
    const float *m_map;    /* [256] */
    const float *m_bounds; /* [256]: 255 midpoints, then +inf */
    const uint8_t *m_lut;  /* [2**17] */
    const float *m_bmid;   /* [2**17] */
    const float *v_map;
    const float *v_bounds;
    const uint8_t *v_lut;
    const float *v_bmid;
    const int32_t *m_keytab; /* [64] or NULL: bucket-key tables for the AVX-512 encode (native.py builds them) */
    const uint8_t *m_lut8;   /* [256] */
    const int32_t *v_keytab;
    const uint8_t *v_lut8;
    float clip, decay, one_minus_beta1, beta2, one_minus_beta2, neg_step_size, bias_correction2_sqrt, eps;
    float absmax_floor;
    int32_t num_threads;
    int32_t isa; /* 0: generic, 1: AVX-512 when the CPU has it */
} lt_args;

static inline uint32_t f2u(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float u2f(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

static inline uint16_t bf16_bits(uint32_t bits) {
    /* Round to nearest even, NaN to the canonical quiet NaN, as c10::BFloat16 does. */
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* ------------------------------------------------------------------------------------------------------------ */
/* generic path                                                                                                 */
/* ------------------------------------------------------------------------------------------------------------ */

/* Step 1 for elements [i0, i1) of the block starting at s. */
static void adam_scalar(const lt_args *a, int64_t s, int64_t i0, int64_t i1, float am, float av, float *mbuf,
                        float *vbuf) {
    float *p = a->p + s;
    const float *g = a->g + s;
    const uint8_t *mc = a->m_codes + s, *vc = a->v_codes + s;
    for (int64_t i = i0; i < i1; i++) {
        float gi = g[i] * a->clip;
        float mi = a->m_map[mc[i]] * am;
        float vi = a->v_map[vc[i]] * av;
        mi = mi + a->one_minus_beta1 * (gi - mi);
        vi = vi * a->beta2 + (a->one_minus_beta2 * gi) * gi;
        float denom = __builtin_sqrtf(vi) / a->bias_correction2_sqrt + a->eps;
        p[i] = p[i] * a->decay + (a->neg_step_size * mi) / denom;
        mbuf[i] = mi;
        vbuf[i] = vi;
    }
    if (a->out16) {
        uint16_t *o = a->out16 + s;
        for (int64_t i = i0; i < i1; i++) o[i] = bf16_bits(f2u(p[i]));
    }
}

static inline float clamp1(float x) {
    x = x > -1.0f ? x : -1.0f;
    return x < 1.0f ? x : 1.0f;
}

/* Step 3 for elements [i0, i1): nearest code through the bucket tables. */
static void encode_scalar(const float *buf, int64_t i0, int64_t i1, float inv, const uint8_t *lut, const float *bmid,
                          uint8_t *codes) {
    for (int64_t i = i0; i < i1; i++) {
        float x = clamp1(buf[i] * inv);
        uint32_t k = f2u(x) >> LT_LOOKUP_SHIFT;
        codes[i] = (uint8_t)(lut[k] + (x > bmid[k]));
    }
}

/* Step 2 for elements [i0, i1): running max of |m| and |v| as float bits (integer order = value order). */
static inline void absmax_bits(const float *mbuf, const float *vbuf, int64_t i0, int64_t i1, uint32_t *mmax,
                               uint32_t *vmax) {
    for (int64_t i = i0; i < i1; i++) {
        uint32_t x = f2u(mbuf[i]) & 0x7FFFFFFFu, y = f2u(vbuf[i]) & 0x7FFFFFFFu;
        *mmax = x > *mmax ? x : *mmax;
        *vmax = y > *vmax ? y : *vmax;
    }
}

/* Store block b's new absmax and return the scale factors 1 / max(absmax, floor) of m and v. */
static inline void store_absmax(const lt_args *a, int64_t b, uint32_t mmax, uint32_t vmax, float *m_inv,
                                float *v_inv) {
    float ma = u2f(mmax), va = u2f(vmax);
    a->m_absmax[b] = ma;
    a->v_absmax[b] = va;
    *m_inv = 1.0f / (ma > a->absmax_floor ? ma : a->absmax_floor);
    *v_inv = 1.0f / (va > a->absmax_floor ? va : a->absmax_floor);
}

static void block_generic(const lt_args *a, int64_t b, float *mbuf, float *vbuf) {
    int64_t s = b * a->block_size;
    int64_t e = s + a->block_size < a->n ? s + a->block_size : a->n;
    int64_t len = e - s;
    adam_scalar(a, s, 0, len, a->m_absmax[b], a->v_absmax[b], mbuf, vbuf);
    uint32_t mmax = 0, vmax = 0;
    absmax_bits(mbuf, vbuf, 0, len, &mmax, &vmax);
    float m_inv, v_inv;
    store_absmax(a, b, mmax, vmax, &m_inv, &v_inv);
    encode_scalar(mbuf, 0, len, m_inv, a->m_lut, a->m_bmid, a->m_codes + s);
    encode_scalar(vbuf, 0, len, v_inv, a->v_lut, a->v_bmid, a->v_codes + s);
}

/* ------------------------------------------------------------------------------------------------------------ */
/* AVX-512 path                                                                                                 */
/* ------------------------------------------------------------------------------------------------------------ */

#if LT_X86
#define LT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))

/* Tables of one code map, laid out for the in-register lookups. */
typedef struct {
    uint8_t planes[4][256] __attribute__((aligned(64))); /* byte j of every map value */
    /* Bucket-key encode (see encode64): key of each exponent group, code of each bucket's lowest value, and the
     * first two midpoints at or above it (as byte planes). */
    int32_t key_pos[32] __attribute__((aligned(64)));
    int32_t key_neg[32] __attribute__((aligned(64)));
    uint8_t lut8[256] __attribute__((aligned(64)));
    uint8_t mid1[4][256] __attribute__((aligned(64)));
    uint8_t mid2[4][256] __attribute__((aligned(64)));
    int has_keys;
    int nonneg; /* no midpoint below zero (the unsigned map; its first midpoint is 0.0, see quant.py) */
    uint8_t pack[64] __attribute__((aligned(64))); /* pack[q] = 4 * (q % 32): byte q of the packed keys */
    /* level k of the binary search (k = 0..7): 2**k midpoints, level[k][j] = bounds[(2j + 1) * 2**(7-k) - 1] */
    float level[8][128] __attribute__((aligned(64)));
} lt_tables;

static void split_planes(const float *values, uint8_t planes[4][256]) {
    for (int c = 0; c < 256; c++) {
        uint32_t u = f2u(values[c]);
        for (int j = 0; j < 4; j++) planes[j][c] = (uint8_t)(u >> (8 * j));
    }
}

static void build_tables(const float *map, const float *bounds, const int32_t *keytab, const uint8_t *lut8,
                         lt_tables *t) {
    split_planes(map, t->planes);
    memset(t->level, 0, sizeof(t->level));
    for (int k = 0; k < 8; k++) {
        int step = 1 << (7 - k);
        for (int j = 0; j < (1 << k); j++) t->level[k][j] = bounds[(2 * j + 1) * step - 1];
    }
    for (int q = 0; q < 64; q++) t->pack[q] = (uint8_t)(4 * (q % 32));
    t->has_keys = keytab != NULL && lut8 != NULL;
    t->nonneg = bounds[0] >= 0.0f;
    if (t->has_keys) {
        /* keytab is in increasing value order: groups 0..31 negative (largest magnitude first), 32..63 positive */
        for (int e = 0; e < 32; e++) {
            t->key_pos[e] = keytab[32 + e];
            t->key_neg[e] = keytab[31 - e];
        }
        float m1[256], m2[256];
        for (int k = 0; k < 256; k++) {
            t->lut8[k] = lut8[k];
            m1[k] = bounds[lut8[k]];
            m2[k] = lut8[k] < 255 ? bounds[lut8[k] + 1] : bounds[255];
        }
        split_planes(m1, t->mid1);
        split_planes(m2, t->mid2);
    }
}

/* Bytes-to-floats lookup of 64 indices in a 256-entry float table held as 4 byte planes. `c` must be permuted
 * by `reorder` (see block_avx512) so that the unpack-based interleave yields values in index order. */
LT_AVX512 static inline void lookup64(__m512i c, const uint8_t planes[4][256], __m512 out[4]) {
    __mmask64 hi = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int j = 0; j < 4; j++) {
        const uint8_t *pl = planes[j];
        __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(pl), c, _mm512_load_si512(pl + 64));
        __m512i up = _mm512_permutex2var_epi8(_mm512_load_si512(pl + 128), c, _mm512_load_si512(pl + 192));
        b[j] = _mm512_mask_blend_epi8(hi, lo, up);
    }
    __m512i t0 = _mm512_unpacklo_epi8(b[0], b[1]), t1 = _mm512_unpackhi_epi8(b[0], b[1]);
    __m512i t2 = _mm512_unpacklo_epi8(b[2], b[3]), t3 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(t0, t2));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(t0, t2));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(t1, t3));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(t1, t3));
}

/* 64 codes -> 64 map values (unscaled), in code order, as 4 vectors of 16. */
LT_AVX512 static inline void dequant64(const uint8_t *codes, const lt_tables *t, __m512i reorder, __m512 out[4]) {
    lookup64(_mm512_permutexvar_epi8(reorder, _mm512_loadu_si512(codes)), t->planes, out);
}

/* Nearest code of 64 values in (-2, 2) (count of midpoints strictly below x, i.e. bucketize with right=False;
 * values beyond +-1 get the code of +-1 since no midpoint lies beyond).
 *
 * The float is cut into buckets: its exponent group (sign and exponent, magnitudes below 2**-30 in one group per
 * sign) picks a base key and a shift, and the key is base + (low 23 bits of the order-preserving integer image of
 * x) >> shift. native.py chooses the shifts so that no bucket holds more than two midpoints and all buckets fit
 * in 256 keys. Then code = lut8[key] + (x > mid1[key]) + (x > mid2[key]), every table read with byte permutes. */
LT_AVX512 static inline __m512i encode64(const __m512 x[4], const lt_tables *t, __m512i reorder) {
    const __m512i m23 = _mm512_set1_epi32(0x7FFFFF);
    /* Magnitudes below 2**-31 (and -0.0, and NaN) take the key of 2**-31: the group-96 bucket of their sign,
     * which holds no midpoint. Exponents 96..127 index the 32-entry group tables by their low 5 bits. */
    const __m512 tiny = _mm512_castsi512_ps(_mm512_set1_epi32(96 << 23));
    const __m512i kp0 = _mm512_load_si512(t->key_pos), kp1 = _mm512_load_si512(t->key_pos + 16);
    __m512i key[4];
    if (t->nonneg) {
        /* No midpoint below zero: max(x, 2**-31) has the key of x, and the comparisons below use the original x.
         * A midpoint at exactly 0.0 (Note: [A non-zero second moment keeps a non-zero code] in quant.py) is the
         * first midpoint of the group-96 bucket, so x in (0, 2**-31) still gets code 1 and 0.0 code 0. */
        for (int j = 0; j < 4; j++) {
            __m512i bits = _mm512_castps_si512(_mm512_max_ps(x[j], tiny));
            __m512i ent = _mm512_permutex2var_epi32(kp0, _mm512_srli_epi32(bits, 23), kp1);
            __m512i low = _mm512_and_si512(bits, m23);
            key[j] = _mm512_add_epi32(ent, _mm512_srlv_epi32(low, _mm512_srli_epi32(ent, 16)));
        }
    } else {
        const __m512i kn0 = _mm512_load_si512(t->key_neg), kn1 = _mm512_load_si512(t->key_neg + 16);
        for (int j = 0; j < 4; j++) {
            __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(x[j]));
            __m512i bits = _mm512_castps_si512(_mm512_max_ps(_mm512_abs_ps(x[j]), tiny));
            __m512i e = _mm512_srli_epi32(bits, 23);
            __m512i ent = _mm512_mask_blend_epi32(neg, _mm512_permutex2var_epi32(kp0, e, kp1),
                                                  _mm512_permutex2var_epi32(kn0, e, kn1));
            /* Order-preserving image: the low 23 bits of a negative value count down. */
            __m512i low = _mm512_and_si512(bits, m23);
            low = _mm512_mask_xor_epi32(low, neg, low, m23);
            key[j] = _mm512_add_epi32(ent, _mm512_srlv_epi32(low, _mm512_srli_epi32(ent, 16)));
        }
    }
    /* Low byte of each 32-bit key, 64 of them in order: two two-table byte permutes and a blend. */
    const __m512i pack = _mm512_load_si512(t->pack);
    __m512i k8 = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, _mm512_permutex2var_epi8(key[0], pack, key[1]),
                                        _mm512_permutex2var_epi8(key[2], pack, key[3]));
    __mmask64 hi = _mm512_movepi8_mask(k8);
    __m512i code = _mm512_mask_blend_epi8(
        hi, _mm512_permutex2var_epi8(_mm512_load_si512(t->lut8), k8, _mm512_load_si512(t->lut8 + 64)),
        _mm512_permutex2var_epi8(_mm512_load_si512(t->lut8 + 128), k8, _mm512_load_si512(t->lut8 + 192)));
    __m512i kp = _mm512_permutexvar_epi8(reorder, k8);
    __m512 m1[4], m2[4];
    lookup64(kp, t->mid1, m1);
    lookup64(kp, t->mid2, m2);
    __mmask16 a[4], b[4];
    for (int j = 0; j < 4; j++) {
        a[j] = _mm512_cmp_ps_mask(x[j], m1[j], _CMP_GT_OQ);
        b[j] = _mm512_cmp_ps_mask(x[j], m2[j], _CMP_GT_OQ);
    }
    __mmask64 ga = _mm512_kunpackd(_mm512_kunpackw(a[3], a[2]), _mm512_kunpackw(a[1], a[0]));
    __mmask64 gb = _mm512_kunpackd(_mm512_kunpackw(b[3], b[2]), _mm512_kunpackw(b[1], b[0]));
    const __m512i one = _mm512_set1_epi8(1);
    code = _mm512_mask_add_epi8(code, ga, code, one);
    return _mm512_mask_add_epi8(code, gb, code, one);
}

/* Nearest code of 16 values in [-1, 1] by an 8-level binary search (used when there are no bucket-key tables). */
LT_AVX512 static inline __m512i encode16(__m512 x, const lt_tables *t) {
    const __m512i one = _mm512_set1_epi32(1);
    const float(*L)[128] = t->level;
    __mmask16 gt = _mm512_cmp_ps_mask(x, _mm512_set1_ps(L[0][0]), _CMP_GT_OQ);
    __m512i idx = _mm512_maskz_mov_epi32(gt, one);
    __m512 mid;
#define LT_DESCEND(MID)                                      \
    mid = (MID);                                             \
    gt = _mm512_cmp_ps_mask(x, mid, _CMP_GT_OQ);             \
    idx = _mm512_add_epi32(idx, idx);                        \
    idx = _mm512_mask_add_epi32(idx, gt, idx, one);
    LT_DESCEND(_mm512_permutexvar_ps(idx, _mm512_load_ps(L[1])));
    LT_DESCEND(_mm512_permutexvar_ps(idx, _mm512_load_ps(L[2])));
    LT_DESCEND(_mm512_permutexvar_ps(idx, _mm512_load_ps(L[3])));
    LT_DESCEND(_mm512_permutexvar_ps(idx, _mm512_load_ps(L[4])));
    LT_DESCEND(_mm512_permutex2var_ps(_mm512_load_ps(L[5]), idx, _mm512_load_ps(L[5] + 16)));
    {
        __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
        __m512 lo = _mm512_permutex2var_ps(_mm512_load_ps(L[6]), idx, _mm512_load_ps(L[6] + 16));
        __m512 up = _mm512_permutex2var_ps(_mm512_load_ps(L[6] + 32), idx, _mm512_load_ps(L[6] + 48));
        LT_DESCEND(_mm512_mask_blend_ps(b5, lo, up));
    }
    {
        __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
        __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
        __m512 q0 = _mm512_permutex2var_ps(_mm512_load_ps(L[7]), idx, _mm512_load_ps(L[7] + 16));
        __m512 q1 = _mm512_permutex2var_ps(_mm512_load_ps(L[7] + 32), idx, _mm512_load_ps(L[7] + 48));
        __m512 q2 = _mm512_permutex2var_ps(_mm512_load_ps(L[7] + 64), idx, _mm512_load_ps(L[7] + 80));
        __m512 q3 = _mm512_permutex2var_ps(_mm512_load_ps(L[7] + 96), idx, _mm512_load_ps(L[7] + 112));
        __m512 lo = _mm512_mask_blend_ps(b5, q0, q1);
        __m512 up = _mm512_mask_blend_ps(b5, q2, q3);
        LT_DESCEND(_mm512_mask_blend_ps(b6, lo, up));
    }
#undef LT_DESCEND
    return idx;
}

LT_AVX512 static inline __m256i bf16x16(__m512i bits) {
    const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7F800000));
    __m512i r = _mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF));
    r = _mm512_add_epi32(r, _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

typedef struct {
    const lt_args *a;
    lt_tables m, v;
    /* Byte permutation so that the unpack-based interleave of lookup64 yields values in index order. */
    uint8_t reorder[64] __attribute__((aligned(64)));
} lt_vec_ctx;

LT_AVX512 static void block_avx512(const lt_vec_ctx *ctx, int64_t b, float *mbuf, float *vbuf) {
    const lt_args *a = ctx->a;
    int64_t s = b * a->block_size;
    int64_t e = s + a->block_size < a->n ? s + a->block_size : a->n;
    int64_t len = e - s;
    int64_t nvec = len & ~(int64_t)63;
    float am_s = a->m_absmax[b], av_s = a->v_absmax[b];
    const __m512i reorder = _mm512_load_si512(ctx->reorder);
    const __m512 am = _mm512_set1_ps(am_s), av = _mm512_set1_ps(av_s);
    const __m512 clip = _mm512_set1_ps(a->clip), w1 = _mm512_set1_ps(a->one_minus_beta1);
    const __m512 beta2 = _mm512_set1_ps(a->beta2), w2 = _mm512_set1_ps(a->one_minus_beta2);
    const __m512 bc2s = _mm512_set1_ps(a->bias_correction2_sqrt), eps = _mm512_set1_ps(a->eps);
    const __m512 decay = _mm512_set1_ps(a->decay), nstep = _mm512_set1_ps(a->neg_step_size);
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i mmax = _mm512_setzero_si512(), vmax = _mm512_setzero_si512();
    float *p = a->p + s;
    const float *g = a->g + s;
    for (int64_t i = 0; i < nvec; i += 64) {
        __m512 mq[4], vq[4];
        dequant64(a->m_codes + s + i, &ctx->m, reorder, mq);
        dequant64(a->v_codes + s + i, &ctx->v, reorder, vq);
        for (int j = 0; j < 4; j++) {
            int64_t o = i + 16 * j;
            __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + o), clip);
            __m512 mi = _mm512_mul_ps(mq[j], am);
            __m512 vi = _mm512_mul_ps(vq[j], av);
            mi = _mm512_add_ps(mi, _mm512_mul_ps(w1, _mm512_sub_ps(gi, mi)));
            vi = _mm512_add_ps(_mm512_mul_ps(vi, beta2), _mm512_mul_ps(_mm512_mul_ps(w2, gi), gi));
            __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2s), eps);
            __m512 pi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(p + o), decay),
                                      _mm512_div_ps(_mm512_mul_ps(nstep, mi), denom));
            _mm512_storeu_ps(p + o, pi);
            if (a->out16) _mm256_storeu_si256((__m256i *)(a->out16 + s + o), bf16x16(_mm512_castps_si512(pi)));
            _mm512_store_ps(mbuf + o, mi);
            _mm512_store_ps(vbuf + o, vi);
            mmax = _mm512_max_epu32(mmax, _mm512_and_si512(_mm512_castps_si512(mi), absmask));
            vmax = _mm512_max_epu32(vmax, _mm512_and_si512(_mm512_castps_si512(vi), absmask));
        }
    }
    uint32_t mm = _mm512_reduce_max_epu32(mmax), vm = _mm512_reduce_max_epu32(vmax);
    if (nvec < len) {
        adam_scalar(a, s, nvec, len, am_s, av_s, mbuf, vbuf);
        absmax_bits(mbuf, vbuf, nvec, len, &mm, &vm);
    }
    float m_inv_s, v_inv_s;
    store_absmax(a, b, mm, vm, &m_inv_s, &v_inv_s);
    const __m512 m_inv = _mm512_set1_ps(m_inv_s), v_inv = _mm512_set1_ps(v_inv_s);
    const __m512 lo = _mm512_set1_ps(-1.0f), hi = _mm512_set1_ps(1.0f);
    int64_t nv16 = 0;
    if (ctx->m.has_keys && ctx->v.has_keys) {
        for (; nv16 < nvec; nv16 += 64) {
            __m512 xm[4], xv[4];
            for (int j = 0; j < 4; j++) {
                /* No clamp (the generic path's clamp never acts on finite values): |x| <= absmax, and
                 * absmax * (1 / absmax) rounds to 1 or just below it in float32, never above. Values beyond 1
                 * would still get the end codes (exponent group 127 of the key tables). */
                xm[j] = _mm512_mul_ps(_mm512_load_ps(mbuf + nv16 + 16 * j), m_inv);
                xv[j] = _mm512_mul_ps(_mm512_load_ps(vbuf + nv16 + 16 * j), v_inv);
            }
            _mm512_storeu_si512(a->m_codes + s + nv16, encode64(xm, &ctx->m, reorder));
            _mm512_storeu_si512(a->v_codes + s + nv16, encode64(xv, &ctx->v, reorder));
        }
    }
    for (; nv16 + 16 <= len; nv16 += 16) {
        __m512 xm = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_load_ps(mbuf + nv16), m_inv), lo), hi);
        __m512 xv = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_load_ps(vbuf + nv16), v_inv), lo), hi);
        _mm_storeu_si128((__m128i *)(a->m_codes + s + nv16), _mm512_cvtepi32_epi8(encode16(xm, &ctx->m)));
        _mm_storeu_si128((__m128i *)(a->v_codes + s + nv16), _mm512_cvtepi32_epi8(encode16(xv, &ctx->v)));
    }
    if (nv16 < len) {
        encode_scalar(mbuf, nv16, len, m_inv_s, a->m_lut, a->m_bmid, a->m_codes + s);
        encode_scalar(vbuf, nv16, len, v_inv_s, a->v_lut, a->v_bmid, a->v_codes + s);
    }
}
#endif

/* ------------------------------------------------------------------------------------------------------------ */
/* driver                                                                                                       */
/* ------------------------------------------------------------------------------------------------------------ */

typedef struct {
    const lt_args *a;
    const void *vec; /* lt_vec_ctx * when the AVX-512 path runs, else NULL */
    int64_t n_blocks;
    int64_t n_chunks;
    int64_t next; /* next chunk to take (atomic) */
} lt_job;

static void run_blocks(const lt_job *job, int64_t b0, int64_t b1, float *mbuf, float *vbuf) {
#if LT_X86
    if (job->vec) {
        for (int64_t b = b0; b < b1; b++) block_avx512((const lt_vec_ctx *)job->vec, b, mbuf, vbuf);
        return;
    }
#endif
    for (int64_t b = b0; b < b1; b++) block_generic(job->a, b, mbuf, vbuf);
}

static void *worker(void *arg) {
    lt_job *job = (lt_job *)arg;
    float mbuf[LT_MAX_BLOCK] __attribute__((aligned(64)));
    float vbuf[LT_MAX_BLOCK] __attribute__((aligned(64)));
    int64_t cb = job->a->chunk_blocks;
    for (;;) {
        int64_t c = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (c >= job->n_chunks) break;
        int64_t b0 = c * cb, b1 = b0 + cb < job->n_blocks ? b0 + cb : job->n_blocks;
        run_blocks(job, b0, b1, mbuf, vbuf);
    }
    return NULL;
}

/* 1 when the AVX-512 path can run on this CPU. */
LT_API int lt_has_avx512(void) {
#if LT_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vbmi");
#else
    return 0;
#endif
}

LT_API int lt_abi_version(void) { return 2; }

/* One fused step over a->n elements. Returns 0, or a negative value for invalid arguments. */
LT_API int lt_adamw8bit_step(const lt_args *a) {
    if (a->n < 0 || a->block_size < 1 || a->block_size > LT_MAX_BLOCK || a->chunk_blocks < 1) return -1;
    if (a->n == 0) return 0;
    lt_job job;
    job.a = a;
    job.vec = NULL;
    job.n_blocks = (a->n + a->block_size - 1) / a->block_size;
    job.n_chunks = (job.n_blocks + a->chunk_blocks - 1) / a->chunk_blocks;
    job.next = 0;
#if LT_X86
    static __thread lt_vec_ctx ctx __attribute__((aligned(64)));
    if (a->isa == 1 && lt_has_avx512()) {
        ctx.a = a;
        for (int q = 0; q < 64; q++) ctx.reorder[q] = (uint8_t)(16 * ((q >> 2) & 3) + 4 * (q >> 4) + (q & 3));
        build_tables(a->m_map, a->m_bounds, a->m_keytab, a->m_lut8, &ctx.m);
        build_tables(a->v_map, a->v_bounds, a->v_keytab, a->v_lut8, &ctx.v);
        job.vec = &ctx;
    }
#endif
    int nt = a->num_threads;
    if (nt > job.n_chunks) nt = (int)job.n_chunks;
    if (nt > LT_MAX_THREADS) nt = LT_MAX_THREADS;
    pthread_t tids[LT_MAX_THREADS];
    int started = 0;
    if (nt > 1) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        for (int t = 1; t < nt; t++) {
            if (pthread_create(&tids[started], &attr, worker, &job) != 0) break; /* fewer threads still finish */
            started++;
        }
        pthread_attr_destroy(&attr);
    }
    worker(&job);
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    return 0;
}
