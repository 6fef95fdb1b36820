/* Exact records of coding 2 (format 1.5, spec/FORMAT.md §12.6), compiled: the same bytes as the Python reference
 * (lynxkv/quant/rans.py), which documents the coding. Loaded with ctypes beside _remainder.c.
 *
 * For element i of a page (K then V, row-major, N elements): z = zigzag(o(original) - o(predicted)) as in
 * _remainder.c; z becomes a symbol (z < 16: z itself; else 16 + 2·(b-5) + the bit below the top one, b = the bit
 * length of z, and the b-2 low bits go raw to the extra bits), coded by static rANS (32-bit states, L = 2^16,
 * 16-bit words out, 10-bit frequencies) with a frequency table per context: the (half, exponent key) of the
 * prediction where that pair has at least 256 elements in the page, the shared context otherwise. Element i uses
 * the state i % 4 of four interleaved states, each with its own stream.
 *
 * Body (after the record's original_crc32): stream_length u32 × 4 | tables | rANS streams 0-3 | extra bits (LSB
 * first). A stream is its state's final value (u32) and then 16-bit words, all little-endian.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PROB_BITS 10
#define PROB_TOTAL (1u << PROB_BITS)
#define STATE_LOW (1u << 16)
#define LITERALS 16
#define MIN_CONTEXT 256
#define MAX_CONTEXTS (2 * 256 + 1)
#define MAX_ALPHABET (LITERALS + 2 * (32 - 4))
#define STATES 4 /* interleaved rANS states: element i uses state and stream i % 4 (four independent chains) */

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

/* The keys of elements [from, to) counted into count[256] (four interleaved histograms: no store-to-load chain). */
static void count_keys(const void *predicted, int64_t from, int64_t to, int32_t width, int32_t fp16,
                       int64_t count[256]) {
    int64_t c[4][256];
    memset(c, 0, sizeof c);
    int64_t i = from;
    for (; i + 4 <= to; i += 4)
        for (int u = 0; u < 4; u++) c[u][key_of(predicted, i + u, width, fp16)]++;
    for (; i < to; i++) c[0][key_of(predicted, i, width, fp16)]++;
    for (int k = 0; k < 256; k++) count[k] = c[0][k] + c[1][k] + c[2][k] + c[3][k];
}

/* ctx[i] for every element and the number of contexts: (half, key) pairs with >= MIN_CONTEXT elements in the
 * order half 0 keys ascending, half 1 keys ascending, then the shared context if any element falls into it. */
static int contexts(const void *predicted, int64_t n, int32_t width, int32_t fp16, uint16_t *ctx) {
    int64_t count[2][256];
    uint16_t index[2][256];
    int64_t half = n / 2;
    count_keys(predicted, 0, half, width, fp16, count[0]);
    count_keys(predicted, half, n, width, fp16, count[1]);
    int c = 0, shared = 0;
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 256; k++)
            if (count[h][k] >= MIN_CONTEXT) index[h][k] = (uint16_t)c++;
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 256; k++)
            if (count[h][k] < MIN_CONTEXT) {
                index[h][k] = (uint16_t)c;
                shared |= count[h][k] > 0;
            }
    for (int64_t i = 0; i < half; i++) ctx[i] = index[0][key_of(predicted, i, width, fp16)];
    for (int64_t i = half; i < n; i++) ctx[i] = index[1][key_of(predicted, i, width, fp16)];
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

/* The symbols' raw bits and their base values: z = base[s] | (next extra[s] bits). */
static void symbol_tables(int a, uint32_t *base, int *extra) {
    for (int s = 0; s < a; s++) {
        if (s < LITERALS) {
            base[s] = (uint32_t)s, extra[s] = 0;
        } else {
            int b = 5 + ((s - LITERALS) >> 1);
            extra[s] = b - 2;
            base[s] = (2u | ((s - LITERALS) & 1)) << (b - 2);
        }
    }
}

static inline void put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}

static inline uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Writes the body into out (cap bytes); returns its length, or E_WIDTH, E_MEMORY, E_CAPACITY. */
int64_t lynx_rans_encode(const void *original, const void *predicted, int64_t n, int32_t width, int32_t fp16,
                         uint8_t *out, int64_t cap) {
    if (width != 2 && width != 4) return E_WIDTH;
    if (n <= 0) return E_LENGTH;
    int a = alphabet(width);
    uint16_t *ctx = malloc((size_t)n * sizeof *ctx);
    uint8_t *sym = malloc((size_t)n);
    uint32_t *zs = malloc((size_t)n * sizeof *zs);
    uint32_t *cnt = NULL; /* four interleaved histograms per context (no store-to-load chain), then their sum */
    uint32_t *cum = malloc((size_t)MAX_CONTEXTS * a * sizeof *cum);
    double *inv = malloc((size_t)MAX_CONTEXTS * a * sizeof *inv);
    int64_t room = 2 * (n / STATES + 1) + 4; /* one stream: its state and a word per element at most */
    uint8_t *stream = malloc((size_t)room * STATES);
    int64_t pos = 4 * STATES, status = 0;
    if (!ctx || !sym || !zs || !cum || !inv || !stream) status = E_MEMORY;
    int nctx = status ? 0 : contexts(predicted, n, width, fp16, ctx);
    size_t span = (size_t)nctx * a;
    if (!status && !(cnt = calloc(4 * span, sizeof *cnt))) status = E_MEMORY;
    uint32_t base[MAX_ALPHABET];
    int extra[MAX_ALPHABET];
    symbol_tables(a, base, extra);
    uint64_t extra_bits = 0;
    for (int64_t i = 0; i < n && !status; i++) {
        int bits;
        zs[i] = zigzag_at(original, predicted, i, width);
        sym[i] = (uint8_t)symbol_of(zs[i], &bits);
        extra_bits += (uint64_t)bits;
        cnt[(size_t)(i & 3) * span + (size_t)ctx[i] * a + sym[i]]++;
    }
    for (size_t k = 0; k < span && !status; k++) cnt[k] += cnt[k + span] + cnt[k + 2 * span] + cnt[k + 3 * span];
    /* frequencies (cnt becomes them), cumulative starts, and the tables */
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
        for (int s = 0; s < a; s++) {
            cum[(size_t)c * a + s] = run;
            inv[(size_t)c * a + s] = f[s] ? 1.0 / f[s] : 0.0;
            run += f[s];
            if (s > last) continue;
            if (f[s] < 0x80) {
                out[pos++] = (uint8_t)f[s];
            } else {
                out[pos++] = (uint8_t)(0x80 | (f[s] & 0x7F));
                out[pos++] = (uint8_t)(f[s] >> 7);
            }
        }
    }
    if (!status) { /* rANS, last element first, bytes written backwards so that the decoder reads forwards */
        uint8_t *end[STATES], *ptr[STATES];
        uint32_t state[STATES];
        for (int j = 0; j < STATES; j++) state[j] = STATE_LOW, end[j] = ptr[j] = stream + room * (j + 1);
        for (int64_t i = n - 1; i >= 0; i--) {
            size_t at = (size_t)ctx[i] * a + sym[i];
            int j = (int)(i % STATES);
            uint32_t x = state[j];
            uint32_t f = cnt[at];
            /* one 16-bit word at most; written always, kept when needed (the buffer has room for it) */
            uint32_t emit = (uint64_t)x >= ((uint64_t)(STATE_LOW >> PROB_BITS) << 16) * f;
            ptr[j][-1] = (uint8_t)(x >> 8);
            ptr[j][-2] = (uint8_t)x;
            ptr[j] -= 2 * emit;
            x >>= 16 * emit;
            /* x / f through the reciprocal, corrected to the exact quotient (x < 2^32: off by one at most) */
            int64_t q = (int64_t)((double)x * inv[at]), r = (int64_t)x - q * (int64_t)f;
            int64_t under = r < 0;
            q -= under, r += under * (int64_t)f;
            int64_t over = r >= (int64_t)f;
            q += over, r -= over * (int64_t)f;
            state[j] = ((uint32_t)q << PROB_BITS) + (uint32_t)r + cum[at];
        }
        int64_t len = 0, extra_len = (int64_t)((extra_bits + 7) / 8);
        for (int j = 0; j < STATES; j++) { /* each stream starts with its final state */
            ptr[j] -= 4;
            put32(ptr[j], state[j]);
            len += end[j] - ptr[j];
        }
        if (pos + len + extra_len + 8 > cap) {
            status = E_CAPACITY;
        } else {
            for (int j = 0; j < STATES; j++) {
                put32(out + 4 * j, (uint32_t)(end[j] - ptr[j]));
                memcpy(out + pos, ptr[j], (size_t)(end[j] - ptr[j]));
                pos += end[j] - ptr[j];
            }
            uint64_t acc = 0;
            int held = 0;
            for (int64_t i = 0; i < n; i++) { /* the extra bits, 32 at a time */
                int bits = extra[sym[i]];
                acc |= (uint64_t)(zs[i] & ((1u << bits) - 1u)) << held;
                held += bits;
                if (held >= 32) {
                    put32(out + pos, (uint32_t)acc);
                    pos += 4;
                    acc >>= 32;
                    held -= 32;
                }
            }
            for (; held > 0; held -= 8, acc >>= 8) out[pos++] = (uint8_t)acc;
        }
    }
    free(ctx), free(sym), free(zs), free(cnt), free(cum), free(inv), free(stream);
    return status ? status : pos;
}

/* The n original elements from a body of len bytes and the same n predicted elements; returns 0 or an error code
 * (E_LENGTH: stream_length; E_TABLE: a table; E_STREAM: the stream ends early; E_STATE: the final state or the
 * stream's length; E_EXTRA: the extra bits' length or padding). Nothing is read outside [body, body + len). */
int64_t lynx_rans_decode(const uint8_t *body, int64_t len, const void *predicted, int64_t n, int32_t width,
                         int32_t fp16, void *original) {
    if (width != 2 && width != 4) return E_WIDTH;
    if (n <= 0) return E_LENGTH;
    int a = alphabet(width);
    uint16_t *ctx = malloc((size_t)n * sizeof *ctx);
    if (!ctx) return E_MEMORY;
    int nctx = contexts(predicted, n, width, fp16, ctx); /* from the prediction: at most 2·256 + 1 */
    /* per context and slot: symbol (bits 0-6), slot minus the symbol's start (7-18), frequency (19-31) */
    uint32_t *slots = malloc((size_t)nctx * PROB_TOTAL * sizeof *slots);
    if (!slots) {
        free(ctx);
        return E_MEMORY;
    }
    int64_t status = 0, pos = 4 * STATES;
    uint64_t stream_len[STATES], streams = 0;
    if (len < 4 * STATES) status = E_LENGTH;
    for (int j = 0; j < STATES && !status; j++) {
        stream_len[j] = get32(body + 4 * j);
        if (stream_len[j] < 4) status = E_LENGTH;
        streams += stream_len[j];
    }
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
            uint32_t *row = slots + (size_t)c * PROB_TOTAL;
            for (uint32_t k = 0; k < f; k++) row[run + k] = (uint32_t)s | k << 7 | f << 19;
            run += f;
        }
        if (!status && run != PROB_TOTAL) status = E_TABLE;
    }
    if (!status && streams > (uint64_t)(len - pos)) status = E_LENGTH;
    if (!status) {
        const uint8_t *stream[STATES], *extra = body + pos + streams;
        int64_t extra_len = len - pos - (int64_t)streams, sp[STATES], last_word[STATES], ep = 0;
        uint32_t state[STATES], base[MAX_ALPHABET], bad = 0;
        for (int j = 0; j < STATES; j++) {
            stream[j] = j ? stream[j - 1] + stream_len[j - 1] : body + pos;
            state[j] = get32(stream[j]);
            sp[j] = 4, last_word[j] = (int64_t)stream_len[j] - 2;
        }
        int bits_of[MAX_ALPHABET];
        symbol_tables(a, base, bits_of);
        uint64_t acc = 0, consumed = 0;
        int held = 0;
        uint32_t x0 = state[0], x1 = state[1], x2 = state[2], x3 = state[3];
        int64_t sp0 = 4, sp1 = 4, sp2 = 4, sp3 = 4;
        const uint8_t *st0 = stream[0], *st1 = stream[1], *st2 = stream[2], *st3 = stream[3];
        int64_t lw0 = last_word[0], lw1 = last_word[1], lw2 = last_word[2], lw3 = last_word[3];
        /* One element with state X, stream ST (SP its position, LW its last word), z written to OUT[I]. The
         * state's step and one 16-bit word at most (a valid stream never needs more) without a data-dependent
         * branch. CHECKED: past the stream's end the word is read from its start and the stream is refused after
         * the loop; unchecked steps run only in blocks where every stream has a word left (each stream gives one
         * element of a block). The extra bits refill 32 at a time (zeros past the end; an over-read is refused
         * after the loop). */
#define STEP(I, X, ST, SP, LW, OUT, CHECKED)                                                                       \
    do {                                                                                                           \
        uint32_t e = slots[(size_t)ctx[I] * PROB_TOTAL + ((X) & (PROB_TOTAL - 1))], s = e & 0x7F;                  \
        uint32_t y = (e >> 19) * ((X) >> PROB_BITS) + ((e >> 7) & (PROB_TOTAL - 1)), need = y < STATE_LOW;        \
        int64_t at = SP;                                                                                           \
        if (CHECKED) {                                                                                             \
            bad |= need & ((SP) > (LW));                                                                           \
            at = (SP) <= (LW) ? (SP) : 0;                                                                          \
        }                                                                                                          \
        uint32_t word = (uint32_t)(ST)[at] | (uint32_t)(ST)[at + 1] << 8;                                          \
        (X) = need ? (y << 16) | word : y;                                                                         \
        (SP) += 2 * need;                                                                                          \
        if (held < 32) {                                                                                           \
            if (ep + 4 <= extra_len) {                                                                             \
                acc |= (uint64_t)get32(extra + ep) << held;                                                        \
                ep += 4, held += 32;                                                                               \
            } else {                                                                                               \
                while (ep < extra_len && held < 56) acc |= (uint64_t)extra[ep++] << held, held += 8;               \
                if (held < 32) held = 32;                                                                          \
            }                                                                                                      \
        }                                                                                                          \
        int bits = bits_of[s];                                                                                     \
        (OUT)[I] = base[s] | (uint32_t)(acc & ((1ull << bits) - 1));                                               \
        acc >>= bits, held -= bits, consumed += (uint64_t)bits;                                                    \
    } while (0)
#define BLOCKS(OUT)                                                                                                \
    do {                                                                                                           \
        for (; i + STATES <= n; i += STATES) {                                                                     \
            if ((sp0 <= lw0) & (sp1 <= lw1) & (sp2 <= lw2) & (sp3 <= lw3)) {                                       \
                STEP(i, x0, st0, sp0, lw0, OUT, 0);                                                                \
                STEP(i + 1, x1, st1, sp1, lw1, OUT, 0);                                                            \
                STEP(i + 2, x2, st2, sp2, lw2, OUT, 0);                                                            \
                STEP(i + 3, x3, st3, sp3, lw3, OUT, 0);                                                            \
            } else {                                                                                               \
                STEP(i, x0, st0, sp0, lw0, OUT, 1);                                                                \
                STEP(i + 1, x1, st1, sp1, lw1, OUT, 1);                                                            \
                STEP(i + 2, x2, st2, sp2, lw2, OUT, 1);                                                            \
                STEP(i + 3, x3, st3, sp3, lw3, OUT, 1);                                                            \
            }                                                                                                      \
        }                                                                                                          \
        if (i < n) STEP(i, x0, st0, sp0, lw0, OUT, 1);                                                             \
        if (i + 1 < n) STEP(i + 1, x1, st1, sp1, lw1, OUT, 1);                                                     \
        if (i + 2 < n) STEP(i + 2, x2, st2, sp2, lw2, OUT, 1);                                                     \
    } while (0)
        int64_t i = 0;
        /* z into the output first, then every element rebuilt in one pass (which vectorises) */
        if (width == 2) {
            uint16_t *out = original;
            const uint16_t *p = predicted;
            BLOCKS(out);
            for (i = 0; i < n; i++) {
                uint16_t z = out[i], d = (uint16_t)((z >> 1) ^ (uint16_t)(-(int16_t)(z & 1)));
                out[i] = ord16((uint16_t)(ord16(p[i]) + d));
            }
        } else {
            uint32_t *out = original;
            const uint32_t *p = predicted;
            BLOCKS(out);
            for (i = 0; i < n; i++) {
                uint32_t z = out[i], d = (z >> 1) ^ (uint32_t)(-(int32_t)(z & 1));
                out[i] = ord32(ord32(p[i]) + d);
            }
        }
#undef BLOCKS
#undef STEP
        state[0] = x0, state[1] = x1, state[2] = x2, state[3] = x3;
        sp[0] = sp0, sp[1] = sp1, sp[2] = sp2, sp[3] = sp3;
        if (bad) status = E_STREAM;
        for (int j = 0; j < STATES && !status; j++)
            if (state[j] != STATE_LOW || sp[j] != (int64_t)stream_len[j]) status = E_STATE;
        /* exactly the bytes the extra bits need, their padding zero */
        if (!status && (consumed + 7) / 8 != (uint64_t)extra_len) status = E_EXTRA;
        if (!status && consumed % 8 && extra[extra_len - 1] >> (consumed % 8)) status = E_EXTRA;
    }
    free(ctx), free(slots);
    return status;
}
