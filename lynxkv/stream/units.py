"""Link rates, durations and sizes: parsed the way people write them (``1Gbps``, ``500Mbps``, ``100MB/s``,
``2ms``) and formatted for people (``1.00 Gbit/s``, ``1.50 MiB``).

Rates come back in **bytes per second** (the unit every byte counter in lynxkv uses). Decimal prefixes, as
networking uses them: ``1Gbps`` = 1e9 bit/s = 125e6 B/s; ``MiB/s`` is binary (2**20 B/s). ``b``/``bit`` are bits,
``B`` is bytes; a bare ``bps`` suffix means bits.
"""

from __future__ import annotations

import re

from lynxkv.errors import InputError

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "g": 1e9, "G": 1e9, "t": 1e12, "T": 1e12}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]i?)?\s*(bps|bit/s|b/s|B/s|Bps|B)?\s*$")
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|µs|ms|s)?\s*$")
_TIME_UNIT = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}

# The largest values accepted: far beyond any real link, cache or wait, yet small enough that every time, sleep
# and byte count computed from them stays a finite number the platform can hold (``1e400Mbps`` is infinite,
# ``1e300s`` past every clock). The smallest rate is 1 bit/s: below it a single block would take longer to send
# than any wait can last.
MAX_BANDWIDTH = 1e15  # bytes/s: 8 Pbit/s
MIN_BANDWIDTH = 1.0 / 8.0  # bytes/s: 1 bit/s
MAX_DURATION = 1e9  # seconds: about 31.7 years
MAX_SIZE = 2**50  # bytes: 1 PiB


def _as_float(text, what: str) -> float:
    """A number given as a number (not text) as a float; an int too large for a float is an InputError."""
    try:
        return float(text)
    except OverflowError:
        raise InputError(f"{what}: a number of {len(str(abs(text)))} digits is too large") from None


def _refuse_nan(value: float, text, what: str) -> None:
    """NaN passes every comparison's ``not``: refused here, before the range checks (which catch infinities)."""
    if value != value:
        raise InputError(f"{what} {text!r}: not a number")


def parse_bandwidth(text: str | float | int | None) -> float | None:
    """``"1Gbps"`` -> 125e6 (bytes/s). Numbers pass through as bytes/s; ``None`` or ``""`` means unlimited."""
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)):
        value = _as_float(text, "bandwidth")
    else:
        m = _RATE.match(text)
        if not m:
            raise InputError(f"bandwidth {text!r}: expected a number with a unit such as 1Gbps, 500Mbps or 100MB/s")
        number, prefix, unit = float(m.group(1)), m.group(2) or "", m.group(3)
        if unit is None:
            raise InputError(f"bandwidth {text!r}: missing unit (bps for bits per second, B/s for bytes per second)")
        mult = _BINARY[prefix] if prefix.endswith("i") else _PREFIX[prefix]
        per_byte = 1.0 if unit in ("B/s", "Bps", "B") else 1.0 / 8.0
        value = number * mult * per_byte
    _refuse_nan(value, text, "bandwidth")
    if not value > 0:
        raise InputError(f"bandwidth {text!r}: must be positive")
    if value > MAX_BANDWIDTH:
        raise InputError(f"bandwidth {text!r}: too large (at most 8000Tbps, {MAX_BANDWIDTH:.0e} bytes/s)")
    if value < MIN_BANDWIDTH:
        raise InputError(f"bandwidth {text!r}: too small (at least 1bps, one bit per second)")
    return value


def parse_duration(text: str | float | int | None) -> float:
    """``"2ms"`` -> 0.002 (seconds); a bare number is seconds; ``None`` is 0."""
    if text is None or text == "":
        return 0.0
    if isinstance(text, (int, float)):
        value = _as_float(text, "duration")
    else:
        m = _TIME.match(text)
        if not m:
            raise InputError(f"duration {text!r}: expected a number with a unit such as 2ms, 150us or 0.5s")
        value = float(m.group(1)) * _TIME_UNIT[m.group(2)]
    _refuse_nan(value, text, "duration")
    if value < 0:
        raise InputError(f"duration {text!r}: must not be negative")
    if value > MAX_DURATION:
        raise InputError(f"duration {text!r}: too long (at most {MAX_DURATION:.0e} s, about 31 years)")
    return value


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]i?)?\s*(B)?\s*$")


def parse_size(text: str | int) -> int:
    """``"256KiB"`` -> 262144, ``"64MB"`` -> 64000000, ``"4096"`` -> 4096 (bytes)."""
    if isinstance(text, int):
        value = _as_float(text, "size")
    else:
        m = _SIZE.match(text)
        if not m:
            raise InputError(f"size {text!r}: expected a number of bytes, optionally with a unit such as 256KiB "
                             "or 64MB")
        prefix = m.group(2) or ""
        value = float(m.group(1)) * (_BINARY[prefix] if prefix.endswith("i") else _PREFIX[prefix])
    _refuse_nan(value, text, "size")
    if not value >= 1:  # 0.5 would round down to no bytes at all
        raise InputError(f"size {text!r}: must be at least 1 byte")
    if value > MAX_SIZE:
        raise InputError(f"size {text!r}: too large (at most 1024TiB, {MAX_SIZE} bytes)")
    return int(value)


def format_rate(bytes_per_s: float | None) -> str:
    """125e6 -> ``"1.00 Gbit/s"``: rates are shown in bits per second, as links are sold."""
    if bytes_per_s is None:
        return "unlimited"
    bits = bytes_per_s * 8
    for unit, div in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= div:
            return f"{bits / div:.2f} {unit}"
    return f"{bits:.0f} bit/s"


def format_bytes(n: float) -> str:
    """1536 -> ``"1.50 KiB"``: sizes at rest are shown in binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_seconds(x: float | None, unit: str = "s") -> str:
    """1.5 -> ``"1.500 s"`` (``unit="ms"``: ``"1500.0 ms"``); ``"-"`` for a time that never came."""
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if unit == "ms" else f"{x:.3f} s"
