"""The anchor header's properties string: text key/value pairs <-> a JSON object, keys sorted, UTF-8."""

from __future__ import annotations

import json

from lynxkv.errors import InputError
from lynxkv.format import constants as c
from lynxkv.format.layout import field_error as _err


def pack_properties(properties) -> bytes:
    """The properties string: a JSON object of text keys and text values, keys sorted, no spaces, UTF-8."""
    if not properties:
        return b""
    pairs = dict(properties)
    if any(not _is_text(k) or not _is_text(v) or not k for k, v in pairs.items()):
        raise InputError("properties: expected non-empty text keys with text values (valid Unicode)")
    data = json.dumps(pairs, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(data) > c.MAX_PROPERTIES_LENGTH:
        raise InputError(f"properties: {len(data)} bytes, at most {c.MAX_PROPERTIES_LENGTH}")
    return data


def parse_properties(data: bytes, where: str) -> tuple[tuple[str, str], ...]:
    """The properties string back as sorted (key, value) pairs; anything else is a ``properties`` error."""
    try:  # a nesting too deep for the parser is a RecursionError; a repeated key would silently lose a value
        pairs = json.loads(data.decode("utf-8"), object_pairs_hook=_Pairs)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _err("properties", where, "a JSON object in UTF-8", repr(data[:64])) from None
    if not isinstance(pairs, _Pairs) or any(not _is_text(k) or not k or not _is_text(v) for k, v in pairs):
        raise _err("properties", where, "an object of non-empty text keys with text values", repr(data[:64]))
    if len({k for k, _ in pairs}) != len(pairs):
        raise _err("properties", where, "an object whose keys are all different", repr(data[:64]))
    return tuple(sorted(pairs))


class _Pairs(list):
    """A JSON object as its (key, value) pairs in file order, repeated keys kept."""


def _is_text(value) -> bool:
    """A str that is valid Unicode: JSON's ``\\ud800`` escape gives a lone surrogate that UTF-8 cannot encode."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
