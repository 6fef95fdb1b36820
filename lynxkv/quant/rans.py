"""The exact remainder entropy-coded (format 1.5, coding 2): static rANS per page, a table per context.

For element ``i`` of a page (K then V row-major, ``N`` elements) ``z`` is the zigzagged ordered difference of
:mod:`lynxkv.quant.remainder` (no reordering). ``z`` becomes a **symbol**: ``z`` itself below 16, otherwise
``16 + 2·(b − 5) + (the bit of z below its top bit)`` with ``b`` the bit length of ``z``, and the ``b − 2`` bits
under those two go raw into the **extra bits** (LSB first). The symbols are coded by static rANS (32-bit
state, renormalised by 16-bit words below ``2^16``, 10-bit frequencies) with one frequency table per **context**:
the pair (half: K or V, exponent field of the prediction) where that pair holds at least 256 elements of the
page, one shared context for the rest; element ``i`` uses the state ``i % 4`` of four interleaved ones, each with
its own stream (four independent chains for the decoder). Near the prediction ``z`` is a few units in the last
place, and how many depends on the value's exponent and on the tensor: a table per context codes each group at
its own entropy.

The body after the record's CRC: ``stream_length`` (u32 × 4) | the tables (``symbols`` u8, then that many
frequencies, LEB128, summing to 1024) | the rANS streams 0-3 (each its state's final value, then 16-bit words) |
the extra bits. spec/FORMAT.md §12.6 is normative. Two paths give the same bytes: ``lynxkv/quant/_rans.c`` (ctypes,
the GIL released) and the Python below (``LYNXKV_NATIVE=0``; a loop per element, for tests and small caches).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from lynxkv.compiled import load_extension
from lynxkv.errors import FormatError, InputError

PROB_BITS = 10
PROB_TOTAL = 1 << PROB_BITS
STATE_LOW = 1 << 16
LITERALS = 16  # a power of two: z below it is its own symbol (the format fixes 16; the benchmark tries others)
MIN_CONTEXT = 256  # a (half, key) pair with fewer elements in the page is coded in the shared context
HALF_KEYS = 256
STATES = 4  # interleaved rANS states: element i uses state i % 4 and its stream

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
#: ``lynxkv/quant/_rans.c`` (built into the ``_remainder`` extension), or None: the Python path runs.
_LIB = load_extension("lynxkv.quant._remainder", {
    "lynx_rans_encode": ([_p, _p, _i64, _i32, _i32, _p, _i64], _i64),
    "lynx_rans_decode": ([_p, _i64, _p, _i64, _i32, _i32, _p], _i64),
})
#: the compiled decoder's error codes: (field, what is wrong)
_ERRORS = {
    -10: ("exact.stream_length", "the streams run past the record, or one is under 4 bytes (its state)"),
    -11: ("exact.tables", "a frequency table is truncated, has a symbol count outside [1, alphabet], a "
                          "non-minimal or too large frequency, or frequencies that do not sum to 1024"),
    -12: ("exact.stream", "a rANS stream ends before its last element"),
    -13: ("exact.stream", "a rANS stream does not end in the initial state with every byte read"),
    -14: ("exact.extra_bits", "the extra bits are not exactly as long as the symbols need, or their padding is "
                              "not zero"),
}
_VIEWS = {torch.bfloat16: (torch.int16, 2, 7, 0xFF), torch.float16: (torch.int16, 2, 10, 0x1F),
          torch.float32: (torch.int32, 4, 23, 0xFF)}


def alphabet(width: int) -> int:
    """Symbols of an element ``width`` bytes wide: 40 for bf16/fp16, 72 for fp32."""
    return LITERALS + 2 * (8 * width + 1 - LITERALS.bit_length())


def body_capacity(n: int, width: int) -> int:
    """A bound on the body's length for ``n`` elements: tables, at most 2 bytes of stream per element, extra bits."""
    contexts = 2 * HALF_KEYS + 1
    return 4 * STATES + contexts * (1 + 2 * alphabet(width)) + STATES * (2 * (n // STATES + 1) + 4) + \
        (n * (8 * width - 2) + 7) // 8 + 8


def _view(predicted: torch.Tensor):
    if predicted.dtype not in _VIEWS:
        raise InputError(f"exact remainder: dtype {predicted.dtype} is not one of bf16, fp16, fp32")
    return _VIEWS[predicted.dtype]


def encode_body(original: torch.Tensor, predicted: torch.Tensor) -> bytes:
    """The coding-2 body of a page: ``original`` and ``predicted`` flattened, same dtype and length (K then V)."""
    if original.dtype != predicted.dtype or original.numel() != predicted.numel():
        raise InputError(f"exact remainder: original {original.dtype} ({original.numel()}) and prediction "
                         f"{predicted.dtype} ({predicted.numel()}) differ")
    _, width, _, _ = _view(predicted)
    x, p = original.contiguous().reshape(-1), predicted.contiguous().reshape(-1)
    n = x.numel()
    if n == 0:
        raise InputError("exact remainder: a page has at least one element")
    if _LIB is not None and x.device.type == "cpu" and p.device.type == "cpu":
        out = np.empty(body_capacity(n, width), dtype=np.uint8)
        got = _LIB.lynx_rans_encode(x.data_ptr(), p.data_ptr(), n, width, int(p.dtype == torch.float16),
                                    out.ctypes.data, out.size)
        if got == -2:
            raise MemoryError("exact remainder: the scratch memory could not be allocated")
        if got < 0:  # pragma: no cover - the capacity is a bound and the widths are checked above
            raise InputError(f"exact remainder: the compiled coder refused the page ({got})")
        return out[:got].tobytes()
    return reference_encode(x, p)


def decode_body(body, predicted: torch.Tensor, where: str) -> torch.Tensor:
    """The original values (flattened, ``predicted``'s dtype) from a coding-2 body and the page's prediction."""
    _, width, _, _ = _view(predicted)
    p = predicted.contiguous().reshape(-1)
    n = p.numel()
    if _LIB is not None and p.device.type == "cpu":
        buf = np.frombuffer(body, dtype=np.uint8)
        out = torch.empty_like(p)
        status = _LIB.lynx_rans_decode(buf.ctypes.data, buf.size, p.data_ptr(), n, width,
                                       int(p.dtype == torch.float16), out.data_ptr())
        if status == -2:
            raise MemoryError("exact remainder: the scratch memory could not be allocated")
        if status:
            field, what = _ERRORS.get(status, ("exact", f"refused ({status})"))
            raise FormatError(f"`{field}` {where}: {what}", field=field, where=where)
        return out
    return reference_decode(bytes(body), p, where)


# ---------------------------------------------------------------------------------------------------------------
# the Python path: the same bytes, one loop iteration per element
# ---------------------------------------------------------------------------------------------------------------
def _zigzag(x: torch.Tensor, p: torch.Tensor) -> np.ndarray:
    view, width, _, _ = _VIEWS[p.dtype]
    w = 8 * width
    full = (1 << w) - 1
    o = x.view(view).to(torch.int64)
    q = p.view(view).to(torch.int64)
    mask = (1 << (w - 1)) - 1
    d = ((o ^ ((o >> (w - 1)) & mask)) - (q ^ ((q >> (w - 1)) & mask))) & full
    d = torch.where(d >= (1 << (w - 1)), d - (1 << w), d)
    return (((d << 1) ^ (d >> (w - 1))) & full).numpy().astype(np.uint64)


def _contexts(p: torch.Tensor) -> tuple[np.ndarray, int]:
    view, _, shift, mask = _VIEWS[p.dtype]
    key = ((p.view(view).to(torch.int64) >> shift) & mask).numpy()
    n = key.size
    half = (np.arange(n) >= n // 2).astype(np.int64)
    pair = half * HALF_KEYS + key
    count = np.bincount(pair, minlength=2 * HALF_KEYS)
    big = count >= MIN_CONTEXT
    index = np.full(2 * HALF_KEYS, int(big.sum()), dtype=np.int64)
    index[big] = np.arange(int(big.sum()))
    shared = bool(((count > 0) & ~big).any())
    return index[pair], int(big.sum()) + shared


def _symbols(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(symbol, number of extra bits) of each z."""
    b = np.zeros(z.shape, dtype=np.int64)
    nz = z > 0
    b[nz] = np.floor(np.log2(z[nz].astype(np.float64))).astype(np.int64) + 1
    big = z >= LITERALS
    bits = np.where(big, b - 2, 0)
    second = (z >> np.maximum(bits, 0).astype(np.uint64)) & np.uint64(1)
    sym = np.where(big, LITERALS + 2 * (b - LITERALS.bit_length()) + second.astype(np.int64), z.astype(np.int64))
    return sym, bits


def frequencies(counts: list[int]) -> list[int]:
    """The table of one context from its symbol counts: ``floor(c·(1024 − k)/n) + 1`` for each of the ``k``
    symbols present (``n`` elements), the rest of 1024 to the most frequent symbol (the first of equals)."""
    total, present = sum(counts), sum(1 for c in counts if c)
    f = [c * (PROB_TOTAL - present) // total + 1 if c else 0 for c in counts]
    best = max(range(len(counts)), key=lambda s: (counts[s], -s))
    f[best] += PROB_TOTAL - sum(f)
    return f


def reference_encode(x: torch.Tensor, p: torch.Tensor) -> bytes:
    """:func:`encode_body` in Python."""
    _, width, _, _ = _view(p)
    a = alphabet(width)
    z = _zigzag(x, p)
    sym, bits = _symbols(z)
    ctx, nctx = _contexts(p)
    counts = np.bincount(ctx * a + sym, minlength=nctx * a).reshape(nctx, a)
    tables, freq, cum = bytearray(), [], []
    for row in counts.tolist():
        f = frequencies(row)
        m = max(s for s in range(a) if row[s]) + 1
        tables.append(m)
        for v in f[:m]:
            tables += bytes([v]) if v < 0x80 else bytes([0x80 | (v & 0x7F), v >> 7])
        freq.append(f)
        cum.append([sum(f[:s]) for s in range(a)])
    outs = [bytearray() for _ in range(STATES)]  # emitted bytes of each stream, reversed at the end
    states = [STATE_LOW] * STATES
    n = len(sym)
    for i, c, s in zip(range(n - 1, -1, -1), reversed(ctx.tolist()), reversed(sym.tolist())):
        f, state = freq[c][s], states[i % STATES]
        if state >= ((STATE_LOW >> PROB_BITS) << 16) * f:  # one 16-bit word at most
            outs[i % STATES] += (state & 0xFFFF).to_bytes(2, "big")  # reversed below: little-endian
            state >>= 16
        states[i % STATES] = (state // f << PROB_BITS) + state % f + cum[c][s]
    streams = [bytes(reversed(out + state.to_bytes(4, "big"))) for out, state in zip(outs, states)]
    has = bits > 0
    values, widths = (z[has] & ((np.uint64(1) << bits[has].astype(np.uint64)) - np.uint64(1))), bits[has]
    total = int(widths.sum())
    packed = bytearray()
    if total:
        offsets = np.concatenate(([0], np.cumsum(widths)[:-1]))
        flat = np.zeros(total, dtype=np.uint8)
        for j in range(int(widths.max())):
            sel = widths > j
            flat[offsets[sel] + j] = ((values[sel] >> np.uint64(j)) & np.uint64(1)).astype(np.uint8)
        packed = np.packbits(flat, bitorder="little").tobytes()
    lengths = b"".join(len(s).to_bytes(4, "little") for s in streams)
    return lengths + bytes(tables) + b"".join(streams) + bytes(packed)


def reference_decode(body: bytes, p: torch.Tensor, where: str) -> torch.Tensor:
    """:func:`decode_body` in Python."""
    view, width, _, _ = _view(p)
    w = 8 * width
    a = alphabet(width)
    ctx, nctx = _contexts(p)

    def fail(code: int):
        field, what = _ERRORS[code]
        return FormatError(f"`{field}` {where}: {what}", field=field, where=where)

    if len(body) < 4 * STATES:
        raise fail(-10)
    lengths = [int.from_bytes(body[4 * j:4 * j + 4], "little") for j in range(STATES)]
    if min(lengths) < 4:
        raise fail(-10)
    pos, freq, cum, lookup = 4 * STATES, [], [], []
    for _ in range(nctx):
        if pos >= len(body) or not 1 <= body[pos] <= a:
            raise fail(-11)
        m = body[pos]
        pos += 1
        f = []
        for _ in range(m):
            if pos >= len(body):
                raise fail(-11)
            v = body[pos]
            pos += 1
            if v & 0x80:
                if pos >= len(body) or not 0 < body[pos] < 0x80:
                    raise fail(-11)
                v = (v & 0x7F) | body[pos] << 7
                pos += 1
            f.append(v)
        f += [0] * (a - m)
        starts = [sum(f[:s]) for s in range(a)]
        if any(v > PROB_TOTAL for v in starts) or sum(f) != PROB_TOTAL:
            raise fail(-11)
        freq.append(f)
        cum.append(starts)
        lookup.append(np.repeat(np.arange(a), f).tolist())
    if sum(lengths) > len(body) - pos:
        raise fail(-10)
    streams = []
    for length in lengths:
        streams.append(body[pos:pos + length])
        pos += length
    extra = body[pos:]
    states = [int.from_bytes(s[:4], "little") for s in streams]
    sps, ep, acc, held = [4] * STATES, 0, 0, 0
    z = []
    for i, c in enumerate(ctx.tolist()):
        state, stream, sp = states[i % STATES], streams[i % STATES], sps[i % STATES]
        slot = state & (PROB_TOTAL - 1)
        s = lookup[c][slot]
        state = freq[c][s] * (state >> PROB_BITS) + slot - cum[c][s]
        if state < STATE_LOW:
            if sp + 2 > len(stream):
                raise fail(-12)
            state = (state << 16) | stream[sp] | stream[sp + 1] << 8
            sps[i % STATES] = sp + 2
        states[i % STATES] = state
        if s < LITERALS:
            z.append(s)
            continue
        bits = LITERALS.bit_length() - 2 + ((s - LITERALS) >> 1)
        while held < bits:
            if ep >= len(extra):
                raise fail(-14)
            acc |= extra[ep] << held
            ep += 1
            held += 8
        z.append(((2 | ((s - LITERALS) & 1)) << bits) | (acc & ((1 << bits) - 1)))
        acc >>= bits
        held -= bits
    if states != [STATE_LOW] * STATES or sps != lengths:
        raise fail(-13)
    if ep != len(extra) or acc:
        raise fail(-14)
    zt = torch.tensor(z, dtype=torch.int64)
    d = (zt >> 1) ^ -(zt & 1)
    q = p.view(view).to(torch.int64)
    mask, full = (1 << (w - 1)) - 1, (1 << w) - 1
    o = ((q ^ ((q >> (w - 1)) & mask)) + d) & full
    o = torch.where(o >= (1 << (w - 1)), o - (1 << w), o)
    return (o ^ ((o >> (w - 1)) & mask)).to(view).view(p.dtype)
