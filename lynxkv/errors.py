"""The one error type lynxkv raises for bad input, corrupt files and unusable configurations.

Library code raises :class:`LynxError` (or a subclass) for anything a user can cause; the CLI turns it into one
clear line on stderr and a non-zero exit. ``assert`` is never used to guard user input.
"""

from __future__ import annotations


class LynxError(Exception):
    """Base class of every error lynxkv raises on purpose."""


class FormatError(LynxError):
    """A ``.lynx`` file is malformed, truncated or fails a checksum.

    ``field`` names the structure or field that was wrong, ``where`` says where (a byte offset, or
    ``segment/layer/page``), so a message reads like
    "``page_count`` at byte 24: expected <= 65536, got 4294967295".
    """

    def __init__(self, message: str, *, field: str | None = None, where: str | None = None):
        super().__init__(message)
        self.field = field
        self.where = where


class ChecksumError(FormatError):
    """Stored bytes do not match their checksum (a corrupted header, index or page)."""


class SchemeError(LynxError):
    """A quantization scheme parameter is out of range or inconsistent."""


class InputError(LynxError):
    """An input tensor file, model or prompt cannot be used."""


class ResidualUnavailable(LynxError):
    """The residual could not be loaded (it failed, or did not arrive in time): only the lossy anchor is there."""


class TransientError(LynxError):
    """A storage or network failure that may go away when retried (connection reset, timeout, 5xx)."""
