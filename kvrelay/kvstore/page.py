"""Page format: a fixed 256-byte header (magic, version, key, fingerprint, dtype, shape, token
count, payload checksum, header checksum) followed by the payload
`[num_layers, 2, page_size, kv_heads, head_dim]`. Arena slots, disk files and transfers all carry
exactly these bytes, so a page never needs re-encoding between tiers.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from kvrelay.kvstore.errors import IncompatiblePageError, PageFormatError

MAGIC = b"KVRP"
FORMAT_VERSION = 1
HEADER_BYTES = 256
_FMT = struct.Struct("<4sHH16s64s8s6IQII")  # ... num_tokens, payload_bytes, checksum, header_crc
_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1, "int8": 1}


try:  # ISA-L's CRC-32 is the same function as zlib's (same values), ~10x faster (PCLMUL)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - optional speed-up
    _crc32 = zlib.crc32


def checksum(payload) -> int:
    """CRC-32 of the payload (zlib's CRC-32; ISA-L's implementation when `isal` is installed)."""
    return _crc32(payload)


@dataclass(frozen=True, slots=True)
class PageSpec:
    """What every page of one model looks like."""

    fingerprint: str
    dtype: str
    num_layers: int
    page_size: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_SIZES:
            raise PageFormatError(f"unsupported dtype {self.dtype!r}; one of {list(_DTYPE_SIZES)}")
        if len(self.fingerprint.encode()) > 64 or not self.fingerprint:
            raise PageFormatError("model fingerprint must be 1..64 ASCII characters")
        if min(self.num_layers, self.page_size, self.kv_heads, self.head_dim) <= 0:
            raise PageFormatError(f"page shape must be positive, got {self.shape}")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.page_size, self.kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        n = _DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    @property
    def slot_bytes(self) -> int:
        return HEADER_BYTES + self.page_bytes


@dataclass(frozen=True, slots=True)
class PageHeader:
    """A decoded page header."""

    key: bytes
    fingerprint: str
    dtype: str
    shape: tuple[int, ...]
    num_tokens: int
    payload_bytes: int
    checksum: int


def pack_header(
    spec: PageSpec, key: bytes, payload_checksum: int, num_tokens: int | None = None
) -> bytes:
    """The 256-byte header of a page of `spec` with key `key`."""
    if len(key) != 16:
        raise PageFormatError(f"page keys are 16 bytes, got {len(key)}")
    fields = (
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        key,
        spec.fingerprint.encode(),
        spec.dtype.encode(),
        *spec.shape,
        spec.page_size if num_tokens is None else num_tokens,
        spec.page_bytes,
        payload_checksum,
    )
    body = _FMT.pack(*fields, 0)[:-4]
    return (body + struct.pack("<I", zlib.crc32(body))).ljust(HEADER_BYTES, b"\0")


def unpack_header(buf) -> PageHeader:
    """Decode and check a header (magic, version, header checksum); raise PageFormatError."""
    if len(buf) < HEADER_BYTES:
        raise PageFormatError(f"page truncated: {len(buf)} bytes, header needs {HEADER_BYTES}")
    raw = bytes(buf[: _FMT.size])
    magic, version, hsize, key, fp, dtype, *rest = _FMT.unpack(raw)
    if magic != MAGIC:
        raise PageFormatError(f"not a kvrelay page (magic {magic!r})")
    if version != FORMAT_VERSION or hsize != HEADER_BYTES:
        raise PageFormatError(f"unsupported page format version {version}")
    if zlib.crc32(raw[:-4]) != rest[-1]:
        raise PageFormatError("page header checksum mismatch")
    shape = tuple(rest[:5])
    num_tokens, payload_bytes, crc = rest[5], rest[6], rest[7]
    return PageHeader(
        key,
        fp.rstrip(b"\0").decode(),
        dtype.rstrip(b"\0").decode(),
        shape,
        num_tokens,
        payload_bytes,
        crc,
    )


def check_header(
    buf, key: bytes | None = None, page_bytes: int | None = None, fingerprint: str | None = None
) -> PageHeader:
    """Check a page's header against what the caller expects; raise PageFormatError."""
    header = unpack_header(buf)
    if key is not None and header.key != key:
        raise PageFormatError(f"page holds key {header.key.hex()}, expected {key.hex()}")
    if page_bytes is not None and header.payload_bytes != page_bytes:
        raise IncompatiblePageError(
            f"page payload is {header.payload_bytes} bytes, this store holds "
            f"{page_bytes}-byte pages"
        )
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise IncompatiblePageError(
            f"page is for model fingerprint {header.fingerprint!r}, expected {fingerprint!r}"
        )
    if len(buf) < HEADER_BYTES + header.payload_bytes:
        raise PageFormatError(
            f"page truncated: {len(buf)} bytes, expected {HEADER_BYTES + header.payload_bytes}"
        )
    return header


def verify_page(
    buf, key: bytes | None = None, page_bytes: int | None = None, fingerprint: str | None = None
) -> PageHeader:
    """Check a whole page (header + payload CRC) and return its header; raise PageFormatError."""
    header = check_header(buf, key, page_bytes, fingerprint)
    payload = memoryview(buf)[HEADER_BYTES : HEADER_BYTES + header.payload_bytes]
    if checksum(payload) != header.checksum:
        raise PageFormatError(f"page {header.key.hex()} payload checksum mismatch")
    return header
