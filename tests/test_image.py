"""load_image: decoding, colour order, EXIF orientation, and refusals.

Every input is built here with cv2.imencode / numpy / struct; nothing is checked in.
"""
from __future__ import annotations

import os
import re
import struct

import cv2
import numpy as np
import pytest

from edgemm.model.errors import ImageError
from edgemm.model.image import DEFAULT_MAX_PIXELS, load_image

RED_RGB, GREEN_RGB = (255, 0, 0), (0, 255, 0)


def encode(ext: str, img: np.ndarray, *params: int) -> bytes:
    if not cv2.haveImageWriter(ext):  # GIF: PyPI's wheel writes it, older OpenCVs (Debian 12's 4.6) do not
        pytest.skip(f"OpenCV {cv2.__version__} cannot write {ext}")
    ok, buf = cv2.imencode(ext, img, list(params))
    assert ok
    return buf.tobytes()


def solid_bgr(h: int, w: int, rgb: tuple[int, int, int]) -> np.ndarray:
    return np.full((h, w, 3), rgb[::-1], np.uint8)


def noise_bgr(h: int, w: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)


def assert_rgb8(img: np.ndarray, h: int, w: int) -> None:
    assert img.shape == (h, w, 3) and img.dtype == np.uint8 and img.flags.c_contiguous


def assert_refused(source, match: str, **kw) -> str:
    with pytest.raises(ImageError, match=match) as info:
        load_image(source, **kw)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- decoding ------------------------------------------------------------------------

@pytest.mark.parametrize("ext, params", [
    (".jpg", (cv2.IMWRITE_JPEG_QUALITY, 95)),
    (".png", ()),
    (".bmp", ()),
    (".webp", ()),                                # lossless: VP8L chunk
    (".webp", (cv2.IMWRITE_WEBP_QUALITY, 80)),   # lossy: "VP8 " chunk
    (".tiff", ()),
    (".gif", ()),
])
def test_pure_red_roundtrip_keeps_colour_order(ext, params):
    img = load_image(encode(ext, solid_bgr(24, 40, RED_RGB), *params))
    assert_rgb8(img, 24, 40)
    r, g, b = img[12, 20].astype(int)
    assert r > 240 and g < 15 and b < 15


def test_png_roundtrip_is_exact():
    bgr = noise_bgr(16, 24)
    np.testing.assert_array_equal(load_image(encode(".png", bgr)), bgr[:, :, ::-1])


def test_grey_png_becomes_three_equal_channels():
    grey = np.arange(60, dtype=np.uint8).reshape(6, 10)
    img = load_image(encode(".png", grey))
    assert_rgb8(img, 6, 10)
    for c in range(3):
        np.testing.assert_array_equal(img[:, :, c], grey)


def test_rgba_png_is_composited_over_white():
    bgra = np.zeros((2, 3, 4), np.uint8)
    bgra[0, 0] = (0, 0, 255, 255)   # opaque red
    bgra[0, 1] = (255, 0, 0, 0)     # fully transparent blue
    bgra[0, 2] = (0, 0, 0, 128)     # half-transparent black
    img = load_image(encode(".png", bgra))
    assert_rgb8(img, 2, 3)
    assert tuple(img[0, 0]) == (255, 0, 0)
    assert tuple(img[0, 1]) == (255, 255, 255)
    assert tuple(img[0, 2]) == (127, 127, 127)


def test_rgba_lossy_webp_uses_extended_header():
    bgra = np.zeros((20, 30, 4), np.uint8)
    bgra[..., 2] = 255
    bgra[..., 3] = 255
    bgra[:, 15:, 3] = 0
    data = encode(".webp", bgra, cv2.IMWRITE_WEBP_QUALITY, 80)
    img = load_image(data)
    assert_rgb8(img, 20, 30)
    assert img[10, 2, 0] > 240 and img[10, 2, 2] < 15        # opaque red
    assert img[10, 27].min() > 240                           # transparent → white


def test_16bit_png_is_scaled_with_rounding():
    bgr16 = np.empty((2, 2, 3), np.uint16)
    bgr16[...] = (0, 0x8080, 0xFFFF)                         # B, G, R
    bgr16[1, 1] = (257 * 10, 257 * 200, 1000)
    img = load_image(encode(".png", bgr16))
    assert_rgb8(img, 2, 2)
    assert tuple(img[0, 0]) == (255, 128, 0)
    assert tuple(img[1, 1]) == (4, 200, 10)                   # 1000/257 = 3.9 → 4


def test_bytearray_memoryview_path_and_pathlike(tmp_path):
    data = encode(".png", solid_bgr(4, 5, GREEN_RGB))
    file = tmp_path / "green.png"
    file.write_bytes(data)
    for source in (bytearray(data), memoryview(data), str(file), file):
        img = load_image(source)
        assert_rgb8(img, 4, 5)
        assert tuple(img[0, 0]) == GREEN_RGB


def test_bytes_after_jpeg_end_are_allowed():
    data = encode(".jpg", solid_bgr(16, 16, RED_RGB))
    for tail in (b"\x00" * 64, b"\x00\x00\x00\x18ftypmp42 trailing motion-photo video"):
        assert_rgb8(load_image(data + tail), 16, 16)


# --- EXIF orientation ----------------------------------------------------------------

def exif_app1(orientation: int, endian: str = "<") -> bytes:
    """APP1 segment: 'Exif\\0\\0' + TIFF header + IFD0 holding only Orientation (SHORT)."""
    tiff = (b"II" if endian == "<" else b"MM") + struct.pack(endian + "HI", 42, 8)
    tiff += struct.pack(endian + "H", 1)                                  # one entry
    tiff += struct.pack(endian + "HHIHH", 0x0112, 3, 1, orientation, 0)   # tag, SHORT, count, value
    tiff += struct.pack(endian + "I", 0)                                  # no next IFD
    return app1(b"Exif\x00\x00" + tiff)


def app1(payload: bytes) -> bytes:
    return b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload


def with_app1(jpeg: bytes, segment: bytes) -> bytes:
    assert jpeg[:2] == b"\xff\xd8"
    return jpeg[:2] + segment + jpeg[2:]


def marked_jpeg(h: int = 48, w: int = 80) -> bytes:
    """Grey JPEG with a red block in the stored top-left and a green one in the top-right."""
    bgr = np.full((h, w, 3), 128, np.uint8)
    bgr[:16, :16] = RED_RGB[::-1]
    bgr[:16, -16:] = GREEN_RGB[::-1]
    return encode(".jpg", bgr, cv2.IMWRITE_JPEG_QUALITY, 95)


def corner_of(img: np.ndarray, rgb: tuple[int, int, int]) -> str:
    """Which corner (tl, tr, bl, br) holds a block of colour `rgb`."""
    h, w = img.shape[:2]
    corners = {"tl": img[8, 8], "tr": img[8, w - 9], "bl": img[h - 9, 8], "br": img[h - 9, w - 9]}
    found = [name for name, px in corners.items() if np.abs(px.astype(int) - rgb).max() < 40]
    assert len(found) == 1, corners
    return found[0]


@pytest.mark.parametrize("orientation, rotated, red, green", [
    (1, False, "tl", "tr"),
    (2, False, "tr", "tl"),  # mirror horizontal
    (3, False, "br", "bl"),  # rotate 180
    (4, False, "bl", "br"),  # mirror vertical
    (5, True, "tl", "bl"),   # transpose
    (6, True, "tr", "br"),   # rotate 90 clockwise
    (7, True, "br", "tr"),   # transverse
    (8, True, "bl", "tl"),   # rotate 90 counter-clockwise
])
@pytest.mark.parametrize("endian", ["<", ">"])
def test_exif_orientation_is_applied(orientation, rotated, red, green, endian):
    img = load_image(with_app1(marked_jpeg(48, 80), exif_app1(orientation, endian)))
    assert_rgb8(img, *((80, 48) if rotated else (48, 80)))
    assert corner_of(img, RED_RGB) == red
    assert corner_of(img, GREEN_RGB) == green


@pytest.mark.parametrize("payload", [
    b"Exif\x00\x00",                                          # nothing after the header
    b"Exif\x00\x00XX*\x00garbage",                            # bad byte order
    b"Exif\x00\x00II*\x00" + struct.pack("<I", 10_000),       # IFD offset past the end
    b"Exif\x00\x00II*\x00" + struct.pack("<IH", 8, 500),      # entry count past the end
    b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta/>",          # XMP, not EXIF
])
def test_garbled_exif_means_no_rotation(payload):
    img = load_image(with_app1(marked_jpeg(48, 80), app1(payload)))
    assert_rgb8(img, 48, 80)
    assert corner_of(img, RED_RGB) == "tl"


def test_out_of_range_orientation_means_no_rotation():
    img = load_image(with_app1(marked_jpeg(48, 80), exif_app1(9)))
    assert_rgb8(img, 48, 80)


# --- refusals of encoded input -------------------------------------------------------

def test_empty_bytes():
    assert_refused(b"", r"^image is empty \(0 bytes\)$")


@pytest.mark.parametrize("data", [
    b"this is plain text, not an image" + np.random.default_rng(1).bytes(500),
    b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n",
    b"\x00",
])
def test_non_image_bytes(data):
    assert_refused(data, r"^not a decodable image \(expected JPEG, PNG, BMP, WebP, TIFF or GIF\)$")


def test_truncated_jpeg():
    data = encode(".jpg", noise_bgr(64, 64), cv2.IMWRITE_JPEG_QUALITY, 90)
    assert_refused(data[: len(data) // 2], r"truncated.*JPEG has no end-of-image marker FFD9")


def test_jpeg_cut_inside_its_headers():
    data = with_app1(encode(".jpg", noise_bgr(16, 16)), app1(b"Exif\x00\x00" + b"\x00" * 2000))
    assert_refused(data[:500], r"truncated.*JPEG has no readable frame header")


@pytest.mark.parametrize("cut", ["half", "iend"])
def test_truncated_png(cut):
    data = encode(".png", noise_bgr(64, 64))
    data = data[: len(data) // 2] if cut == "half" else data[:-12]
    assert_refused(data, r"truncated.*PNG has no IEND chunk")


def test_truncated_webp():
    data = encode(".webp", noise_bgr(64, 64), cv2.IMWRITE_WEBP_QUALITY, 80)
    assert_refused(data[: len(data) // 2], r"truncated.*WebP is shorter than its RIFF size")


def test_undecodable_data_after_a_valid_header():
    data = encode(".bmp", noise_bgr(32, 32))
    assert_refused(data[:60], r"truncated or corrupt \(BMP data could not be decoded\)")


# --- pixel limit (checked from the header, before decoding) --------------------------

def test_png_over_pixel_limit():
    data = encode(".png", np.zeros((2000, 2000), np.uint8))
    message = assert_refused(data, r"limits\.max_pixels", max_pixels=1_000_000)
    assert message == "image is 2000x2000 = 4.0 MP, above the 1.0 MP limit (limits.max_pixels)"
    assert load_image(data, max_pixels=4_000_000).shape == (2000, 2000, 3)


def jpeg_header_only(width: int, height: int) -> bytes:
    """SOI + SOF0 for a `width` x `height` grey image, and no image data at all."""
    sof = struct.pack(">BHHB", 8, height, width, 1) + bytes([1, 0x11, 0])
    return b"\xff\xd8" + b"\xff\xc0" + struct.pack(">H", len(sof) + 2) + sof


def test_jpeg_bomb_refused_from_header_alone():
    message = assert_refused(jpeg_header_only(12000, 9000), r"limits\.max_pixels")
    assert message == "image is 12000x9000 = 108.0 MP, above the 25.0 MP limit (limits.max_pixels)"


def test_png_bomb_refused_from_header_alone():
    ihdr = struct.pack(">II5B", 100_000, 100_000, 8, 0, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + b"\x00" * 4
    assert_refused(data, r"^image is 100000x100000 = 10000\.0 MP, above the 25\.0 MP limit")


@pytest.mark.parametrize("ext, params", [
    (".jpg", ()), (".bmp", ()), (".webp", ()), (".webp", (cv2.IMWRITE_WEBP_QUALITY, 80)),
    (".tiff", ()), (".gif", ()),
])
def test_every_format_reads_its_size_from_the_header(ext, params):
    data = encode(ext, solid_bgr(30, 50, RED_RGB), *params)
    limit = r"^image is 50x30 = 0\.0015 MP, above the 0\.0014 MP limit"
    assert_refused(data, limit, max_pixels=1400)
    assert load_image(data, max_pixels=1500).shape == (30, 50, 3)


def test_default_limit():
    assert DEFAULT_MAX_PIXELS == 25_000_000


# --- paths ---------------------------------------------------------------------------

def test_missing_path(tmp_path):
    missing = tmp_path / "nope.jpg"
    assert_refused(str(missing), rf"^image not found: {missing}$")


def test_directory_path(tmp_path):
    assert_refused(tmp_path, r"^image path is a directory, not a file: ")


def test_empty_file_names_the_path(tmp_path):
    file = tmp_path / "empty.jpg"
    file.write_bytes(b"")
    assert_refused(file, rf"^image is empty \(0 bytes\): {file}$")


def test_non_image_file_names_the_path(tmp_path):
    file = tmp_path / "notes.jpg"
    file.write_text("hello")
    assert_refused(file, rf"^not a decodable image \(.*\): {file}$")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can read anything")
def test_unreadable_path(tmp_path):
    file = tmp_path / "secret.png"
    file.write_bytes(encode(".png", solid_bgr(2, 2, RED_RGB)))
    file.chmod(0)
    assert_refused(file, r"^image not readable \(permission denied\): ")


def test_unsupported_source_type():
    assert_refused(12345, r"^unsupported image input of type int")
    assert_refused([[0, 0, 0]], r"^unsupported image input of type list")


# --- numpy arrays --------------------------------------------------------------------

def test_rgb_array_is_kept_in_rgb_order_and_copied():
    rgb = np.zeros((3, 4, 3), np.uint8)
    rgb[..., 0] = 255
    img = load_image(rgb)
    assert_rgb8(img, 3, 4)
    np.testing.assert_array_equal(img, rgb)
    assert not np.shares_memory(img, rgb)


@pytest.mark.parametrize("shape", [(3, 4), (3, 4, 1)])
def test_grey_arrays(shape):
    grey = np.arange(12, dtype=np.uint8).reshape(shape)
    img = load_image(grey)
    assert_rgb8(img, 3, 4)
    np.testing.assert_array_equal(img, np.repeat(grey.reshape(3, 4, 1), 3, axis=2))


def test_rgba_array_is_composited_over_white():
    rgba = np.array([[[255, 0, 0, 255], [0, 0, 255, 0], [0, 0, 0, 128]]], np.uint8)
    img = load_image(rgba)
    assert_rgb8(img, 1, 3)
    assert img.tolist() == [[[255, 0, 0], [255, 255, 255], [127, 127, 127]]]


def test_uint16_array_is_scaled_with_rounding():
    a = np.array([[0, 257, 0x8080, 1000, 0xFFFF]], np.uint16)
    assert load_image(a)[0, :, 0].tolist() == [0, 1, 128, 4, 255]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_float_array_in_unit_range(dtype):
    a = np.array([[[0.0, 0.5, 1.0]]], dtype)
    assert load_image(a).tolist() == [[[0, 128, 255]]]


@pytest.mark.parametrize("values, shown", [
    ([0.0, 255.0], r"\[0, 255\]"),   # 0..255 floats: a common mistake, refused rather than clipped
    ([-0.5, 0.5], r"\[-0.5, 0.5\]"),
    ([0.0, np.nan], "nan"),
])
def test_float_array_out_of_range(values, shown):
    a = np.array(values, np.float32).reshape(1, 2)
    assert_refused(a, rf"^float image values must be in \[0, 1\], got range .*{shown}")


def test_non_contiguous_array():
    rgb = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    view = rgb[::-1, ::2]
    img = load_image(view)
    assert_rgb8(img, 4, 3)
    np.testing.assert_array_equal(img, view)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 2), (2, 3, 5), (1, 2, 3, 3)])
def test_array_with_wrong_shape(shape):
    expected = "^" + re.escape(f"image array has shape {shape}; expected (H, W) grey")
    assert_refused(np.zeros(shape, np.uint8), expected)


@pytest.mark.parametrize("shape", [(0, 4, 3), (4, 0), (0, 0, 1)])
def test_empty_array(shape):
    expected = "^" + re.escape(f"image array is empty (shape {shape})") + "$"
    assert_refused(np.zeros(shape, np.uint8), expected)


@pytest.mark.parametrize("dtype", [bool, np.complex64, np.int32, np.int8, object])
def test_array_with_wrong_dtype(dtype):
    message = assert_refused(np.zeros((2, 2, 3), dtype), r"^image array has dtype ")
    assert str(np.dtype(dtype)) in message and "uint8, uint16 or float in [0, 1]" in message


def test_array_over_pixel_limit():
    array = np.zeros((100, 200), np.uint8)
    expected = r"^image is 200x100 = 0\.02 MP, above the 0\.01 MP limit"
    assert_refused(array, expected, max_pixels=10_000)


def test_max_pixels_must_be_positive():
    with pytest.raises(ValueError, match="max_pixels"):
        load_image(np.zeros((2, 2), np.uint8), max_pixels=0)


def test_pixel_values_are_normalised_per_channel_in_chw_order():
    from edgemm.model.preprocess import to_pixel_values
    rgb = np.random.default_rng(3).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's: every channel differs
    got = to_pixel_values(rgb, 40, 30, mean, std)
    want = ((rgb / 255.0 - np.array(mean)) / np.array(std)).transpose(2, 0, 1)[None]
    assert got.shape == (1, 3, 40, 30) and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
