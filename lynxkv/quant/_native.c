/* The compiled kernels of lynxkv.quant.fast: the encode (codes and metadata of units of a tensor), the decode
 * (x̂ = o + s·levels[code], rotated back for Hadamard-rotated keys, rounded to bf16 or kept in fp32, for pages of codes
 * held in byte buffers), the rotation and 4-bit packing. lynxkv.quant.fast's docstring says why their results are
 * those of the torch reference (lynxkv.quant.reference, their oracle in the tests) bit for bit. The decode:
 *
 *   - the level of a code from the table the reference built (levels[code], or levels[anchor] alone);
 *   - o + s·level as a product, then a sum (this file is compiled with -ffp-contract=off: no fused multiply-add);
 *   - rotated rows: the Walsh-Hadamard butterfly of lynxkv.quant.rotation (stages h = 1, 2, ..., block/2, the
 *     pair (i, i + h) with i mod 2h < h becomes (a + b, a - b)), then times `back` (a power of two);
 *   - bf16 by round to nearest even on the fp32 bits: (b + 0x7FFF + ((b >> 16) & 1)) >> 16.
 *
 * Vector lanes do the IEEE operations a scalar loop does, lane by lane, so the AVX2 row kernel below and the
 * portable scalar one give the same bits; the AVX2 one runs where the CPU has it (checked at run time) for the
 * layout every default-scheme load has (packed 4+4 codes, a contiguous row of a multiple of 16 channels).
 *
 * The encode's AVX2 units (head_dim a multiple of 16) take every code from the bucket table: the exact
 * u = fl((x - o) / s) by a division, its order key, one gather per 8 elements. The portable loops first run an fp32
 * compander within a bound of the exact one and look up only the elements that land near a code step; both give
 * the reference's codes.
 *
 * Python calls these through a cffi module typed by _native.h (built by setup.py; lynxkv.quant.c_kernels): the
 * calls release the GIL, and the caller splits the units over its threads. Nothing here allocates beyond one row
 * buffer per call or keeps state between calls.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_native.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LYNX_X86 1
#include <immintrin.h>
#endif

/* One row of the page table (int64 [P, 10]), in the order lynxkv.quant.fast writes it: the byte offsets of the
 * page's offsets, scales, anchor and residual codes, the element offset of its first output, the rows to decode
 * and the columns, the rows per head its metadata and anchor codes hold and the rows its residual codes hold
 * (both at least the rows decoded: the first rows of each head are decoded), its first unit. */
enum { PG_OFFSET, PG_SCALE, PG_ANCHOR, PG_RESIDUAL, PG_Y0, PG_ROWS, PG_COLS, PG_HELD, PG_RESIDUAL_HELD, PG_FIRST,
       PG_WIDTH };

/* The order keys of -1.0f and 1.0f: every u of a code lies between them. */
#define KEY_MIN (-1065353217)
#define KEY_MAX 1065353216

static inline float bits_f32(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

/* fp16 bits to fp32, exact (subnormals, infinities and NaN payloads included). */
static inline float f16_widen(uint32_t h) {
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (man << 13));
    if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
    if (man == 0) return bits_f32(sign);
    /* subnormal: man * 2^-24, exact in fp32 */
    int e = 113;
    while (!(man & 0x400u)) {
        man <<= 1;
        e--;
    }
    return bits_f32(sign | ((uint32_t)e << 23) | ((man & 0x3FFu) << 13));
}

static inline uint16_t bf16_round(float v) {
    uint32_t b = f32_bits(v);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* The butterfly of v[0:n] within blocks of `block` channels, in the reference's order. */
static void butterfly_scalar(float *v, int64_t n, int64_t block) {
    for (int64_t h = 1; h < block; h *= 2)
        for (int64_t i0 = 0; i0 < n; i0 += 2 * h)
            for (int64_t i = i0; i < i0 + h; i++) {
                float a = v[i], b = v[i + h];
                v[i] = a + b;
                v[i + h] = a - b;
            }
}

/* The levels of one row of codes into f[0:cols]. */
static inline void levels_scalar(const uint8_t *ar, const uint8_t *rr, int64_t cols, int packed, int anchor_only,
                                 int rb, const float *levels, float *f) {
    if (packed) {
        for (int64_t j = 0; j < cols / 2; j++) {
            uint32_t b = ar[j];
            if (anchor_only) {
                f[2 * j] = levels[b & 0xFu];
                f[2 * j + 1] = levels[b >> 4];
            } else {
                uint32_t e = rr[j];
                f[2 * j] = levels[((b & 0xFu) << 4) | (e & 0xFu)];
                f[2 * j + 1] = levels[(b & 0xF0u) | (e >> 4)];
            }
        }
    } else if (anchor_only) {
        for (int64_t d = 0; d < cols; d++) f[d] = levels[ar[d]];
    } else {
        for (int64_t d = 0; d < cols; d++) f[d] = levels[((uint32_t)ar[d] << rb) | rr[d]];
    }
}

static void row_scalar(const uint8_t *ar, const uint8_t *rr, int64_t cols, int packed, int anchor_only, int rb,
                       const float *levels, const float *o, const float *s, int64_t block, float back, void *y,
                       int y_bf16, int64_t row, int64_t sd, float *f) {
    levels_scalar(ar, rr, cols, packed, anchor_only, rb, levels, f);
    for (int64_t d = 0; d < cols; d++) f[d] = o[d] + s[d] * f[d];
    if (block > 1) {
        butterfly_scalar(f, cols, block);
        for (int64_t d = 0; d < cols; d++) f[d] = f[d] * back;
    }
    if (y_bf16) {
        uint16_t *out = (uint16_t *)y + row;
        for (int64_t d = 0; d < cols; d++) out[d * sd] = bf16_round(f[d]);
    } else {
        float *out = (float *)y + row;
        for (int64_t d = 0; d < cols; d++) out[d * sd] = f[d];
    }
}

#ifdef LYNX_X86
#define AVX2 __attribute__((target("avx2,f16c")))

/* The 16 code indices of 8 packed bytes (two codes each, the first in the low nibble), in element order: the
 * anchor nibble alone, or anchor << 4 | residual. */
AVX2 static inline __m128i indices16(const uint8_t *ar, const uint8_t *rr) {
    const __m128i nib = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadl_epi64((const __m128i *)ar), even, odd;
    if (!rr) {
        even = _mm_and_si128(b, nib);
        odd = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    } else {
        __m128i e = _mm_loadl_epi64((const __m128i *)rr);
        even = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, nib), 4), _mm_and_si128(e, nib));
        odd = _mm_or_si128(_mm_andnot_si128(nib, b), _mm_and_si128(_mm_srli_epi16(e, 4), nib));
    }
    return _mm_unpacklo_epi8(even, odd);
}

/* levels[] of 8 indices. A table of 16 (the anchor alone) is two registers and two permutes, picked by bit 3 of
 * the index; a table of 256 takes scalar loads, which are faster than a gather on the CPUs measured. */
AVX2 static inline __m256 lookup16(__m256i i, __m256 lo, __m256 hi) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, i), _mm256_permutevar8x32_ps(hi, i),
                            _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
}

AVX2 static inline __m256 lookup256(const uint8_t *i, const float *levels) {
    return _mm256_set_m128(_mm_set_ps(levels[i[7]], levels[i[6]], levels[i[5]], levels[i[4]]),
                           _mm_set_ps(levels[i[3]], levels[i[2]], levels[i[1]], levels[i[0]]));
}

/* fp32 lanes to bf16 bits, round to nearest even, 16 lanes packed in order. */
AVX2 static inline __m256i bf16x16(__m256 x0, __m256 x1) {
    const __m256i half = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    __m256i b0 = _mm256_castps_si256(x0), b1 = _mm256_castps_si256(x1);
    b0 = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b0, half), _mm256_and_si256(_mm256_srli_epi32(b0, 16), one)), 16);
    b1 = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b1, half), _mm256_and_si256(_mm256_srli_epi32(b1, 16), one)), 16);
    /* packus works per 128-bit lane, (b0 lo, b1 lo, b0 hi, b1 hi): put the 64-bit quarters back in order */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(b0, b1), 0xD8);
}

/* One butterfly stage h < 8 inside a vector: the lanes with i mod 2h < h take a + b, the others a - b, with the
 * partner lane `sw` from a permutation. a - b is a + (-b) in IEEE arithmetic (the same bits, signed zeros
 * included), so the lanes that subtract flip the sign of their own value (`neg`) and every lane adds. */
#define STAGE_IN_REGISTER(v, sw, neg) _mm256_add_ps((sw), _mm256_xor_ps((v), (neg)))

/* o + s·level of 16 elements at channel d. */
#define AFFINE(f, d) _mm256_add_ps(_mm256_load_ps(o + (d)), _mm256_mul_ps(_mm256_load_ps(s + (d)), (f)))

/* The stages h = 1, 2, 4 of one vector (within blocks of `block` channels). */
AVX2 static inline __m256 stages_in_vector(__m256 v, int64_t block) {
    const __m256 neg1 = _mm256_castsi256_ps(_mm256_setr_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN));
    const __m256 neg2 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, INT32_MIN, INT32_MIN, 0, 0, INT32_MIN, INT32_MIN));
    const __m256 neg4 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN));
    v = STAGE_IN_REGISTER(v, _mm256_permute_ps(v, 0xB1), neg1); /* h = 1: lanes (1, 0, 3, 2) */
    if (block > 2) v = STAGE_IN_REGISTER(v, _mm256_permute_ps(v, 0x4E), neg2); /* h = 2: (2, 3, 0, 1) */
    if (block > 4) v = STAGE_IN_REGISTER(v, _mm256_permute2f128_ps(v, v, 0x01), neg4); /* h = 4 */
    return v;
}

/* The butterfly of one row held in nv vectors, within blocks of `block` channels (stages h = 1, 2, 4 inside each
 * vector, then h = 8, 16, ... across vectors h / 8 apart). A stage only combines channels of one block of 2h, so
 * the stages below h = 64 run on 8 vectors at a time, held in registers, before the wider ones: the same sums. */
AVX2 static inline void butterfly_avx2(__m256 *f, int64_t nv, int64_t block) {
    int64_t h0 = 1; /* the first stage (in vectors) still to run on all nv vectors */
    if (nv % 8 == 0) {
        for (int64_t c = 0; c < nv; c += 8) {
            __m256 v[8];
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) v[k] = stages_in_vector(f[c + k], block);
#pragma GCC unroll 3
            for (int h = 1; h < 8; h *= 2) {
                if (h >= block / 8) break;
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++)
                    if (!(k & h)) {
                        __m256 a = v[k], b = v[k + h];
                        v[k] = _mm256_add_ps(a, b);
                        v[k + h] = _mm256_sub_ps(a, b);
                    }
            }
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) f[c + k] = v[k];
        }
        h0 = 8;
    } else {
        for (int64_t k = 0; k < nv; k++) f[k] = stages_in_vector(f[k], block);
    }
    for (int64_t h = h0; h < block / 8; h *= 2) /* whole vectors, h / 8 apart */
        for (int64_t k0 = 0; k0 < nv; k0 += 2 * h)
            for (int64_t k = k0; k < k0 + h; k++) {
                __m256 a = f[k], b = f[k + h];
                f[k] = _mm256_add_ps(a, b);
                f[k + h] = _mm256_sub_ps(a, b);
            }
}

/* The encode's rotation of n rows of D channels in place (D % 8 == 0, D <= 512): the butterfly, then times
 * `scale` unless it is 1. */
AVX2 static void rotate_rows_avx2(float *y, int64_t n, int64_t D, int64_t block, float scale) {
    __m256 f[64];
    int64_t nv = D / 8;
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t t = 0; t < n; t++) {
        float *row = y + t * D;
        for (int64_t k = 0; k < nv; k++) f[k] = _mm256_loadu_ps(row + 8 * k);
        butterfly_avx2(f, nv, block);
        for (int64_t k = 0; k < nv; k++) _mm256_storeu_ps(row + 8 * k, scale != 1.0f ? _mm256_mul_ps(f[k], sc) : f[k]);
    }
}

/* One row of packed 4+4 codes (rr NULL: the anchor alone), cols % 16 == 0, written contiguously (sd == 1). */
AVX2 static void row_avx2(const uint8_t *ar, const uint8_t *rr, int64_t cols, const float *levels, const float *o,
                          const float *s, int64_t block, float back, void *y, int y_bf16, int64_t row, __m256 *f) {
    uint8_t idx[16] __attribute__((aligned(16)));
    __m256 lo = _mm256_setzero_ps(), hi = lo;
    if (!rr) {
        lo = _mm256_loadu_ps(levels);
        hi = _mm256_loadu_ps(levels + 8);
    }
    int rotated = block > 1;
    uint16_t *yb = (uint16_t *)y + row;
    float *yf = (float *)y + row;
    for (int64_t d = 0; d < cols; d += 16) {
        __m128i i = indices16(ar + d / 2, rr ? rr + d / 2 : NULL);
        __m256 a, b;
        if (!rr) {
            a = lookup16(_mm256_cvtepu8_epi32(i), lo, hi);
            b = lookup16(_mm256_cvtepu8_epi32(_mm_srli_si128(i, 8)), lo, hi);
        } else {
            _mm_store_si128((__m128i *)idx, i);
            a = lookup256(idx, levels);
            b = lookup256(idx + 8, levels);
        }
        a = AFFINE(a, d);
        b = AFFINE(b, d + 8);
        if (rotated) {
            f[d / 8] = a;
            f[d / 8 + 1] = b;
        } else if (y_bf16) {
            _mm256_storeu_si256((__m256i *)(yb + d), bf16x16(a, b));
        } else {
            _mm256_storeu_ps(yf + d, a);
            _mm256_storeu_ps(yf + d + 8, b);
        }
    }
    if (!rotated) return;
    int64_t nv = cols / 8;
    butterfly_avx2(f, nv, block);
    const __m256 bk = _mm256_set1_ps(back);
    for (int64_t k = 0; k < nv; k += 2) {
        __m256 a = _mm256_mul_ps(f[k], bk), b = _mm256_mul_ps(f[k + 1], bk);
        if (y_bf16) {
            _mm256_storeu_si256((__m256i *)(yb + 8 * k), bf16x16(a, b));
        } else {
            _mm256_storeu_ps(yf + 8 * k, a);
            _mm256_storeu_ps(yf + 8 * k + 8, b);
        }
    }
}

/* The offsets or scales of `n` channels (n % 8 == 0), fp16 little-endian at `p`, widened into out[]; returns
 * their problem flags: `inf_flag` where one is not finite, 4 (scales only: `scale`) where one is below -0.0. */
AVX2 static int64_t meta_f16_avx2(const uint8_t *p, int64_t n, float *out, int64_t inf_flag, int scale) {
    const __m128i exp = _mm_set1_epi16(0x7C00), sign = _mm_set1_epi16((short)0x8000);
    __m128i bad = _mm_setzero_si128(), negative = _mm_setzero_si128();
    for (int64_t d = 0; d < n; d += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(p + 2 * d));
        bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, exp), exp));
        if (scale) /* sign set and not -0.0 (0x8000) */
            negative = _mm_or_si128(negative, _mm_andnot_si128(_mm_cmpeq_epi16(h, sign), _mm_and_si128(h, sign)));
        _mm256_store_ps(out + d, _mm256_cvtph_ps(h));
    }
    return (_mm_movemask_epi8(bad) ? inf_flag : 0) | (_mm_movemask_epi8(negative) ? 4 : 0);
}

/* ------------------------------------------------------------------------- encode rows (AVX2) */

/* One row of D channels (D % 8 == 0) of x into fp32 y: bf16 bits widened, or fp32 copied. */
AVX2 static void load_row_avx2(const void *x, int bf16, uint64_t row, int64_t D, float *y) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)x + row;
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_si256((__m256i *)(y + d),
                                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + d))), 16));
    } else {
        memcpy(y, (const float *)x + row, (size_t)D * sizeof(float));
    }
}

/* The order keys of 8 floats (order_key lane by lane) and back (key_value). */
AVX2 static inline __m256i keys8(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    return _mm256_xor_si256(b, _mm256_and_si256(_mm256_srai_epi32(b, 31), _mm256_set1_epi32(0x7FFFFFFF)));
}

AVX2 static inline __m256 values8(__m256i k) {
    return _mm256_castsi256_ps(_mm256_xor_si256(k, _mm256_and_si256(_mm256_srai_epi32(k, 31), _mm256_set1_epi32(0x7FFFFFFF))));
}

AVX2 static inline int any_not_finite(__m256 v) {
    const __m256i e = _mm256_set1_epi32(0x7F800000);
    return _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), e), e)) != 0;
}

/* meta_put of 8 lanes at buf + i: fp32 stored as is, or fp16 nearest (F16C's round to nearest even: f16_round) and,
 * `up`, one fp16 step higher where that is below v (v >= 0 here); returns the stored values, widened. */
AVX2 static inline __m256 meta_put8(void *buf, int f16, int64_t i, __m256 v, int up) {
    if (!f16) {
        _mm256_storeu_ps((float *)buf + i, v);
        return v;
    }
    __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (up) {
        __m256i below = _mm256_castps_si256(_mm256_cmp_ps(_mm256_cvtph_ps(h), v, _CMP_LT_OQ));
        h = _mm_sub_epi16(h, _mm_packs_epi32(_mm256_castsi256_si128(below), _mm256_extracti128_si256(below, 1)));
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)buf + i), h);
    return _mm256_cvtph_ps(h);
}

/* range_meta of 8 groups: their max and min keys, first values (the sign of an all-zero group), metadata index m;
 * o, s get the stored offset and the scale the codes use (1 where it is 0); returns the problem flags. */
AVX2 static inline int64_t range_meta8(__m256i khi, __m256i klo, __m256 first, void *offset, void *scale, int f16,
                                       int64_t m, float *o, float *s) {
    __m256 hi = values8(khi), lo = values8(klo), zero = _mm256_setzero_ps();
    __m256 both = _mm256_and_ps(_mm256_cmp_ps(hi, zero, _CMP_EQ_OQ), _mm256_cmp_ps(lo, zero, _CMP_EQ_OQ));
    hi = _mm256_blendv_ps(hi, first, both);
    lo = _mm256_blendv_ps(lo, first, both);
    int64_t flags = 0;
    __m256 od = meta_put8(offset, f16, m, _mm256_mul_ps(_mm256_add_ps(hi, lo), _mm256_set1_ps(0.5f)), 0);
    if (any_not_finite(od)) flags |= 2;
    __m256 a = _mm256_sub_ps(hi, od), b = _mm256_sub_ps(od, lo);
    __m256 sd = meta_put8(scale, f16, m, _mm256_blendv_ps(b, a, _mm256_cmp_ps(a, b, _CMP_GE_OQ)), 1);
    if (any_not_finite(sd)) flags |= 4;
    sd = _mm256_blendv_ps(_mm256_set1_ps(1.0f), sd, _mm256_cmp_ps(sd, zero, _CMP_GT_OQ));
    _mm256_storeu_ps(o, od);
    _mm256_storeu_ps(s, sd);
    return flags;
}

/* The codes of one row (D % 16 == 0) with per-element o, s: u = (x - o) / s exactly as the reference, its order
 * key, and the bucket table (exact_code, 8 lanes at a time); out as anchor and residual bytes, packed 4+4 (`packed`:
 * element pairs, the first in the low nibble) or one per byte (residual_bits rb). */
AVX2 static void codes_row_avx2(const float *yr, const float *o, const float *s, int64_t D, const uint32_t *tab,
                                int32_t off, int32_t shift, int packed, int rb, uint8_t *a_out, uint8_t *r_out) {
    const __m256i vo = _mm256_set1_epi32(off), lo16 = _mm256_set1_epi32(0xFFFF), ff = _mm256_set1_epi32(0xFF);
    const __m256i kmin = _mm256_set1_epi32(KEY_MIN), kmax = _mm256_set1_epi32(KEY_MAX);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m128i mask = _mm_set1_epi8((char)((1 << rb) - 1));
    for (int64_t d = 0; d < D; d += 16) {
        __m256i c[2];
        for (int v = 0; v < 2; v++) {
            int64_t e0 = d + 8 * v;
            __m256 u = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(yr + e0), _mm256_loadu_ps(o + e0)),
                                     _mm256_loadu_ps(s + e0));
            __m256i k = _mm256_min_epi32(_mm256_max_epi32(keys8(u), kmin), kmax);
            __m256i e = _mm256_i32gather_epi32((const int *)tab, _mm256_add_epi32(_mm256_srai_epi32(k, shift), vo), 4);
            __m256i below = _mm256_cmpgt_epi32(_mm256_and_si256(e, lo16), _mm256_and_si256(k, lo16));
            c[v] = _mm256_blendv_epi8(_mm256_srli_epi32(e, 24), _mm256_and_si256(_mm256_srli_epi32(e, 16), ff), below);
        }
        if (packed) { /* the pair (2j, 2j + 1) as one 32-bit lane of 16-bit codes */
            __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(c[0], c[1]), 0xD8);
            __m256i a = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w, 4), _mm256_set1_epi32(0x0F)),
                                        _mm256_and_si256(_mm256_srli_epi32(w, 16), _mm256_set1_epi32(0xF0)));
            __m256i r = _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi32(0x0F)),
                                        _mm256_and_si256(_mm256_srli_epi32(w, 12), _mm256_set1_epi32(0xF0)));
            __m256i p = _mm256_packus_epi32(a, r); /* 16-bit (a0-3, r0-3 | a4-7, r4-7) */
            p = _mm256_packus_epi16(p, p);         /* dwords (a0-3, r0-3, ., . | a4-7, r4-7, ., .) */
            __m128i q = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(p, order)); /* a0-3, a4-7, r0-3, r4-7 */
            _mm_storel_epi64((__m128i *)(a_out + d / 2), q);
            _mm_storel_epi64((__m128i *)(r_out + d / 2), _mm_srli_si128(q, 8));
        } else {
            __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(c[0], c[1]), 0xD8);
            __m128i b = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)); /* 16 codes */
            __m128i hi_mask = _mm_set1_epi8((char)(0xFF >> rb));
            _mm_storeu_si128((__m128i *)(a_out + d), _mm_and_si128(_mm_srl_epi16(b, _mm_cvtsi32_si128(rb)), hi_mask));
            _mm_storeu_si128((__m128i *)(r_out + d), _mm_and_si128(b, mask));
        }
    }
}

/* The fp16 offsets and scales of `groups` groups of C channels (C % 8 == 0), widened and repeated over each group's
 * channels into o[], s[]; returns their problem flags as the scalar loop does (1: an offset not finite, 2: a scale
 * not finite, 4: a scale below -0.0). */
AVX2 static int64_t group_meta_f16_avx2(const uint8_t *op, const uint8_t *sp, int64_t groups, int64_t C, float *o,
                                        float *s) {
    int64_t flags = 0;
    for (int64_t g = 0; g < groups; g++) {
        uint16_t ob = (uint16_t)(op[2 * g] | op[2 * g + 1] << 8), sb = (uint16_t)(sp[2 * g] | sp[2 * g + 1] << 8);
        if ((ob & 0x7C00u) == 0x7C00u) flags |= 1;
        if ((sb & 0x7C00u) == 0x7C00u) flags |= 2;
        if ((sb & 0x8000u) && sb != 0x8000u) flags |= 4;
        __m256 vo = _mm256_set1_ps(_cvtsh_ss(ob)), vs = _mm256_set1_ps(_cvtsh_ss(sb));
        for (int64_t d = g * C; d < g * C + C; d += 8) {
            _mm256_store_ps(o + d, vo);
            _mm256_store_ps(s + d, vs);
        }
    }
    return flags;
}

static int scalar_only = 0; /* lynx_scalar_only(1): the tests compare the vector rows with the scalar ones */

static int have_avx2(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? 1 : 0;
    }
    return known && !scalar_only;
}
#endif

static inline uint32_t meta_bits(const uint8_t *p, int wide) {
    return wide ? ((uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24))
                : ((uint32_t)p[0] | ((uint32_t)p[1] << 8));
}

/* Units [u0, u1) of the pages in `pages` (see lynxkv.quant.fast._decode_kernel for every argument); returns the
 * metadata problem flags (1: an offset is not finite, 2: a scale is not finite, 4: a scale is negative), or -1 when
 * the row buffer cannot be allocated. `y` holds fp32, or bf16 as uint16 bits when `y_bf16`. */
int64_t lynx_decode_pages(const uint8_t *o_buf, const uint8_t *s_buf, const uint8_t *a_buf, const uint8_t *r_buf,
                          const int64_t *pages, int64_t npages, int32_t packed, int32_t anchor_only, int32_t rb,
                          int32_t wide, int32_t per_row, int64_t block, float back, int64_t H, int64_t C, int64_t u0,
                          int64_t u1, const float *levels, void *y, int32_t y_bf16, int64_t sh, int64_t st,
                          int64_t sd) {
    int64_t cmax = 0;
    for (int64_t p = 0; p < npages; p++)
        if (pages[p * PG_WIDTH + PG_COLS] > cmax) cmax = pages[p * PG_WIDTH + PG_COLS];
    /* o, s and the row, 32-byte aligned */
    int64_t stride = (cmax + 7) / 8 * 8;
    float *mem = aligned_alloc(32, (size_t)(3 * stride + 8) * sizeof(float));
    if (!mem) return -1;
    float *o = mem, *s = mem + stride, *f = mem + 2 * stride;
    int mb = wide ? 4 : 2;
    uint32_t exponent = wide ? 0x7F800000u : 0x7C00u, sign = wide ? 0x80000000u : 0x8000u;
    int64_t flags = 0;
#ifdef LYNX_X86
    int vector = have_avx2() && packed;
#endif
    for (int64_t p = 0; p < npages; p++) {
        const int64_t *pg = pages + p * PG_WIDTH;
        int64_t rows = pg[PG_ROWS], cols = pg[PG_COLS], first = pg[PG_FIRST];
        int64_t held = pg[PG_HELD], rheld = pg[PG_RESIDUAL_HELD];
        int64_t nc = per_row ? rows : (rows + C - 1) / C, groups = (cols + C - 1) / C;
        int64_t nc_held = per_row ? held : (held + C - 1) / C; /* metadata rows per head */
        int64_t lo = u0 > first ? u0 : first, hi = u1 < first + H * nc ? u1 : first + H * nc;
#ifdef LYNX_X86
        int fast = vector && sd == 1 && cols % 16 == 0;
#endif
        for (int64_t unit = lo; unit < hi; unit++) {
            int64_t h = (unit - first) / nc, c = unit - first - h * nc;
            int64_t m = (per_row ? (h * nc_held + c) * groups : (h * nc_held + c) * cols) * mb;
#ifdef LYNX_X86
            if (fast && !per_row && !wide) { /* keys: one fp16 offset and scale per channel */
                flags |= meta_f16_avx2(o_buf + pg[PG_OFFSET] + m, cols, o, 1, 0);
                flags |= meta_f16_avx2(s_buf + pg[PG_SCALE] + m, cols, s, 2, 1);
            } else if (fast && per_row && !wide && C % 8 == 0 && cols % C == 0) { /* values per channel */
                flags |= group_meta_f16_avx2(o_buf + pg[PG_OFFSET] + m, s_buf + pg[PG_SCALE] + m, groups, C, o, s);
            } else
#endif
            for (int64_t g = 0; g < (per_row ? groups : cols); g++) {
                uint32_t ob = meta_bits(o_buf + pg[PG_OFFSET] + m + g * mb, wide);
                uint32_t sb = meta_bits(s_buf + pg[PG_SCALE] + m + g * mb, wide);
                if ((ob & exponent) == exponent) flags |= 1;
                if ((sb & exponent) == exponent) flags |= 2;
                if ((sb & sign) && sb != sign) flags |= 4; /* -0.0 is zero, not negative */
                float ov = wide ? bits_f32(ob) : f16_widen(ob), sv = wide ? bits_f32(sb) : f16_widen(sb);
                int64_t d0 = per_row ? g * C : g, d1 = per_row ? (g * C + C < cols ? g * C + C : cols) : g + 1;
                for (int64_t d = d0; d < d1; d++) {
                    o[d] = ov;
                    s[d] = sv;
                }
            }
            int64_t t0 = per_row ? c : c * C, t1 = per_row ? c + 1 : (c * C + C < rows ? c * C + C : rows);
            for (int64_t t = t0; t < t1; t++) {
                uint64_t el = (uint64_t)((h * held + t) * cols), rel = (uint64_t)((h * rheld + t) * cols);
                const uint8_t *ar = a_buf + pg[PG_ANCHOR] + (packed ? el >> 1 : el);
                const uint8_t *rr = anchor_only ? NULL : r_buf + pg[PG_RESIDUAL] + (packed ? rel >> 1 : rel);
                int64_t row = pg[PG_Y0] + h * sh + t * st;
#ifdef LYNX_X86
                if (fast) {
                    row_avx2(ar, rr, cols, levels, o, s, block, back, y, y_bf16, row, (__m256 *)f);
                    continue;
                }
#endif
                row_scalar(ar, rr, cols, packed, anchor_only, rb, levels, o, s, block, back, y, y_bf16, row, sd, f);
            }
        }
    }
    free(mem);
    return flags;
}

/* ------------------------------------------------------------------------------------------------ encode
 * The codes and metadata of units of a tensor: the reference's fp32 operations for the metadata and for the exact
 * pass; a first pass without the table flags the elements near a code boundary for the exact pass (the module
 * docstring of lynxkv.quant.fast says why that gives the reference's codes). Loops are written for the compiler's
 * vectoriser (no branches on the element path); the function is compiled for AVX2 and for the baseline, picked
 * at load time where the toolchain supports that. */

/* fp32 to fp16 bits, round to nearest even (overflow gives inf), as LLVM's fptrunc and torch do. */
static inline uint32_t f16_round(float v) {
    uint32_t b = f32_bits(v), sign = (b >> 16) & 0x8000u, a = b & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00u | ((a >> 13) & 0x3FFu); /* NaN stays NaN */
    if (a >= 0x477FF000u) return sign | 0x7C00u;                        /* rounds to >= 65520: inf */
    if (a >= 0x38800000u) return sign | ((a + 0xC8000FFFu + ((a >> 13) & 1u)) >> 13); /* normal: rebias, round */
    float t = bits_f32(a) * 16777216.0f;                                /* subnormal: units of 2^-24, exact */
    return sign | (uint32_t)((t + 8388608.0f) - 8388608.0f);            /* round to an integer, nearest even */
}

/* Store v in the metadata dtype at i, return the stored value: nearest, or (up, v >= 0) the smallest >= v. */
static inline float meta_put(void *buf, int f16, int64_t i, float v, int up) {
    if (!f16) {
        ((float *)buf)[i] = v;
        return v;
    }
    uint32_t nearest = f16_round(v);
    uint16_t stored = (uint16_t)(nearest + (uint32_t)(up && f16_widen(nearest) < v));
    ((uint16_t *)buf)[i] = stored;
    return f16_widen(stored);
}

static inline float meta_get(const void *buf, int f16, int64_t i) {
    return f16 ? f16_widen(((const uint16_t *)buf)[i]) : ((const float *)buf)[i];
}

static inline int32_t order_key(float v) {
    int32_t b = (int32_t)f32_bits(v);
    return b ^ ((b >> 31) & 0x7FFFFFFF);
}

static inline float key_value(int32_t k) { return bits_f32((uint32_t)(k ^ ((k >> 31) & 0x7FFFFFFF))); }

static inline int32_t abs_bits(float v) { return (int32_t)(f32_bits(v) & 0x7FFFFFFFu); }

/* The bucket table (lynxkv.quant.fast.code_table): entry b = (key >> shift) + off holds the low 16 bits of the
 * one code step inside the bucket (0 where there is none), the code below it (bits 16-23) and the code from it on
 * (bits 24-31). */
typedef struct {
    const uint32_t *tab;
    int64_t off;
    int shift;
} CodeTable;

static inline int32_t table_code(int32_t k, const CodeTable *t) {
    k = k < KEY_MIN ? KEY_MIN : k > KEY_MAX ? KEY_MAX : k; /* u outside [-1, 1] (given metadata): the end codes */
    uint32_t e = t->tab[(int64_t)(k >> t->shift) + t->off];
    return (int32_t)((k & 0xFFFF) >= (int32_t)(e & 0xFFFF) ? e >> 24 : (e >> 16) & 0xFF);
}

/* The reference's code of x: the exact u = fl((x - o) / s), its order key, the bucket table. */
static inline int32_t exact_code(float x, float o, float s, const CodeTable *t) {
    return table_code(order_key((x - o) / s), t);
}

/* log(y) for y >= 1 within 2^-19 max(1, log y): lynxkv.quant.fast.LOG_POLY in the kernel's order. */
static inline float log_f32(float y, const float *P) {
    int32_t bits = (int32_t)f32_bits(y);
    int32_t k = (bits - 0x3F3504F3) >> 23;
    float f = bits_f32((uint32_t)(bits - (k << 23))) - 1.0f;
    float f2 = f * f;
    float p = ((P[0] + P[1] * f) + f2 * (P[2] + P[3] * f)) + (f2 * f2) * (P[4] + P[5] * f);
    return ((f - 0.5f * f2) + (f2 * f) * p) + (float)k * 0.6931471805599453f;
}

static inline float z_alpha(float u, float alpha, float inv_c, const float *P) {
    float mag = log_f32(1.0f + fabsf(u) * alpha, P) * inv_c;
    return bits_f32(f32_bits(mag) | (f32_bits(u) & 0x80000000u));
}

/* floor(g) of g = (z + 1) gk + gb >= 0, bit 8 set where g is within margin of an integer. */
static inline int32_t approx_code(float z, float gk, float gb, float margin, float hi) {
    float g = (z + 1.0f) * gk + gb;
    int32_t code = (int32_t)g;
    float frac = g - (float)code;
    return code | ((int32_t)((frac < margin) | (frac > hi)) << 8);
}

/* cmax where x is the group's max, cmin where it is its min, else code (masks, not branches). */
static inline int32_t pick(float x, float mx, float mn, int32_t cmax, int32_t cmin, int32_t code) {
    int32_t is_max = -(int32_t)(x == mx);
    int32_t is_min = -(int32_t)(x == mn) & ~is_max;
    return (cmax & is_max) | (cmin & is_min) | (code & ~(is_max | is_min));
}

static inline float load_x(const void *x, int bf16, uint64_t i) {
    return bf16 ? bits_f32((uint32_t)((const uint16_t *)x)[i] << 16) : ((const float *)x)[i];
}

/* Midrange offset and scale of a group with max hi and min lo, stored at m; flags 2 / 4 on an overflow. */
static inline void range_meta(void *offset, void *scale, int f16, int64_t m, float hi, float lo, float *od,
                              float *sd, int64_t *flags) {
    *od = meta_put(offset, f16, m, (hi + lo) * 0.5f, 0);
    if (!isfinite(*od)) *flags |= 2;
    float a = hi - *od, b = *od - lo;
    *sd = meta_put(scale, f16, m, a >= b ? a : b, 1);
    if (!isfinite(*sd)) *flags |= 4;
}

/* The metadata of one group of n values g[0..n) (a run of channels of one row): read at m (meta_given), or from
 * the group's range and written at m (range_meta; flag 1 where a value is not finite); its max and min in *hi and
 * *lo (NaN where given: no element matches a NaN). */
static inline void group_meta(const float *g, int64_t n, int meta_given, void *offset, void *scale, int f16,
                              int64_t m, float *od, float *sd, float *hi, float *lo, int64_t *flags) {
    if (meta_given) {
        *od = meta_get(offset, f16, m);
        *sd = meta_get(scale, f16, m);
        *hi = *lo = NAN;
        return;
    }
    int32_t khi = order_key(g[0]), klo = khi, am = 0;
    for (int64_t j = 0; j < n; j++) {
        int32_t k = order_key(g[j]), a = abs_bits(g[j]);
        khi = khi > k ? khi : k;
        klo = klo < k ? klo : k;
        am = am > a ? am : a;
    }
    if (am >= 0x7F800000) *flags |= 1;
    *hi = key_value(khi);
    *lo = key_value(klo);
    if (*hi == 0 && *lo == 0) *hi = *lo = g[0]; /* all zeros: the first one's sign */
    range_meta(offset, scale, f16, m, *hi, *lo, od, sd, flags);
}

#ifdef LYNX_X86
/* Lane j of the result: the max (or min) of v[j]'s 8 lanes. */
AVX2 static inline __m256i across8(const __m256i *v, int max) {
#define PAIR(a, b) (max ? _mm256_max_epi32((a), (b)) : _mm256_min_epi32((a), (b)))
    __m256i a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = PAIR(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        b[i] = PAIR(_mm256_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
    return PAIR(_mm256_permute2x128_si256(b[0], b[1], 0x20), _mm256_permute2x128_si256(b[0], b[1], 0x31));
#undef PAIR
}

/* lynx_encode_units on AVX2 for values per channel: rows [u0, u1) (row = h T + t), G = D / C groups each. Rows go
 * in batches of R = 8 / G (1 where G is a multiple of 8), whose groups are contiguous in the metadata and take
 * range_meta 8 at a time; a shorter last batch, given metadata and other G, group by group. */
AVX2 static int64_t encode_rows_avx2(const void *x, int x_bf16, int64_t x0, int64_t sh, int64_t st, int64_t T,
                                     int64_t D, int64_t C, int64_t u0, int64_t u1, int meta_given, void *offset,
                                     void *scale, int meta_f16, const uint32_t *tab, int32_t off, int32_t shift,
                                     int rb, int packed, uint8_t *a_out, uint8_t *r_out, int64_t out_h,
                                     int64_t out_t) {
    int64_t G = D / C, R = 1;
    int batched = !meta_given && (G % 8 == 0 || 8 % G == 0);
    if (batched && G < 8) R = 8 / G;
    float *mem = malloc((size_t)(3 * R * D + 2 * R * G) * sizeof(float));
    if (!mem) return -1;
    float *y = mem, *o = y + R * D, *s = o + R * D, *og = s + R * D, *sg = og + R * G;
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F7FFFFF);
    int64_t flags = 0;
    for (int64_t r0 = u0; r0 < u1; r0 += R) {
        int64_t nr = u1 - r0 < R ? u1 - r0 : R, ng = nr * G, m0 = r0 * G;
        for (int64_t i = 0; i < nr; i++) {
            int64_t h = (r0 + i) / T, t = r0 + i - h * T;
            load_row_avx2(x, x_bf16, (uint64_t)(x0 + h * sh + t * st), D, y + i * D);
        }
        if (batched && nr == R) {
            for (int64_t j0 = 0; j0 < ng; j0 += 8) {
                __m256i kh[8], kl[8], am[8];
                float first[8];
                for (int q = 0; q < 8; q++) {
                    const float *g = y + (j0 + q) * C;
                    __m256 v = _mm256_loadu_ps(g);
                    kh[q] = kl[q] = keys8(v);
                    am[q] = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
                    for (int64_t j = 8; j < C; j += 8) {
                        v = _mm256_loadu_ps(g + j);
                        __m256i k = keys8(v);
                        kh[q] = _mm256_max_epi32(kh[q], k);
                        kl[q] = _mm256_min_epi32(kl[q], k);
                        am[q] = _mm256_max_epi32(am[q], _mm256_and_si256(_mm256_castps_si256(v), abs_mask));
                    }
                    first[q] = g[0];
                }
                if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(across8(am, 1), inf))) flags |= 1;
                flags |= range_meta8(across8(kh, 1), across8(kl, 0), _mm256_loadu_ps(first), offset, scale, meta_f16,
                                     m0 + j0, og + j0, sg + j0);
            }
        } else {
            for (int64_t j = 0; j < ng; j++) {
                float od, sd, hi, lo;
                group_meta(y + j * C, C, meta_given, offset, scale, meta_f16, m0 + j, &od, &sd, &hi, &lo, &flags);
                og[j] = od;
                sg[j] = sd > 0 ? sd : 1.0f;
            }
        }
        for (int64_t j = 0; j < ng; j++) {
            __m256 vo = _mm256_set1_ps(og[j]), vs = _mm256_set1_ps(sg[j]);
            for (int64_t i = 0; i < C; i += 8) {
                _mm256_storeu_ps(o + j * C + i, vo);
                _mm256_storeu_ps(s + j * C + i, vs);
            }
        }
        for (int64_t i = 0; i < nr; i++) {
            int64_t h = (r0 + i) / T, t = r0 + i - h * T;
            uint64_t el = (uint64_t)(h * out_h + t * out_t);
            uint64_t at = packed ? el >> 1 : el;
            codes_row_avx2(y + i * D, o + i * D, s + i * D, D, tab, off, shift, packed, rb, a_out + at, r_out + at);
        }
    }
    free(mem);
    return flags;
}

/* lynx_encode_units on AVX2 for groups along tokens (D % 16 == 0; a rotation of block >= 8, D <= 512): units of
 * n <= C rows, the metadata of 8 channels at a time, every code from the bucket table. */
AVX2 static int64_t encode_units_avx2(const void *x, int x_bf16, int64_t x0, int64_t sh, int64_t st, int64_t T,
                                      int64_t D, int64_t C, int64_t nc, int64_t block, float rotation_scale,
                                      int64_t u0, int64_t u1, int meta_given, void *offset, void *scale,
                                      int meta_f16, const uint32_t *tab, int32_t off, int32_t shift, int rb,
                                      int packed, uint8_t *a_out, uint8_t *r_out, int64_t out_h, int64_t out_t) {
    float *mem = malloc((size_t)(C * D + 2 * D) * sizeof(float));
    if (!mem) return -1;
    float *y = mem, *o = y + C * D, *s = o + D;
    const __m256i inf = _mm256_set1_epi32(0x7F7FFFFF), abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    int64_t flags = 0;
    for (int64_t unit = u0; unit < u1; unit++) {
        int64_t h = unit / nc, t0 = (unit - h * nc) * C, n = T - t0 < C ? T - t0 : C;
        uint64_t base = (uint64_t)(x0 + h * sh + t0 * st);
        for (int64_t t = 0; t < n; t++) load_row_avx2(x, x_bf16, base + (uint64_t)(t * st), D, y + t * D);
        if (block > 1) rotate_rows_avx2(y, n, D, block, rotation_scale);
        if (meta_given) {
            for (int64_t d = 0; d < D; d++) {
                o[d] = meta_get(offset, meta_f16, unit * D + d);
                float sd = meta_get(scale, meta_f16, unit * D + d);
                s[d] = sd > 0 ? sd : 1.0f;
            }
        } else { /* per channel along the unit's tokens */
            for (int64_t d = 0; d < D; d += 8) {
                __m256 v = _mm256_loadu_ps(y + d);
                __m256i kh = keys8(v), kl = kh, am = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
                for (int64_t t = 1; t < n; t++) {
                    __m256 w = _mm256_loadu_ps(y + t * D + d);
                    __m256i k = keys8(w);
                    kh = _mm256_max_epi32(kh, k);
                    kl = _mm256_min_epi32(kl, k);
                    am = _mm256_max_epi32(am, _mm256_and_si256(_mm256_castps_si256(w), abs_mask));
                }
                if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(am, inf))) flags |= 1;
                flags |= range_meta8(kh, kl, v, offset, scale, meta_f16, unit * D + d, o + d, s + d);
            }
        }
        for (int64_t t = 0; t < n; t++) {
            uint64_t el = (uint64_t)(h * out_h + (t0 + t) * out_t), at = packed ? el >> 1 : el;
            codes_row_avx2(y + t * D, o, s, D, tab, off, shift, packed, rb, a_out + at, r_out + at);
        }
    }
    free(mem);
    return flags;
}
#endif

#if defined(LYNX_X86) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef CLONES
#define CLONES
#endif

/* Units [u0, u1) (see lynxkv.quant.fast._encode_kernel for every argument); returns its problem flags (1: the
 * input is not finite, 2: a centre overflows the metadata dtype, 4: a scale does), or -1 when the buffers
 * cannot be allocated. x holds fp32, or bf16 as uint16 bits (x_bf16); offset/scale fp32, or fp16 bits (meta_f16);
 * P the six LOG_POLY coefficients in fp32. */
CLONES int64_t lynx_encode_units(const void *x, int32_t x_bf16, int64_t x0, int64_t sh, int64_t st, int64_t T,
                                 int64_t D, int64_t C, int64_t nc, int32_t per_row, int64_t block,
                                 float rotation_scale, int64_t u0, int64_t u1, int32_t meta_given, void *offset,
                                 void *scale, int32_t meta_f16, float alpha, float inv_c, float gk, float gb,
                                 float margin, const float *P, const uint32_t *tab, int64_t off, int32_t shift, int32_t rb, int32_t packed, uint8_t *a_out,
                                 uint8_t *r_out, int64_t out_h, int64_t out_t) {
#ifdef LYNX_X86
    if (have_avx2() && D % 16 == 0 && per_row && C % 8 == 0 && D % C == 0)
        return encode_rows_avx2(x, x_bf16, x0, sh, st, T, D, C, u0, u1, meta_given, offset, scale, meta_f16, tab,
                                (int32_t)off, shift, rb, packed, a_out, r_out, out_h, out_t);
    if (have_avx2() && D % 16 == 0 && !per_row && (block == 1 || (block >= 8 && D <= 512)))
        return encode_units_avx2(x, x_bf16, x0, sh, st, T, D, C, nc, block, rotation_scale, u0, u1, meta_given,
                                 offset, scale, meta_f16, tab, (int32_t)off, shift, rb, packed, a_out, r_out, out_h,
                                 out_t);
#endif
    const CodeTable table = {tab, off, shift};
    int64_t G = (D + C - 1) / C, ny = per_row ? D : C * D;
    size_t floats = (size_t)(ny + 6 * D), ints = (size_t)(6 * D);
    float *mem = malloc(floats * sizeof(float) + ints * sizeof(int32_t));
    if (!mem) return -1;
    float *y = mem, *mx = y + ny, *mn = mx + D, *o = mn + D, *s = o + D, *inv = s + D, *zb = inv + D;
    int32_t *kmx = (int32_t *)(mem + floats), *kmn = kmx + D, *amax = kmn + D, *cmax = amax + D, *cmin = cmax + D,
            *rc = cmin + D;
    int32_t mask = (1 << rb) - 1;
    int gshift = 0; /* o[d >> gshift] is element d's offset: C = 2^gshift per row, 1 along tokens */
    while (per_row && (1 << gshift) < C) gshift++;
    int64_t flags = 0;
    for (int64_t unit = u0; unit < u1; unit++) {
        int64_t h, t0, n;
        if (per_row) {
            h = unit / T;
            t0 = unit - h * T;
            n = 1;
        } else {
            h = unit / nc;
            t0 = (unit - h * nc) * C;
            n = T - t0 < C ? T - t0 : C;
        }
        uint64_t base = (uint64_t)(x0 + h * sh + t0 * st);
        int stats = !(per_row || meta_given), fused = stats && block == 1;
        for (int64_t t = 0; t < n; t++) { /* the unit in fp32 */
            uint64_t row = base + (uint64_t)(t * st);
            float *yr = y + t * D;
            for (int64_t d = 0; d < D; d++) yr[d] = load_x(x, x_bf16, row + (uint64_t)d);
        }
        if (block > 1) { /* rotate each row: the butterfly, then times 2^-k */
#ifdef LYNX_X86
            if (block >= 8 && D % 8 == 0 && D <= 512 && have_avx2()) {
                rotate_rows_avx2(y, n, D, block, rotation_scale);
            } else
#endif
            for (int64_t t = 0; t < n; t++) {
                float *v = y + t * D;
                butterfly_scalar(v, D, block);
                if (rotation_scale != 1.0f)
                    for (int64_t d = 0; d < D; d++) v[d] = v[d] * rotation_scale;
            }
        }
        if (stats || fused) { /* along tokens: per channel the order keys' max and min, the largest |x| bits */
            for (int64_t d = 0; d < D; d++) {
                kmx[d] = kmn[d] = order_key(y[d]);
                amax[d] = abs_bits(y[d]);
            }
            for (int64_t t = 1; t < n; t++) {
                const float *yr = y + t * D;
                for (int64_t d = 0; d < D; d++) {
                    int32_t k = order_key(yr[d]), a = abs_bits(yr[d]);
                    kmx[d] = kmx[d] > k ? kmx[d] : k;
                    kmn[d] = kmn[d] < k ? kmn[d] : k;
                    amax[d] = amax[d] > a ? amax[d] : a;
                }
            }
        }
        int tiny = 0;
        if (per_row) { /* metadata and first-pass codes group by group */
            for (int64_t g = 0; g < G; g++) {
                int64_t g0 = g * C, size = (D < g0 + C ? D : g0 + C) - g0, m = unit * G + g;
                float od, sd, hi, lo;
                group_meta(y + g0, size, meta_given, offset, scale, meta_f16, m, &od, &sd, &hi, &lo, &flags);
                sd = sd > 0 ? sd : 1.0f; /* s = 0 only where x - o = 0: u = 0 as specified */
                tiny |= sd < 0x1p-100f;  /* 1/s may overflow: the exact pass for this row */
                o[g] = od;
                s[g] = sd;
                float iv = 1.0f / sd;
                int32_t ch = 0, cl = 0;
                if (!meta_given) {
                    ch = exact_code(hi, od, sd, &table);
                    cl = exact_code(lo, od, sd, &table);
                }
                if (alpha > 0)
                    for (int64_t j = 0; j < size; j++) zb[g0 + j] = z_alpha((y[g0 + j] - od) * iv, alpha, inv_c, P);
                else
                    for (int64_t j = 0; j < size; j++) zb[g0 + j] = (y[g0 + j] - od) * iv;
                for (int64_t j = 0; j < size; j++)
                    rc[g0 + j] = pick(y[g0 + j], hi, lo, ch, cl, approx_code(zb[g0 + j], gk, gb, margin, 1.0f - margin));
            }
        } else {
            int64_t m = unit * D;
            for (int64_t d = 0; d < D; d++) {
                float od, sd, hi, lo;
                if (meta_given) {
                    od = meta_get(offset, meta_f16, m + d);
                    sd = meta_get(scale, meta_f16, m + d);
                    hi = lo = NAN;
                } else {
                    if (amax[d] >= 0x7F800000) flags |= 1;
                    hi = key_value(kmx[d]);
                    lo = key_value(kmn[d]);
                    if (hi == 0 && lo == 0) hi = lo = y[d];
                    range_meta(offset, scale, meta_f16, m + d, hi, lo, &od, &sd, &flags);
                }
                mx[d] = hi;
                mn[d] = lo;
                o[d] = od;
                sd = sd > 0 ? sd : 1.0f;
                s[d] = sd;
                inv[d] = 1.0f / sd;
                tiny |= sd < 0x1p-100f;
            }
            for (int64_t d = 0; d < D; d++) {
                cmax[d] = meta_given ? 0 : exact_code(mx[d], o[d], s[d], &table);
                cmin[d] = meta_given ? 0 : exact_code(mn[d], o[d], s[d], &table);
            }
        }
        float unit_margin = tiny ? 2.0f : margin, hi_margin = 1.0f - unit_margin;
        for (int64_t t = 0; t < n; t++) {
            const float *yr = y + t * D;
            int32_t flagged = 0;
            if (per_row) {
                for (int64_t d = 0; d < D; d++) flagged |= rc[d];
            } else { /* first pass, every element, without the table */
                if (alpha > 0)
                    for (int64_t d = 0; d < D; d++) zb[d] = z_alpha((yr[d] - o[d]) * inv[d], alpha, inv_c, P);
                else
                    for (int64_t d = 0; d < D; d++) zb[d] = (yr[d] - o[d]) * inv[d];
                for (int64_t d = 0; d < D; d++) {
                    int32_t code = pick(yr[d], mx[d], mn[d], cmax[d], cmin[d],
                                        approx_code(zb[d], gk, gb, unit_margin, hi_margin));
                    rc[d] = code;
                    flagged |= code;
                }
            }
            /* second pass, flagged elements: the exact u and the table */
            if (unit_margin >= 1) {
                for (int64_t d = 0; d < D; d++) rc[d] = exact_code(yr[d], o[d >> gshift], s[d >> gshift], &table);
            } else if (flagged & 0x100) {
                for (int64_t b0 = 0; b0 < D; b0 += 16) { /* blocks of 16: a flagged element is rare */
                    int64_t b1 = D < b0 + 16 ? D : b0 + 16;
                    int32_t bits = 0;
                    for (int64_t d = b0; d < b1; d++) bits |= rc[d];
                    if (bits & 0x100)
                        for (int64_t d = b0; d < b1; d++)
                            if (rc[d] & 0x100) rc[d] = exact_code(yr[d], o[d >> gshift], s[d >> gshift], &table);
                }
            }
            uint64_t el = (uint64_t)(h * out_h + (t0 + t) * out_t);
            if (packed) {
                uint64_t p = el >> 1;
                for (int64_t j = 0; j < D / 2; j++) {
                    int32_t lo_code = rc[2 * j], hi_code = rc[2 * j + 1];
                    a_out[p + j] = (uint8_t)((lo_code >> 4) | (hi_code & 0xF0));
                    r_out[p + j] = (uint8_t)((lo_code & 0x0F) | ((hi_code & 0x0F) << 4));
                }
            } else {
                for (int64_t d = 0; d < D; d++) {
                    a_out[el + d] = (uint8_t)(rc[d] >> rb);
                    r_out[el + d] = (uint8_t)(rc[d] & mask);
                }
            }
        }
    }
    free(mem);
    return flags;
}

/* ------------------------------------------------------------------------------------------------ rotation, packing */

/* Rows [r0, r1) (row = h T + t) of x (fp32, or bf16 bits; element (h, t, d) at x0 + h sh + t st + d), rotated:
 * butterfly(row) times `scale`, in fp32 into y [H T D] (C order): lynxkv.quant.rotation.rotate's operations. */
int64_t lynx_rotate_rows(const void *x, int32_t x_bf16, int64_t x0, int64_t sh, int64_t st, int64_t T, int64_t D,
                         int64_t block, float scale, float *y, int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; row++) {
        int64_t h = row / T;
        uint64_t base = (uint64_t)(x0 + h * sh + (row - h * T) * st);
        float *out = y + row * D;
        for (int64_t d = 0; d < D; d++) out[d] = load_x(x, x_bf16, base + (uint64_t)d);
#ifdef LYNX_X86
        if (block >= 8 && D % 8 == 0 && D <= 512 && have_avx2()) {
            rotate_rows_avx2(out, 1, D, block, scale);
            continue;
        }
#endif
        butterfly_scalar(out, D, block);
        for (int64_t d = 0; d < D; d++) out[d] = out[d] * scale;
    }
    return 0;
}

/* Rows [r0, r1) (row = h n + t) of a strided [H, n, D] uint8 view (D even), two codes per byte, the first in
 * the low nibble, into out in C order. */
int64_t lynx_pack4_rows(const uint8_t *v, int64_t v0, int64_t sh, int64_t st, int64_t n, int64_t D, uint8_t *out,
                        int64_t r0, int64_t r1) {
    int64_t half = D / 2;
    for (int64_t row = r0; row < r1; row++) {
        int64_t h = row / n;
        const uint8_t *src = v + v0 + h * sh + (row - h * n) * st;
        uint8_t *dst = out + row * half;
        for (int64_t j = 0; j < half; j++) dst[j] = (uint8_t)((src[2 * j] & 0x0F) | ((src[2 * j + 1] & 0x0F) << 4));
    }
    return 0;
}

/* Bytes [i0, i1) of p, each into two values (low nibble first). */
int64_t lynx_unpack4(const uint8_t *p, uint8_t *out, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        out[2 * i] = p[i] & 0x0F;
        out[2 * i + 1] = p[i] >> 4;
    }
    return 0;
}

/* Take the scalar rows even where the vector ones would run (1), or not (0): for the tests, between calls. */
void lynx_scalar_only(int32_t on) {
#ifdef LYNX_X86
    scalar_only = on;
#else
    (void)on;
#endif
}

/* Whether the vector row kernel runs on this CPU (for the tests and the benchmarks). */
int32_t lynx_vector_rows(void) {
#ifdef LYNX_X86
    return have_avx2();
#else
    return 0;
#endif
}
