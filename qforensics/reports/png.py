"""A minimal PNG encoder for the report's figures: 8-bit RGB or RGBA pixels, one zlib stream.

The figures are drawn with Pillow (reports/raster.py), whose own PNG save first imports five
image-format plugins (about 60 ms, a tenth of a report). Pixels to PNG bytes is done here
instead: signature, IHDR, pHYs, IDAT, IEND (ISO/IEC 15948). Scanlines use filter type 0 (none),
which compresses plots of flat colours as well as Pillow's adaptive filters do. No torch
import.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

__all__ = ["encode_png"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_COLOR_TYPE = {3: 2, 4: 6}  # channels -> PNG colour type (truecolour, truecolour with alpha)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def encode_png(pixels: np.ndarray, *, dpi: float | None = None, level: int = 6) -> bytes:
    """PNG bytes of an (height, width, 3 or 4) uint8 array (RGB or RGBA, top row first)."""
    a = np.asarray(pixels)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] not in _COLOR_TYPE or 0 in a.shape:
        raise ValueError(f"expected a non-empty (H, W, 3|4) uint8 array, got {a.dtype} {a.shape}")
    h, w, c = a.shape
    rows = np.zeros((h, 1 + w * c), np.uint8)  # a leading 0 per scanline: filter type none
    rows[:, 1:] = a.reshape(h, w * c)
    parts = [_SIGNATURE, _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, _COLOR_TYPE[c], 0, 0, 0))]
    if dpi:
        ppm = round(dpi / 0.0254)  # pixels per metre
        parts.append(_chunk(b"pHYs", struct.pack(">IIB", ppm, ppm, 1)))
    parts += [_chunk(b"IDAT", zlib.compress(rows.tobytes(), level)), _chunk(b"IEND", b"")]
    return b"".join(parts)
