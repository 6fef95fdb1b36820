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

/* The number of contexts and the first slot (context × 1024) of each (half, key) pair: pairs with >= MIN_CONTEXT
 * elements in the order half 0 keys ascending, half 1 keys ascending, then the shared context if any element
 * falls into it. */
static int context_rows(const void *predicted, int64_t n, int32_t width, int32_t fp16, uint32_t row_of[2 * 256]) {
    int64_t count[2][256];
    int64_t half = n / 2;
    count_keys(predicted, 0, half, width, fp16, count[0]);
    count_keys(predicted, half, n, width, fp16, count[1]);
    int c = 0, shared = 0;
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 256; k++)
            if (count[h][k] >= MIN_CONTEXT) row_of[h * 256 + k] = (uint32_t)c++ * PROB_TOTAL;
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 256; k++)
            if (count[h][k] < MIN_CONTEXT) {
                row_of[h * 256 + k] = (uint32_t)c * PROB_TOTAL;
                shared |= count[h][k] > 0;
            }
    return c + shared;
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

/* One half of the page (elements [from, to), pair offset off): the symbol and pair of each element into code[i]
 * (pair << 7 | symbol), the counts of (pair, symbol) into hist (four interleaved histograms of span entries),
 * and the extra bits appended to xb (acc / held / at carry over between the calls), without a branch. */
#define FIRST_PASS(T, ORD, W, A)                                                                                   \
    static void first_pass_##W(const T *x, const T *p, int64_t from, int64_t to, uint32_t off, int fp16,          \
                               size_t span, uint16_t *code, uint32_t *hist, uint8_t *xb, int64_t *at,             \
                               uint64_t *acc_io, int *held_io) {                                                  \
        uint64_t acc = *acc_io;                                                                                    \
        int held = *held_io, sh = W == 16 ? (fp16 ? 10 : 7) : 23;                                                  \
        uint32_t km = W == 16 && fp16 ? 0x1F : 0xFF;                                                               \
        int64_t pos = *at;                                                                                         \
        uint32_t *h[4] = {hist, hist + span, hist + 2 * span, hist + 3 * span};                                    \
        for (int64_t i = from; i < to; i++) {                                                                      \
            T d = (T)(ORD(x[i]) - ORD(p[i]));                                                                      \
            uint32_t z = (uint32_t)(T)((T)(d << 1) ^ (T)(-(T)(d >> (W - 1))));                                     \
            uint32_t pair = ((p[i] >> sh) & km) + off;                                                             \
            int b = 32 - __builtin_clz(z | 1), big = z >= LITERALS;                                                \
            int bits = big ? b - 2 : 0;                                                                            \
            uint32_t sym = big ? LITERALS + 2 * (uint32_t)(b - 5) + ((z >> bits) & 1) : z;                         \
            code[i] = (uint16_t)(pair << 7 | sym);                                                                 \
            h[i & 3][pair * A + sym]++;                                                                            \
            acc |= (uint64_t)(z & ((1u << bits) - 1u)) << held;                                                    \
            held += bits;                                                                                          \
            int full = held >= 32; /* stored always, kept when full (xb has room for it) */                       \
            put32(xb + pos, (uint32_t)acc);                                                                        \
            pos += 4 * full, acc >>= 32 * full, held -= 32 * full;                                                 \
        }                                                                                                          \
        *acc_io = acc, *held_io = held, *at = pos;                                                                 \
    }
FIRST_PASS(uint16_t, ord16, 16, (LITERALS + 2 * (16 - 4)))
FIRST_PASS(uint32_t, ord32, 32, (LITERALS + 2 * (32 - 4)))
#undef FIRST_PASS

/* The encoder's view of a (context, symbol): renormalise while the state is at least xmax; the quotient by the
 * frequency f is the high half of state × rcp plus add (exact for every state below 2^32 and f <= 1024:
 * rcp = floor(2^64 / f) + 1, and for f = 1, rcp = 2^64 - 1 and add = 1); the next state is
 * state + cum + quotient × (1024 - f), i.e. (quotient << 10) + remainder + cum. */
typedef struct {
    uint64_t xmax, rcp;
    uint32_t cum, cmpl, add;
} enc_sym;

#define PAIRS 512 /* (half, exponent key) */

/* Writes the body into out (cap bytes); returns its length, or E_WIDTH, E_MEMORY, E_CAPACITY. */
int64_t lynx_rans_encode(const void *original, const void *predicted, int64_t n, int32_t width, int32_t fp16,
                         uint8_t *out, int64_t cap) {
    if (width != 2 && width != 4) return E_WIDTH;
    if (n <= 0) return E_LENGTH;
    int a = alphabet(width);
    size_t span = (size_t)PAIRS * a;
    uint16_t *code = malloc((size_t)n * sizeof *code);
    uint32_t *hist = calloc(4 * span, sizeof *hist); /* four interleaved (pair, symbol) histograms */
    uint32_t *cnt = calloc((size_t)MAX_CONTEXTS * a, sizeof *cnt); /* per context: counts, then frequencies */
    enc_sym *tab = malloc((size_t)MAX_CONTEXTS * a * sizeof *tab);
    int64_t xb_room = (n * (8 * width - 2) + 7) / 8 + 8;
    uint8_t *xb = malloc((size_t)xb_room);
    int64_t room = 2 * (n / STATES + 1) + 4; /* one stream: its state and a word per element at most */
    uint8_t *stream = malloc((size_t)room * STATES);
    int64_t pos = 4 * STATES, status = 0, xlen = 0;
    if (!code || !hist || !cnt || !tab || !xb || !stream) status = E_MEMORY;
    uint32_t pairbase[PAIRS];
    int nctx = 0;
    if (!status) {
        uint64_t acc = 0;
        int held = 0;
        int64_t half = n / 2;
        if (width == 2) {
            first_pass_16(original, predicted, 0, half, 0, fp16, span, code, hist, xb, &xlen, &acc, &held);
            first_pass_16(original, predicted, half, n, 256, fp16, span, code, hist, xb, &xlen, &acc, &held);
        } else {
            first_pass_32(original, predicted, 0, half, 0, fp16, span, code, hist, xb, &xlen, &acc, &held);
            first_pass_32(original, predicted, half, n, 256, fp16, span, code, hist, xb, &xlen, &acc, &held);
        }
        for (; held > 0; held -= 8, acc >>= 8) xb[xlen++] = (uint8_t)acc;
        /* the contexts: pairs with >= MIN_CONTEXT elements in order (half 0 keys ascending, then half 1), then
         * the shared one if any element falls into it */
        uint64_t count[PAIRS];
        for (size_t k = 0; k < span; k++) hist[k] += hist[k + span] + hist[k + 2 * span] + hist[k + 3 * span];
        for (int q = 0; q < PAIRS; q++) {
            count[q] = 0;
            for (int s = 0; s < a; s++) count[q] += hist[(size_t)q * a + s];
            if (count[q] >= MIN_CONTEXT) pairbase[q] = (uint32_t)(nctx++);
        }
        int shared = 0;
        for (int q = 0; q < PAIRS; q++)
            if (count[q] < MIN_CONTEXT) pairbase[q] = (uint32_t)nctx, shared |= count[q] > 0;
        for (int q = 0; q < PAIRS; q++) {
            uint32_t *row = cnt + (size_t)pairbase[q] * a;
            if (count[q])
                for (int s = 0; s < a; s++) row[s] += hist[(size_t)q * a + s];
            pairbase[q] *= (uint32_t)a;
        }
        nctx += shared;
    }
    /* frequencies (cnt becomes them), the encoder's tables, and the tables written */
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
            enc_sym *e = tab + (size_t)c * a + s;
            e->xmax = ((uint64_t)(STATE_LOW >> PROB_BITS) << 16) * f[s];
            e->rcp = f[s] > 1 ? UINT64_MAX / f[s] + 1 : UINT64_MAX; /* floor(2^64 / f) + 1 (f > 1: 2^64 % f != 0
                                                                      unless f is a power of two, exact either
                                                                      way for the quotients below) */
            e->add = f[s] <= 1;
            e->cum = run;
            e->cmpl = PROB_TOTAL - f[s];
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
        /* One element I with state X and stream pointer P: one 16-bit word at most (written always, kept when
         * needed: the buffer has room for it), then the state's step. */
#define ENC(I, X, P)                                                                                               \
    do {                                                                                                           \
        uint32_t k = code[I];                                                                                      \
        const enc_sym *e = tab + pairbase[k >> 7] + (k & 127);                                                     \
        uint64_t x = (X);                                                                                          \
        uint64_t emit = x >= e->xmax;                                                                              \
        (P)[-1] = (uint8_t)(x >> 8);                                                                               \
        (P)[-2] = (uint8_t)x;                                                                                      \
        (P) -= 2 * emit;                                                                                           \
        x >>= 16 * emit;                                                                                           \
        uint64_t q = (uint64_t)(((unsigned __int128)x * e->rcp) >> 64) + e->add;                                   \
        (X) = (uint32_t)(x + e->cum + q * e->cmpl);                                                                \
    } while (0)
        int64_t blocks = n & ~(int64_t)(STATES - 1);
        for (int64_t i = n - 1; i >= blocks; i--) ENC(i, state[i & 3], ptr[i & 3]);
        uint32_t x0 = state[0], x1 = state[1], x2 = state[2], x3 = state[3];
        uint8_t *p0 = ptr[0], *p1 = ptr[1], *p2 = ptr[2], *p3 = ptr[3];
        for (int64_t i = blocks - STATES; i >= 0; i -= STATES) {
            ENC(i + 3, x3, p3);
            ENC(i + 2, x2, p2);
            ENC(i + 1, x1, p1);
            ENC(i, x0, p0);
        }
#undef ENC
        state[0] = x0, state[1] = x1, state[2] = x2, state[3] = x3;
        ptr[0] = p0, ptr[1] = p1, ptr[2] = p2, ptr[3] = p3;
        int64_t len = 0;
        for (int j = 0; j < STATES; j++) { /* each stream starts with its final state */
            ptr[j] -= 4;
            put32(ptr[j], state[j]);
            len += end[j] - ptr[j];
        }
        if (pos + len + xlen + 8 > cap) {
            status = E_CAPACITY;
        } else {
            for (int j = 0; j < STATES; j++) {
                put32(out + 4 * j, (uint32_t)(end[j] - ptr[j]));
                memcpy(out + pos, ptr[j], (size_t)(end[j] - ptr[j]));
                pos += end[j] - ptr[j];
            }
            memcpy(out + pos, xb, (size_t)xlen);
            pos += xlen;
        }
    }
    free(code), free(hist), free(cnt), free(tab), free(xb), free(stream);
    return status ? status : pos;
}

/* The 16-bit words a stream has left from position sp, its last word at lw (none once sp is past it). */
static inline int64_t words_left(int64_t sp, int64_t lw) { return sp <= lw ? (lw - sp) / 2 + 1 : 0; }

static inline int64_t least(int64_t a, int64_t b) { return a < b ? a : b; }

/* The n original elements from a body of len bytes and the same n predicted elements; returns 0 or an error code
 * (E_LENGTH: stream_length; E_TABLE: a table; E_STREAM: the stream ends early; E_STATE: the final state or the
 * stream's length; E_EXTRA: the extra bits' length or padding). Nothing is read outside [body, body + len). */
int64_t lynx_rans_decode(const uint8_t *body, int64_t len, const void *predicted, int64_t n, int32_t width,
                         int32_t fp16, void *original) {
    if (width != 2 && width != 4) return E_WIDTH;
    if (n <= 0) return E_LENGTH;
    int a = alphabet(width);
    uint32_t row_of[2 * 256]; /* (half, key) -> its context's first slot */
    int nctx = context_rows(predicted, n, width, fp16, row_of); /* from the prediction: at most 2·256 + 1 */
    /* per context and slot: symbol (bits 0-6), slot minus the symbol's start (7-18), frequency (19-31) */
    uint32_t *slots = malloc((size_t)nctx * PROB_TOTAL * sizeof *slots);
    if (!slots) return E_MEMORY;
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
        uint32_t e = slots[row_of[KEY(I)] + ((X) & (PROB_TOTAL - 1))], s = e & 0x7F;                                \
        uint32_t y = (e >> 19) * ((X) >> PROB_BITS) + ((e >> 7) & (PROB_TOTAL - 1)), need = y < STATE_LOW;        \
        int64_t at = SP;                                                                                           \
        if (CHECKED) {                                                                                             \
            bad |= need & ((SP) > (LW));                                                                           \
            at = (SP) <= (LW) ? (SP) : 0;                                                                          \
        }                                                                                                          \
        uint32_t word = (uint32_t)(ST)[at] | (uint32_t)(ST)[at + 1] << 8;                                          \
        (X) = (y << (need << 4)) | (word & (0u - need)); /* arithmetic: a branch here is taken at random */      \
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
        REBUILD(OUT, I, base[s] | (uint32_t)(acc & ((1ull << bits) - 1)));                                        \
        acc >>= bits, held -= bits, consumed += (uint64_t)bits;                                                    \
    } while (0)
#define BLOCKS(OUT)                                                                                                \
    do {                                                                                                           \
        while (i + STATES <= n) {                                                                                  \
            /* blocks that every stream has a word for (a block takes one element, so one word at most, from      \
             * each): unchecked; then one checked block */                                                         \
            int64_t safe = least(least(words_left(sp0, lw0), words_left(sp1, lw1)),                                \
                                 least(words_left(sp2, lw2), words_left(sp3, lw3)));                               \
            safe = least(safe, (n - i) / STATES);                                                                  \
            if (safe > 0) {                                                                                        \
                for (int64_t end = i + safe * STATES; i < end; i += STATES) {                                      \
                    STEP(i, x0, st0, sp0, lw0, OUT, 0);                                                            \
                    STEP(i + 1, x1, st1, sp1, lw1, OUT, 0);                                                        \
                    STEP(i + 2, x2, st2, sp2, lw2, OUT, 0);                                                        \
                    STEP(i + 3, x3, st3, sp3, lw3, OUT, 0);                                                        \
                }                                                                                                  \
            } else {                                                                                               \
                STEP(i, x0, st0, sp0, lw0, OUT, 1);                                                                \
                STEP(i + 1, x1, st1, sp1, lw1, OUT, 1);                                                            \
                STEP(i + 2, x2, st2, sp2, lw2, OUT, 1);                                                            \
                STEP(i + 3, x3, st3, sp3, lw3, OUT, 1);                                                            \
                i += STATES;                                                                                       \
            }                                                                                                      \
        }                                                                                                          \
        if (i < n) STEP(i, x0, st0, sp0, lw0, OUT, 1);                                                             \
        if (i + 1 < n) STEP(i + 1, x1, st1, sp1, lw1, OUT, 1);                                                     \
        if (i + 2 < n) STEP(i + 2, x2, st2, sp2, lw2, OUT, 1);                                                     \
    } while (0)
        int64_t i = 0, half = n / 2;
        /* the (half, key) of element I (SH, KM: the prediction's exponent field, constants in each loop below); z
         * of each element into OUT first */
#define KEY(I) (((uint32_t)p[I] >> SH & KM) | (uint32_t)((I) >= half) << 8)
        if (width == 2) {
            uint16_t *out = original;
            const uint16_t *p = predicted;
#define REBUILD(OUT, I, Z) ((OUT)[I] = (uint16_t)(Z))
            if (fp16) {
#define SH 10
#define KM 0x1Fu
                BLOCKS(out);
#undef SH
#undef KM
            } else {
#define SH 7
#define KM 0xFFu
                BLOCKS(out);
#undef SH
#undef KM
            }
#undef REBUILD
            for (i = 0; i < n; i++) { /* then every element rebuilt in one pass (which vectorises) */
                uint16_t z = out[i], d = (uint16_t)((z >> 1) ^ (uint16_t)(-(int16_t)(z & 1)));
                out[i] = ord16((uint16_t)(ord16(p[i]) + d));
            }
        } else {
            uint32_t *out = original;
            const uint32_t *p = predicted;
#define REBUILD(OUT, I, Z) ((OUT)[I] = (Z))
#define SH 23
#define KM 0xFFu
            BLOCKS(out);
#undef SH
#undef KM
#undef REBUILD
            for (i = 0; i < n; i++) {
                uint32_t z = out[i], d = (z >> 1) ^ (uint32_t)(-(int32_t)(z & 1));
                out[i] = ord32(ord32(p[i]) + d);
            }
        }
#undef KEY
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
    free(slots);
    return status;
}
