/* CRC-32 of zlib, PNG and gzip (reflected polynomial 0xEDB88320), the checksum of every .lynx page, index and
 * header: zlib.crc32's value, computed by carry-less multiplication where the CPU has PCLMULQDQ (checked at run
 * time), else, and for the last bytes, by a 256-entry table.
 *
 * The carry-less path is the folding method of Gopal et al., "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ Instruction" (Intel, 2009): four 128-bit lanes are folded 64 bytes at a time by x^(512±32) mod P,
 * then into one lane, then to 64 bits, and reduced to 32 bits by Barrett reduction. The constants are those of
 * the paper for the reflected CRC-32 polynomial (bit-reflected, shifted by one).
 *
 * Python calls it through a cffi module typed by _crc.h (built by setup.py; lynxkv.format.checksum).
 */
#include <stddef.h>
#include <stdint.h>

#include "_crc.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LYNX_X86 1
#include <immintrin.h>
#endif

static uint32_t table[256];

__attribute__((constructor)) static void build_table(void) { /* when the library loads */
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[i] = c;
    }
}

/* The running state (not inverted) over n bytes, a byte at a time. */
static uint32_t crc_bytes(uint32_t state, const uint8_t *p, size_t n) {
    while (n--) state = table[(state ^ *p++) & 0xFF] ^ (state >> 8);
    return state;
}

#ifdef LYNX_X86
#define CLMUL __attribute__((target("pclmul,sse4.1")))

/* The running state over n bytes, n >= 64 and n % 16 == 0. */
CLMUL static uint32_t crc_fold(uint32_t state, const uint8_t *p, size_t n) {
    const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL); /* x^(4*128+32), x^(4*128-32) mod P */
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL); /* x^(128+32), x^(128-32) mod P */
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);                /* x^64 mod P */
    const __m128i poly = _mm_set_epi64x(0x1f7011641LL, 0x1db710641LL);  /* Barrett: mu, P */
    const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
    __m128i x1 = _mm_loadu_si128((const __m128i *)p), x2 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 32)), x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)state));
    p += 64;
    n -= 64;
#define FOLD(x, k, next) \
    _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128((x), (k), 0x00), _mm_clmulepi64_si128((x), (k), 0x11)), (next))
    for (; n >= 64; n -= 64, p += 64) {
        x1 = FOLD(x1, k1k2, _mm_loadu_si128((const __m128i *)p));
        x2 = FOLD(x2, k1k2, _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = FOLD(x3, k1k2, _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = FOLD(x4, k1k2, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    x1 = FOLD(x1, k3k4, x2);
    x1 = FOLD(x1, k3k4, x3);
    x1 = FOLD(x1, k3k4, x4);
    for (; n >= 16; n -= 16, p += 16) x1 = FOLD(x1, k3k4, _mm_loadu_si128((const __m128i *)p));
#undef FOLD
    /* 128 -> 64 bits (appending 32 zero bits), then 64 -> 32 */
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(k3k4, x1, 0x01), _mm_srli_si128(x1, 8));
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5, 0x00), _mm_srli_si128(x1, 4));
    /* Barrett reduction */
    __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, mask32), poly, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x1, t), 1);
}

static int have_clmul(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1") ? 1 : 0;
    }
    return known;
}
#endif

/* zlib.crc32(data, crc) of n bytes at p. */
uint32_t lynx_crc32(const uint8_t *p, size_t n, uint32_t crc) {
    uint32_t state = ~crc;
#ifdef LYNX_X86
    if (n >= 64 && have_clmul()) {
        size_t bulk = n & ~(size_t)15;
        state = crc_fold(state, p, bulk);
        p += bulk;
        n -= bulk;
    }
#endif
    return ~crc_bytes(state, p, n);
}

/* Whether the carry-less path runs on this CPU (for the tests and the benchmarks). */
int32_t lynx_crc32_folds(void) {
#ifdef LYNX_X86
    return have_clmul();
#else
    return 0;
#endif
}
