/* The fast CPU decode of lynxkv.quant.fast in C: x̂ = o + s·levels[code], rotated back for format 1.3 keys,
 * rounded to bf16 or kept in fp32, for pages of codes held in byte buffers.
 *
 * It computes exactly what lynxkv.quant.fast's numba decode kernel computes, in the same fp32 operations on the
 * same operands, so the same bits (the torch reference is the oracle of both in the tests):
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
 * Python loads this library with ctypes (lynxkv.quant.fast): the calls release the GIL, and the caller splits the
 * units over its threads. Nothing here allocates beyond one row buffer per call or keeps state between calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LYNX_X86 1
#include <immintrin.h>
#endif

/* One row of the page table (int64 [P, 8]), in the order lynxkv.quant.fast writes it. */
enum { PG_OFFSET, PG_SCALE, PG_ANCHOR, PG_RESIDUAL, PG_Y0, PG_ROWS, PG_COLS, PG_FIRST, PG_WIDTH };

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
    const __m256 neg1 = _mm256_castsi256_ps(_mm256_setr_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN));
    const __m256 neg2 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, INT32_MIN, INT32_MIN, 0, 0, INT32_MIN, INT32_MIN));
    const __m256 neg4 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN));
    for (int64_t k = 0; k < nv; k++) {
        __m256 v = f[k];
        v = STAGE_IN_REGISTER(v, _mm256_permute_ps(v, 0xB1), neg1); /* h = 1: lanes (1, 0, 3, 2) */
        if (block > 2) v = STAGE_IN_REGISTER(v, _mm256_permute_ps(v, 0x4E), neg2); /* h = 2: (2, 3, 0, 1) */
        if (block > 4) v = STAGE_IN_REGISTER(v, _mm256_permute2f128_ps(v, v, 0x01), neg4); /* h = 4 */
        f[k] = v;
    }
    for (int64_t h = 1; h < block / 8; h *= 2) /* h = 8, 16, ...: whole vectors, h / 8 apart */
        for (int64_t k0 = 0; k0 < nv; k0 += 2 * h)
            for (int64_t k = k0; k < k0 + h; k++) {
                __m256 a = f[k], b = f[k + h];
                f[k] = _mm256_add_ps(a, b);
                f[k + h] = _mm256_sub_ps(a, b);
            }
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

static int have_avx2(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? 1 : 0;
    }
    return known;
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
        int64_t nc = per_row ? rows : (rows + C - 1) / C, groups = (cols + C - 1) / C;
        int64_t lo = u0 > first ? u0 : first, hi = u1 < first + H * nc ? u1 : first + H * nc;
#ifdef LYNX_X86
        int fast = vector && sd == 1 && cols % 16 == 0;
#endif
        for (int64_t unit = lo; unit < hi; unit++) {
            int64_t h = (unit - first) / nc, c = unit - first - h * nc;
            int64_t m = (per_row ? (h * nc + c) * groups : (h * nc + c) * cols) * mb;
#ifdef LYNX_X86
            if (fast && !per_row && !wide) { /* keys: one fp16 offset and scale per channel */
                flags |= meta_f16_avx2(o_buf + pg[PG_OFFSET] + m, cols, o, 1, 0);
                flags |= meta_f16_avx2(s_buf + pg[PG_SCALE] + m, cols, s, 2, 1);
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
                uint64_t el = (uint64_t)((h * rows + t) * cols);
                uint64_t at = packed ? el >> 1 : el;
                const uint8_t *ar = a_buf + pg[PG_ANCHOR] + at;
                const uint8_t *rr = anchor_only ? NULL : r_buf + pg[PG_RESIDUAL] + at;
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

/* Whether the vector row kernel runs on this CPU (for the tests and the benchmarks). */
int32_t lynx_vector_rows(void) {
#ifdef LYNX_X86
    return have_avx2();
#else
    return 0;
#endif
}

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "lynxkv's compiled decode (C); called through ctypes by lynxkv.quant.fast, which documents it.", -1, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
