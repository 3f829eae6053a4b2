"""Hostile image files, made on the fly (struct, zlib, numpy, OpenCV): nothing is checked in.

Used by tests/test_hostile_images.py and tools/bench_hostile.py. Each maker returns the
file's bytes; the kinds are those of issue 17 ("limits before work").
"""
from __future__ import annotations

import struct
import zlib

import cv2
import numpy as np

SIX_BYTE_JPEG = bytes.fromhex("FFD8FFFFFFFF")  # SOI and fill bytes: no frame, no length


def encode(ext: str, img: np.ndarray, *params: int) -> bytes:
    ok, buf = cv2.imencode(ext, img, list(params))
    assert ok, ext
    return buf.tobytes()


def marked_bgr(h: int = 48, w: int = 80) -> np.ndarray:
    """Grey with a red block in the stored top-left and a green one in the top-right."""
    bgr = np.full((h, w, 3), 128, np.uint8)
    bgr[:16, :16] = (0, 0, 255)
    bgr[:16, -16:] = (0, 255, 0)
    return bgr


def tiff_with_repeated_size(big: int = 12000, small: int = 16, deflated_strip: bool = False) -> bytes:
    """A grey 8-bit TIFF whose IFD lists ImageWidth/ImageLength twice: big x big, then
    small x small. libtiff takes the first pair; a reader keeping the last sees 16x16.
    `deflated_strip`: the strip is big*big zero bytes, deflated (~140 KB for 12000): the
    bomb a decoder fills 144 MB from. Otherwise the strip is 2 KB and decoding fails."""
    strip = zlib.compress(bytes(big * big), 9) if deflated_strip else bytes(2000)
    compression = 8 if deflated_strip else 1  # Adobe deflate, or none
    entries = [(256, 4, big), (257, 4, big), (258, 3, 8), (259, 3, compression), (262, 3, 1),
               (273, 4, 0), (277, 3, 1), (278, 4, big), (279, 4, len(strip)),
               (256, 4, small), (257, 4, small)]
    strip_offset = 8 + 2 + 12 * len(entries) + 4
    ifd = struct.pack("<H", len(entries))
    for tag, kind, value in entries:
        value = strip_offset if tag == 273 else value
        inline = struct.pack("<I", value) if kind == 4 else struct.pack("<HH", value, 0)  # LONG, SHORT
        ifd += struct.pack("<HHI", tag, kind, 1) + inline
    return b"II*\x00" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0) + strip


def progressive_jpeg(h: int = 64, w: int = 64, repeats: int = 0, flat: bool = False) -> bytes:
    """A progressive JPEG (libjpeg: 10 scans) whose last scan is repeated `repeats` more
    times: each repeat is a few bytes (flat image) but one more pass over every block."""
    img = np.full((h, w, 3), 128, np.uint8) if flat else marked_bgr(h, w)
    img[::50] = 30
    data = encode(".jpg", img, cv2.IMWRITE_JPEG_PROGRESSIVE, 1)
    last, end = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
    return data[:end] + data[last:end] * repeats + data[end:]


def jpeg_with_comment_run(count: int = 4 * 1024 * 1024) -> bytes:
    """A small valid JPEG with `count` empty COM segments after SOI (4 bytes each: 16 MiB
    by default)."""
    data = encode(".jpg", marked_bgr())
    return data[:2] + b"\xff\xfe\x00\x02" * count + data[2:]


def png_with_bad_crc() -> bytes:
    """A PNG with one IDAT byte changed: libpng prints its own error line, then fails."""
    data = bytearray(encode(".png", np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    data[data.find(b"IDAT") + 10] ^= 0xFF
    return bytes(data)


def slow_corrupt_png(side: int = 6000) -> bytes:
    """A side x side PNG (36 MP at 6000: under the default 40 MP limit) whose last
    compressed bytes are broken: libpng inflates nearly all of it before failing, so it
    is refused only after the whole decode time."""
    rng = np.random.default_rng(1)
    img = np.repeat(rng.integers(0, 256, (side, side // 8, 1), dtype=np.uint8), 8, axis=1)
    data = bytearray(encode(".png", img, cv2.IMWRITE_PNG_COMPRESSION, 1))
    last_idat = data.rfind(b"IDAT")
    length = struct.unpack_from(">I", data, last_idat - 4)[0]
    data[last_idat + 4 + length - 8:last_idat + 4 + length] = b"\x00" * 8  # the zlib stream's end
    return bytes(data)


def exif_tiff(orientation: int) -> bytes:
    """The TIFF structure EXIF is: IFD0 holding only Orientation (SHORT)."""
    return (b"II" + struct.pack("<HI", 42, 8) + struct.pack("<H", 1)
            + struct.pack("<HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack("<I", 0))


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_with_exif(orientation: int, bgr: np.ndarray | None = None) -> bytes:
    """A PNG with an eXIf chunk (right after IHDR) giving `orientation`."""
    data = encode(".png", marked_bgr() if bgr is None else bgr)
    after_ihdr = 8 + 8 + 13 + 4
    return data[:after_ihdr] + png_chunk(b"eXIf", exif_tiff(orientation)) + data[after_ihdr:]


def riff_chunk(kind: bytes, payload: bytes) -> bytes:
    return kind + struct.pack("<I", len(payload)) + payload + b"\x00" * (len(payload) & 1)


def webp_with_exif(orientation: int, bgr: np.ndarray | None = None) -> bytes:
    """An extended WebP (VP8X with the EXIF flag, the lossless image, an EXIF chunk)."""
    bgr = marked_bgr() if bgr is None else bgr
    simple = encode(".webp", bgr, cv2.IMWRITE_WEBP_QUALITY, 101)  # lossless: one VP8L chunk
    image_chunk = simple[12:]
    h, w = bgr.shape[:2]
    vp8x = bytes([0x08, 0, 0, 0]) + (w - 1).to_bytes(3, "little") + (h - 1).to_bytes(3, "little")
    body = b"WEBP" + riff_chunk(b"VP8X", vp8x) + image_chunk + riff_chunk(b"EXIF", exif_tiff(orientation))
    return b"RIFF" + struct.pack("<I", len(body)) + body
