/* The exact remainder (spec/FORMAT.md §10), compiled: the same bytes as the torch reference
 * (lynxkv/quant/remainder.py), which documents the arithmetic. Its binding is typed by _remainder.h (cffi, built by
 * setup.py).
 *
 * Elements are E = 2 (bf16, fp16) or 4 (fp32) bytes wide, little-endian, contiguous. For element i:
 *   o(b)  = b ^ ((b >> (w-1)) & (2^(w-1) - 1))     on the signed w-bit view b (orders like the value; an involution)
 *   d     = o(original) - o(predicted)  modulo 2^w  (read as signed)
 *   z     = zigzag(d) = (d << 1) ^ (d >> (w-1))    (0, -1, 1, -2 ... -> 0, 1, 2, 3 ...)
 * and the elements are written in the order of the predicted value's exponent field (ascending, ties in element
 * order): slot s of byte plane j holds byte j of z of the s-th element of that order.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_remainder.h"

static inline uint16_t ord16(uint16_t b) { return b ^ ((uint16_t)(-(int16_t)(b >> 15)) & 0x7FFF); }
static inline uint32_t ord32(uint32_t b) { return b ^ ((uint32_t)(-(int32_t)(b >> 31)) & 0x7FFFFFFF); }

/* start[k]: the first slot of key k, from the keys' histogram (four interleaved counts: no store-to-load chain);
 * counts (if not NULL) gets the histogram. */
static void slots(const uint8_t *restrict key, int64_t n, int64_t start[256], int64_t *counts) {
    int64_t c[4][256];
    memset(c, 0, sizeof c);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        c[0][key[i]]++;
        c[1][key[i + 1]]++;
        c[2][key[i + 2]]++;
        c[3][key[i + 3]]++;
    }
    for (; i < n; i++) c[0][key[i]]++;
    int64_t s = 0;
    for (int k = 0; k < 256; k++) {
        start[k] = s;
        int64_t count = c[0][k] + c[1][k] + c[2][k] + c[3][k];
        if (counts) counts[k] = count;
        s += count;
    }
}

/* The keys of n predictions: the exponent field (bf16 bits 7-14, fp16 bits 10-14, fp32 bits 23-30). */
static void keys(const void *predicted, int64_t n, int32_t width, int32_t fp16, uint8_t *key) {
    if (width == 2) {
        const uint16_t *p = (const uint16_t *)predicted;
        int sh = fp16 ? 10 : 7;
        unsigned m = fp16 ? 0x1F : 0xFF;
        for (int64_t i = 0; i < n; i++) key[i] = (uint8_t)((p[i] >> sh) & m);
    } else {
        const uint32_t *p = (const uint32_t *)predicted;
        for (int64_t i = 0; i < n; i++) key[i] = (uint8_t)((p[i] >> 23) & 0xFF);
    }
}

/* The scratch memory of both passes (NULL when it cannot be allocated): n keys of the predicted elements, then
 * n elements of width bytes; start[256] receives each key's first slot (counts as in slots()). */
static uint8_t *scratch(const void *predicted, int64_t n, int32_t width, int32_t fp16, int64_t *start,
                        int64_t *counts) {
    uint8_t *key = malloc((size_t)n * (1 + width));
    if (!key) return NULL;
    keys(predicted, n, width, fp16, key);
    slots(key, n, start, counts);
    return key;
}

/* planes [width, n] from n original and n predicted elements, and counts[256] (if not NULL) the elements of each
 * key; returns 0, -1 for a width other than 2 and 4, -2 when the scratch memory cannot be allocated. */
int64_t lynx_exact_planes(const void *original, const void *predicted, int64_t n, int32_t width, int32_t fp16,
                          uint8_t *planes, int64_t *counts) {
    if (width != 2 && width != 4) return -1;
    if (counts) memset(counts, 0, 256 * sizeof(int64_t));
    if (n <= 0) return 0;
    int64_t start[256];
    uint8_t *key = scratch(predicted, n, width, fp16, start, counts);
    if (!key) return -2;
    uint8_t *zbuf = key + n;
    if (width == 2) {
        const uint16_t *x = (const uint16_t *)original, *p = (const uint16_t *)predicted;
        uint16_t *z = (uint16_t *)zbuf;
        for (int64_t i = 0; i < n; i++) {
            uint16_t d = (uint16_t)(ord16(x[i]) - ord16(p[i]));
            z[i] = (uint16_t)((d << 1) ^ (uint16_t)(-(int16_t)(d >> 15)));
        }
        uint8_t *lo = planes, *hi = planes + n;
        for (int64_t i = 0; i < n; i++) {
            int64_t s = start[key[i]]++;
            lo[s] = (uint8_t)z[i];
            hi[s] = (uint8_t)(z[i] >> 8);
        }
    } else {
        const uint32_t *x = (const uint32_t *)original, *p = (const uint32_t *)predicted;
        uint32_t *z = (uint32_t *)zbuf;
        for (int64_t i = 0; i < n; i++) {
            uint32_t d = ord32(x[i]) - ord32(p[i]);
            z[i] = (d << 1) ^ (uint32_t)(-(int32_t)(d >> 31));
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t s = start[key[i]]++;
            planes[s] = (uint8_t)z[i];
            planes[n + s] = (uint8_t)(z[i] >> 8);
            planes[2 * n + s] = (uint8_t)(z[i] >> 16);
            planes[3 * n + s] = (uint8_t)(z[i] >> 24);
        }
    }
    free(key);
    return 0;
}

/* The n original elements from planes [width, n] and the same n predicted elements; returns as above. */
int64_t lynx_exact_apply(const uint8_t *planes, const void *predicted, int64_t n, int32_t width, int32_t fp16,
                         void *original) {
    if (width != 2 && width != 4) return -1;
    if (n <= 0) return 0;
    int64_t start[256];
    uint8_t *key = scratch(predicted, n, width, fp16, start, NULL);
    if (!key) return -2;
    uint8_t *zbuf = key + n;
    if (width == 2) {
        const uint16_t *p = (const uint16_t *)predicted;
        uint16_t *x = (uint16_t *)original, *z = (uint16_t *)zbuf;
        const uint8_t *lo = planes, *hi = planes + n;
        for (int64_t i = 0; i < n; i++) {
            int64_t s = start[key[i]]++;
            z[i] = (uint16_t)(lo[s] | (hi[s] << 8));
        }
        for (int64_t i = 0; i < n; i++) {
            uint16_t d = (uint16_t)((z[i] >> 1) ^ (uint16_t)(-(int16_t)(z[i] & 1)));
            x[i] = ord16((uint16_t)(ord16(p[i]) + d));
        }
    } else {
        const uint32_t *p = (const uint32_t *)predicted;
        uint32_t *x = (uint32_t *)original, *z = (uint32_t *)zbuf;
        for (int64_t i = 0; i < n; i++) {
            int64_t s = start[key[i]]++;
            z[i] = (uint32_t)planes[s] | ((uint32_t)planes[n + s] << 8) | ((uint32_t)planes[2 * n + s] << 16) |
                   ((uint32_t)planes[3 * n + s] << 24);
        }
        for (int64_t i = 0; i < n; i++) {
            uint32_t d = (z[i] >> 1) ^ (uint32_t)(-(int32_t)(z[i] & 1));
            x[i] = ord32(ord32(p[i]) + d);
        }
    }
    free(key);
    return 0;
}
