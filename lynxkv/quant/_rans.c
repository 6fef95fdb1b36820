/* Exact records of coding 2 (format 1.5, spec/FORMAT.md §12.6), compiled: the same bytes as the Python reference
 * (lynxkv/quant/rans.py), which documents the coding. Loaded with ctypes beside _remainder.c.
 *
 * For element i of a page (K then V, row-major, N elements): z = zigzag(o(original) - o(predicted)) as in
 * _remainder.c; z becomes a symbol (z < 16: z itself; else 16 + 2·(b-5) + the bit below the top one, b = the bit
 * length of z, and the b-2 low bits go raw to the extra bits), coded by one static rANS stream (32-bit state,
 * L = 2^16, 16-bit words out, 12-bit frequencies) with a frequency table per context: the (half, exponent key) of the
 * prediction where that pair has at least 256 elements in the page, the shared context otherwise.
 *
 * Body (after the record's original_crc32): stream_length u32 | tables | rANS stream | extra bits (LSB first).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PROB_BITS 12
#define PROB_TOTAL (1u << PROB_BITS)
#define STATE_LOW (1u << 16)
#define LITERALS 16
#define MIN_CONTEXT 256
#define MAX_CONTEXTS (2 * 256 + 1)
#define MAX_ALPHABET (LITERALS + 2 * (32 - 4))

/* error codes of the decoder, mapped to field names by lynxkv/quant/rans.py */
enum { E_WIDTH = -1, E_MEMORY = -2, E_CAPACITY = -3, E_LENGTH = -10, E_TABLE = -11, E_STREAM = -12, E_STATE = -13,
       E_EXTRA = -14 };

static inline uint16_t ord16(uint16_t b) { return b ^ ((uint16_t)(-(int16_t)(b >> 15)) & 0x7FFF); }
static inline uint32_t ord32(uint32_t b) { return b ^ ((uint32_t)(-(int32_t)(b >> 31)) & 0x7FFFFFFF); }

static inline int alphabet(int32_t width) { return LITERALS + 2 * (8 * width - 4); }

static inline uint32_t key_of(const void *predicted, int64_t i, int32_t width, int32_t fp16) {
    if (width == 2) {
        uint16_t p = ((const uint16_t *)predicted)[i];
        return fp16 ? (p >> 10) & 0x1F : (p >> 7) & 0xFF;
    }
    return (((const uint32_t *)predicted)[i] >> 23) & 0xFF;
}

/* ctx[i] for every element and the number of contexts: (half, key) pairs with >= MIN_CONTEXT elements in the
 * order half 0 keys ascending, half 1 keys ascending, then the shared context if any element falls into it. */
static int contexts(const void *predicted, int64_t n, int32_t width, int32_t fp16, uint16_t *ctx) {
    int64_t count[2][256];
    int32_t index[2][256];
    memset(count, 0, sizeof count);
    int64_t half = n / 2;
    for (int64_t i = 0; i < n; i++) {
        uint32_t k = key_of(predicted, i, width, fp16);
        ctx[i] = (uint16_t)k;
        count[i >= half][k]++;
    }
    int c = 0, shared = 0;
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 256; k++)
            if (count[h][k] >= MIN_CONTEXT) index[h][k] = c++;
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 256; k++)
            if (count[h][k] < MIN_CONTEXT) {
                index[h][k] = c;
                shared |= count[h][k] > 0;
            }
    for (int64_t i = 0; i < n; i++) ctx[i] = (uint16_t)index[i >= half][ctx[i]];
    return c + shared;
}

static inline uint32_t zigzag_at(const void *original, const void *predicted, int64_t i, int32_t width) {
    if (width == 2) {
        uint16_t d = (uint16_t)(ord16(((const uint16_t *)original)[i]) - ord16(((const uint16_t *)predicted)[i]));
        return (uint16_t)((d << 1) ^ (uint16_t)(-(int16_t)(d >> 15)));
    }
    uint32_t d = ord32(((const uint32_t *)original)[i]) - ord32(((const uint32_t *)predicted)[i]);
    return (d << 1) ^ (uint32_t)(-(int32_t)(d >> 31));
}

/* The symbol of z; *bits gets the number of extra bits (z's low bits, below its two top ones). */
static inline uint32_t symbol_of(uint32_t z, int *bits) {
    if (z < LITERALS) {
        *bits = 0;
        return z;
    }
    int b = 32 - __builtin_clz(z);
    *bits = b - 2;
    return LITERALS + 2 * (uint32_t)(b - 5) + ((z >> (b - 2)) & 1);
}

/* Writes the body into out (cap bytes); returns its length, or E_WIDTH, E_MEMORY, E_CAPACITY. */
int64_t lynx_rans_encode(const void *original, const void *predicted, int64_t n, int32_t width, int32_t fp16,
                         uint8_t *out, int64_t cap) {
    if (width != 2 && width != 4) return E_WIDTH;
    if (n <= 0) return E_LENGTH;
    int a = alphabet(width);
    uint16_t *ctx = malloc((size_t)n * sizeof *ctx);
    uint8_t *sym = malloc((size_t)n);
    uint32_t *cnt = calloc((size_t)MAX_CONTEXTS * a, sizeof *cnt);
    uint8_t *stream = malloc((size_t)2 * n + 8);
    if (!ctx || !sym || !cnt || !stream) {
        free(ctx), free(sym), free(cnt), free(stream);
        return E_MEMORY;
    }
    int nctx = contexts(predicted, n, width, fp16, ctx);
    uint64_t extra_bits = 0;
    for (int64_t i = 0; i < n; i++) {
        int bits;
        sym[i] = (uint8_t)symbol_of(zigzag_at(original, predicted, i, width), &bits);
        extra_bits += (uint64_t)bits;
        cnt[(size_t)ctx[i] * a + sym[i]]++;
    }
    /* frequencies (cnt becomes them), cumulative starts, and the tables */
    uint32_t *cum = malloc((size_t)nctx * a * sizeof *cum);
    int64_t pos = 4, status = 0;
    if (!cum) status = E_MEMORY;
    for (int c = 0; c < nctx && !status; c++) {
        uint32_t *f = cnt + (size_t)c * a;
        uint64_t total = 0;
        int present = 0, best = 0, last = 0;
        for (int s = 0; s < a; s++) {
            total += f[s];
            if (f[s]) present++, last = s;
            if (f[s] > f[best]) best = s;
        }
        uint32_t sum = 0;
        for (int s = 0; s < a; s++) {
            if (f[s]) f[s] = (uint32_t)(((uint64_t)f[s] * (PROB_TOTAL - present)) / total) + 1;
            sum += f[s];
        }
        f[best] += PROB_TOTAL - sum;
        if (pos + 1 + 2 * (last + 1) > cap) {
            status = E_CAPACITY;
            break;
        }
        out[pos++] = (uint8_t)(last + 1);
        uint32_t run = 0;
        for (int s = 0; s <= last; s++) {
            cum[(size_t)c * a + s] = run;
            run += f[s];
            if (f[s] < 0x80) {
                out[pos++] = (uint8_t)f[s];
            } else {
                out[pos++] = (uint8_t)(0x80 | (f[s] & 0x7F));
                out[pos++] = (uint8_t)(f[s] >> 7);
            }
        }
    }
    if (!status) { /* rANS, last element first, bytes written backwards so that the decoder reads forwards */
        uint8_t *end = stream + 2 * n + 8, *ptr = end;
        uint32_t x = STATE_LOW;
        for (int64_t i = n - 1; i >= 0; i--) {
            size_t at = (size_t)ctx[i] * a + sym[i];
            uint32_t f = cnt[at];
            if ((uint64_t)x >= ((uint64_t)(STATE_LOW >> PROB_BITS) << 16) * f) { /* one 16-bit word at most */
                *--ptr = (uint8_t)(x >> 8);
                *--ptr = (uint8_t)x;
                x >>= 16;
            }
            x = ((x / f) << PROB_BITS) + (x % f) + cum[at];
        }
        ptr -= 4;
        ptr[0] = (uint8_t)x, ptr[1] = (uint8_t)(x >> 8), ptr[2] = (uint8_t)(x >> 16), ptr[3] = (uint8_t)(x >> 24);
        int64_t len = end - ptr, extra_len = (int64_t)((extra_bits + 7) / 8);
        if (pos + len + extra_len > cap) {
            status = E_CAPACITY;
        } else {
            out[0] = (uint8_t)len, out[1] = (uint8_t)(len >> 8), out[2] = (uint8_t)(len >> 16),
            out[3] = (uint8_t)(len >> 24);
            memcpy(out + pos, ptr, (size_t)len);
            pos += len;
            uint64_t acc = 0;
            int held = 0;
            for (int64_t i = 0; i < n; i++) {
                if (sym[i] < LITERALS) continue;
                int bits;
                uint32_t z = zigzag_at(original, predicted, i, width);
                symbol_of(z, &bits);
                acc |= (uint64_t)(z & ((1u << bits) - 1)) << held;
                held += bits;
                while (held >= 8) {
                    out[pos++] = (uint8_t)acc;
                    acc >>= 8;
                    held -= 8;
                }
            }
            if (held) out[pos++] = (uint8_t)acc;
        }
    }
    free(ctx), free(sym), free(cnt), free(stream), free(cum);
    return status ? status : pos;
}

/* The n original elements from a body of len bytes and the same n predicted elements; returns 0 or an error code
 * (E_LENGTH: stream_length; E_TABLE: a table; E_STREAM: the stream ends early; E_STATE: the final state or the
 * stream's length; E_EXTRA: the extra bits' length or padding). Nothing is read outside [body, body + len). */
int64_t lynx_rans_decode(const uint8_t *body, int64_t len, const void *predicted, int64_t n, int32_t width,
                         int32_t fp16, void *original) {
    if (width != 2 && width != 4) return E_WIDTH;
    if (n <= 0) return E_LENGTH;
    if (len < 4) return E_LENGTH;
    int a = alphabet(width);
    uint16_t *ctx = malloc((size_t)n * sizeof *ctx);
    uint8_t *slot_sym = malloc((size_t)MAX_CONTEXTS * PROB_TOTAL);
    uint32_t *freq = malloc((size_t)MAX_CONTEXTS * MAX_ALPHABET * 2 * sizeof *freq);
    if (!ctx || !slot_sym || !freq) {
        free(ctx), free(slot_sym), free(freq);
        return E_MEMORY;
    }
    uint32_t *cum = freq + (size_t)MAX_CONTEXTS * MAX_ALPHABET;
    int nctx = contexts(predicted, n, width, fp16, ctx);
    int64_t status = 0, pos = 4;
    uint64_t stream_len = (uint64_t)body[0] | (uint64_t)body[1] << 8 | (uint64_t)body[2] << 16 |
                          (uint64_t)body[3] << 24;
    for (int c = 0; c < nctx && !status; c++) {
        if (pos >= len) {
            status = E_TABLE;
            break;
        }
        int m = body[pos++];
        if (m < 1 || m > a) {
            status = E_TABLE;
            break;
        }
        uint32_t run = 0;
        for (int s = 0; s < a; s++) {
            uint32_t f = 0;
            if (s < m) {
                if (pos >= len) {
                    status = E_TABLE;
                    break;
                }
                f = body[pos++];
                if (f & 0x80) {
                    if (pos >= len || body[pos] == 0 || body[pos] >= 0x80) {
                        status = E_TABLE;
                        break;
                    }
                    f = (f & 0x7F) | (uint32_t)body[pos++] << 7;
                }
            }
            if (f > PROB_TOTAL - run) {
                status = E_TABLE;
                break;
            }
            freq[c * MAX_ALPHABET + s] = f;
            cum[c * MAX_ALPHABET + s] = run;
            memset(slot_sym + (size_t)c * PROB_TOTAL + run, s, f);
            run += f;
        }
        if (!status && run != PROB_TOTAL) status = E_TABLE;
    }
    if (!status && (stream_len < 4 || stream_len > (uint64_t)(len - pos))) status = E_LENGTH;
    if (!status) {
        const uint8_t *stream = body + pos, *extra = stream + stream_len;
        int64_t extra_len = len - pos - (int64_t)stream_len, sp = 4, ep = 0;
        uint32_t x = (uint32_t)stream[0] | (uint32_t)stream[1] << 8 | (uint32_t)stream[2] << 16 |
                     (uint32_t)stream[3] << 24;
        uint64_t acc = 0;
        int held = 0;
        for (int64_t i = 0; i < n && !status; i++) {
            int c = ctx[i];
            uint32_t slot = x & (PROB_TOTAL - 1);
            uint32_t s = slot_sym[(size_t)c * PROB_TOTAL + slot];
            x = freq[c * MAX_ALPHABET + s] * (x >> PROB_BITS) + slot - cum[c * MAX_ALPHABET + s];
            /* one 16-bit word at most (a valid stream never needs more), read without a data-dependent branch */
            uint32_t need = x < STATE_LOW;
            int64_t at = sp + 2 <= (int64_t)stream_len ? sp : 0;
            if (need && at != sp) {
                status = E_STREAM;
                break;
            }
            uint32_t word = (uint32_t)stream[at] | (uint32_t)stream[at + 1] << 8;
            x = need ? (x << 16) | word : x;
            sp += 2 * need;
            uint32_t z = s;
            if (s >= LITERALS) {
                int b = 5 + (int)((s - LITERALS) >> 1), bits = b - 2;
                while (held < bits) {
                    if (ep >= extra_len) {
                        status = E_EXTRA;
                        break;
                    }
                    acc |= (uint64_t)extra[ep++] << held;
                    held += 8;
                }
                if (status) break;
                z = ((2u | ((s - LITERALS) & 1)) << bits) | (uint32_t)(acc & ((1ull << bits) - 1));
                acc >>= bits;
                held -= bits;
            }
            if (width == 2) {
                uint16_t d = (uint16_t)((z >> 1) ^ (uint16_t)(-(int16_t)(z & 1)));
                ((uint16_t *)original)[i] = ord16((uint16_t)(ord16(((const uint16_t *)predicted)[i]) + d));
            } else {
                uint32_t d = (z >> 1) ^ (uint32_t)(-(int32_t)(z & 1));
                ((uint32_t *)original)[i] = ord32(ord32(((const uint32_t *)predicted)[i]) + d);
            }
        }
        if (!status && (x != STATE_LOW || sp != (int64_t)stream_len)) status = E_STATE;
        if (!status && (ep != extra_len || acc != 0)) status = E_EXTRA;
    }
    free(ctx), free(slot_sym), free(freq);
    return status;
}
