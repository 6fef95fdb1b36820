"""Constants of the ``.lynx`` format 1.0, mirroring the tables of spec/FORMAT.md.

Sizes are written as sums of their fields so that each line reads like a row of the spec's table. Every
integer is little-endian. Nothing else in :mod:`lynxkv.format` should spell a byte count or a code directly.
"""

from __future__ import annotations

# -- identity -----------------------------------------------------------------------------------------------
ANCHOR_MAGIC = b"\x89LYNXA\r\n"  # PNG-style: a high byte and CR LF catch 7-bit and text-mode mangling
RESIDUAL_MAGIC = b"\x89LYNXR\r\n"
EXACT_MAGIC = b"\x89LYNXE\r\n"  # the exact remainder's section header
VERSION_MAJOR = 1
VERSION_MINOR = 0  # what every writer writes; a reader accepts any minor of major 1 (spec §8)

# -- anchor header: fixed part (spec table "Anchor header") --------------------------------------------------
ANCHOR_FIXED_STRUCT = (
    "<"
    "8s"  # 0   magic
    "H"  # 8   version_major
    "H"  # 10  version_minor
    "I"  # 12  flags
    "I"  # 16  header_length
    "I"  # 20  sink_tokens
    "I"  # 24  layers
    "I"  # 28  kv_heads
    "I"  # 32  head_dim
    "I"  # 36  tokens
    "B"  # 40  dtype
    "B"  # 41  compander
    "B"  # 42  centring
    "B"  # 43  meta_dtype
    "B"  # 44  anchor_bits
    "B"  # 45  residual_bits
    "B"  # 46  grid
    "B"  # 47  value_axis
    "I"  # 48  chunk
    "I"  # 52  page
    "d"  # 56  alpha (f64)
    "16s"  # 64  cache_id
    "I"  # 80  prompt_token_count
    "H"  # 84  segment_count
    "H"  # 86  fingerprint_length
    "I"  # 88  names_length
    "I"  # 92  properties_length (with FLAG_PROPERTIES; otherwise unused: writers write 0, readers ignore)
)
ANCHOR_FIXED_SIZE = 8 + 2 + 2 + 4 + 4 + 4 + 4 * 4 + 6 * 1 + 1 + 1 + 4 + 4 + 8 + 16 + 4 + 2 + 2 + 4 + 4  # 96

# Byte offsets of the fixed fields, for error messages ("`tokens` at byte 36").
ANCHOR_FIELD_OFFSETS = {
    "magic": 0,
    "version_major": 8,
    "version_minor": 10,
    "flags": 12,
    "header_length": 16,
    "sink_tokens": 20,
    "layers": 24,
    "kv_heads": 28,
    "head_dim": 32,
    "tokens": 36,
    "dtype": 40,
    "compander": 41,
    "centring": 42,
    "meta_dtype": 43,
    "anchor_bits": 44,
    "residual_bits": 45,
    "grid": 46,
    "value_axis": 47,
    "chunk": 48,
    "page": 52,
    "alpha": 56,
    "cache_id": 64,
    "prompt_token_count": 80,
    "segment_count": 84,
    "fingerprint_length": 86,
    "names_length": 88,
    "properties_length": 92,
}

# Segment table entry (spec table "Segment entry"); the location strings follow the table.
SEGMENT_STRUCT = (
    "<"
    "B"  # 0  kind
    "B"  # 1  placement (inline | external)
    "H"  # 2  location_length
    "I"  # 4  page_count
    "Q"  # 8  offset (inline: byte offset of the section in this file; external: 0)
    "Q"  # 16 length (bytes of the section)
    "I"  # 24 index_crc32 (CRC-32 of the section's page index)
    "I"  # 28 reserved (must be 0)
)
SEGMENT_SIZE = 1 + 1 + 2 + 4 + 8 + 8 + 4 + 4  # 32

# Header CRC: CRC-32 (zlib.crc32, ISO-HDLC polynomial) over bytes [0, header_length - 4).
CRC_SIZE = 4
HEADER_ALIGN = 8  # header_length is a multiple of this; the zero padding before the CRC is reserved

# -- residual header (spec table "Residual header") ----------------------------------------------------------
RESIDUAL_STRUCT = (
    "<"
    "8s"  # 0  magic
    "H"  # 8  version_major
    "H"  # 10 version_minor
    "I"  # 12 flags (must be 0 in v1)
    "I"  # 16 header_length
    "I"  # 20 reserved (must be 0)
    "16s"  # 24 cache_id
    "I"  # 40 layers
    "I"  # 44 kv_heads
    "I"  # 48 head_dim
    "I"  # 52 tokens
    "I"  # 56 page
    "B"  # 60 residual_bits
    "3s"  # 61 reserved (must be 0)
    "I"  # 64 index_crc32
    "I"  # 68 header_crc32
)
RESIDUAL_HEADER_SIZE = 8 + 2 + 2 + 4 + 4 + 4 + 16 + 5 * 4 + 1 + 3 + 4 + 4  # 72
RESIDUAL_FIELD_OFFSETS = {
    "magic": 0,
    "version_major": 8,
    "version_minor": 10,
    "flags": 12,
    "header_length": 16,
    "reserved0": 20,
    "cache_id": 24,
    "layers": 40,
    "kv_heads": 44,
    "head_dim": 48,
    "tokens": 52,
    "page": 56,
    "residual_bits": 60,
    "reserved1": 61,
    "index_crc32": 64,
    "header_crc32": 68,
}

# -- exact header (spec table "Exact header") ---------------------------------------------------------------
EXACT_STRUCT = (
    "<"
    "8s"  # 0  magic
    "H"  # 8  version_major
    "H"  # 10 version_minor
    "I"  # 12 flags (must be 0)
    "I"  # 16 header_length
    "I"  # 20 reserved (must be 0)
    "16s"  # 24 cache_id
    "I"  # 40 layers
    "I"  # 44 kv_heads
    "I"  # 48 head_dim
    "I"  # 52 tokens
    "I"  # 56 page
    "B"  # 60 dtype (the original dtype, as the anchor's)
    "B"  # 61 coding (1: ordered difference, zigzag, byte planes)
    "2s"  # 62 reserved (must be 0)
    "I"  # 64 index_crc32
    "I"  # 68 header_crc32
)
EXACT_HEADER_SIZE = 8 + 2 + 2 + 4 + 4 + 4 + 16 + 5 * 4 + 1 + 1 + 2 + 4 + 4  # 72
EXACT_FIELD_OFFSETS = {
    "magic": 0,
    "version_major": 8,
    "version_minor": 10,
    "flags": 12,
    "header_length": 16,
    "reserved0": 20,
    "cache_id": 24,
    "layers": 40,
    "kv_heads": 44,
    "head_dim": 48,
    "tokens": 52,
    "page": 56,
    "dtype": 60,
    "coding": 61,
    "reserved1": 62,
    "index_crc32": 64,
    "header_crc32": 68,
}
EXACT_CODING_PLANES = 1  # the ordered difference against the full code's decoding, zigzagged, in byte planes
EXACT_CODINGS = {EXACT_CODING_PLANES: "ordered difference, byte planes"}
KNOWN_EXACT_FLAGS = 0
EXACT_RECORD_CRC_SIZE = 4  # an exact record starts with the CRC-32 of the page's original bytes (K then V)
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}

# -- page index entry (spec table "Page index entry") --------------------------------------------------------
PAGE_ENTRY_STRUCT = (
    "<"
    "Q"  # 0  offset (from the start of the section)
    "I"  # 8  stored_length
    "I"  # 12 raw_length
    "B"  # 16 codec
    "3s"  # 17 reserved (must be 0)
    "I"  # 20 crc32 of the stored bytes
)
PAGE_ENTRY_SIZE = 8 + 4 + 4 + 1 + 3 + 4  # 24

# -- flags ---------------------------------------------------------------------------------------------------
FLAG_BATCH_DIM = 1 << 0  # the input tensors had a leading batch dimension of 1
FLAG_PROPERTIES = 1 << 1  # the header ends with a properties string of properties_length bytes
FLAG_KEY_ROTATION = 1 << 2  # the keys are rotated along head_dim before quantization (spec §9)
FLAG_EXTREMES = 1 << 3  # scheme extremes = range, the full code's end sub-bins decode at o ∓ s (spec §9.3)
KNOWN_ANCHOR_FLAGS = FLAG_BATCH_DIM | FLAG_PROPERTIES | FLAG_KEY_ROTATION | FLAG_EXTREMES
KNOWN_RESIDUAL_FLAGS = 0

# -- enumerations --------------------------------------------------------------------------------------------
DTYPE_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}
COMPANDER_CODES = {"linear": 0, "alpha": 1}
CENTRING_CODES = {"midrange": 0, "mean": 1}
META_DTYPE_CODES = {"fp16": 0, "fp32": 1}
GRID_CODES = {"nested": 0, "uniform": 1}
VALUE_AXIS_CODES = {"token": 0, "channel": 1}

SEGMENT_ANCHOR = 1
SEGMENT_RESIDUAL = 2
SEGMENT_EXACT = 3
SEGMENT_KINDS = {SEGMENT_ANCHOR: "anchor", SEGMENT_RESIDUAL: "residual", SEGMENT_EXACT: "exact"}
PLACEMENT_INLINE = 0
PLACEMENT_EXTERNAL = 1

CODEC_NONE = 0
CODEC_ZSTD = 1
CODEC_ZSTD_FRAMES = 2  # exact pages only: Zstandard frames one after another, the record their contents joined
CODEC_NAMES = {CODEC_NONE: "none", CODEC_ZSTD: "zstd", CODEC_ZSTD_FRAMES: "zstd-frames"}

# -- caps: checked before anything a header claims is allocated ---------------------------------------------
MAX_LAYERS = 4096
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_TOKENS = 1 << 22  # 4 Mi tokens
MAX_PROMPT_TOKENS = MAX_TOKENS
MAX_SEGMENTS = 8
MAX_FINGERPRINT = 64
MAX_NAMES_LENGTH = 1 << 20
MAX_PROPERTIES_LENGTH = 1 << 16
MAX_LOCATION = 4096
MAX_PAGE_ENTRIES = 1 << 20  # per segment
MAX_PAGE_RAW = 1 << 30  # bytes of one decoded page record
MAX_ANCHOR_HEADER = (
    ANCHOR_FIXED_SIZE
    + MAX_SEGMENTS * (SEGMENT_SIZE + MAX_LOCATION)
    + 4 * MAX_PROMPT_TOKENS
    + MAX_FINGERPRINT
    + MAX_NAMES_LENGTH
    + MAX_PROPERTIES_LENGTH
    + HEADER_ALIGN
    + CRC_SIZE
)
FINGERPRINT_HEX_LENGTH = 32

# Default residual file name: the anchor path with this suffix in place of ``.lynx``.
RESIDUAL_SUFFIX = ".lynxr"
EXACT_SUFFIX = ".lynxe"  # and the exact remainder's
