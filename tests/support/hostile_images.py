"""Hostile image files, made on the fly (struct, zlib, numpy, OpenCV): nothing is checked in.

Used by tests/test_hostile_images.py and bench/bench_hostile.py. Each maker returns the
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


# --- decoded-memory bombs: few bytes, a size under the pixel limit, deep samples -----------
# Each is refused from its header by limits.max_decoded_bytes (edgemm.model.image_header.decode_cost):
# before it, the pixel limit alone let them take 300-800 MB each.

def png_header_only(width: int, height: int, depth: int = 16, colour: int = 6) -> bytes:
    """IHDR (`depth` bits, colour type 6 = RGBA), one empty IDAT, IEND: the header a
    decoder allocates width x height x channels x depth/8 from (16-bit RGBA 6300x6300: 318 MB)."""
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b""))
            + png_chunk(b"IEND", b""))


def tiff_deep(width: int = 4000, height: int = 3000, bits: int = 64, samples: int = 3,
              sample_format: int = 3) -> bytes:
    """A deflated TIFF of `samples` x `bits` (SampleFormat 3 = IEEE float) samples whose
    one strip is cut short after 2 KB: libtiff allocates the whole image (64-bit float RGB
    12 MP: 288 MB) before finding out."""
    strip = zlib.compress(bytes(1 << 20), 9)[:2000]
    entries = [(256, 4, width), (257, 4, height), (258, 3, bits), (259, 3, 8), (262, 3, 2 if samples >= 3 else 1),
               (273, 4, 0), (277, 3, samples), (278, 4, height), (279, 4, len(strip)), (339, 3, sample_format)]
    strip_offset = 8 + 2 + 12 * len(entries) + 4
    ifd = struct.pack("<H", len(entries))
    for tag, kind, value in entries:
        value = strip_offset if tag == 273 else value
        inline = struct.pack("<I", value) if kind == 4 else struct.pack("<HH", value, 0)
        ifd += struct.pack("<HHI", tag, kind, 1) + inline
    return b"II*\x00" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0) + strip


def animated_webp_canvas(side: int = 6300) -> bytes:
    """~100 bytes: an animated WebP whose canvas is side x side, with one 16x16 frame.
    The animation decoder composes on full-canvas RGBA buffers (6300: 580 MB peak)."""
    frame = encode(".webp", np.zeros((16, 16, 3), np.uint8), cv2.IMWRITE_WEBP_QUALITY, 101)[12:]  # its VP8L chunk
    vp8x = bytes([0x02, 0, 0, 0]) + (side - 1).to_bytes(3, "little") + (side - 1).to_bytes(3, "little")
    anmf = (bytes(6) + (15).to_bytes(3, "little") * 2 + (100).to_bytes(3, "little") + b"\x00") + frame
    body = b"WEBP" + riff_chunk(b"VP8X", vp8x) + riff_chunk(b"ANIM", bytes(6)) + riff_chunk(b"ANMF", anmf)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def bmp_rle8(width: int = 6000, height: int = 6000) -> bytes:
    """A 1 KB RLE8 BMP of width x height: the decoder fills the whole image (6000: 300 MB peak)."""
    payload = bytes(1024) + b"\x00\x01"  # zero runs, then end-of-bitmap
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(payload), 2835, 2835, 0, 0)
    palette = bytes(4 * 256)
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(payload), 0, 0, offset) + info + palette + payload


def jpeg_with_size(data: bytes, width: int, height: int) -> bytes:
    """`data` (a JPEG) with its frame header claiming width x height: what the decoder
    allocates comes from there (a progressive 40 MP frame: 240 MB of output and coefficients)."""
    sof = next(i for i in range(2, len(data) - 1) if data[i] == 0xFF and data[i + 1] in (0xC0, 0xC1, 0xC2))
    return data[:sof + 5] + struct.pack(">HH", height, width) + data[sof + 9:]
