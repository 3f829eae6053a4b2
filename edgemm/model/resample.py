"""Lanczos and bicubic resize of RGB8 images, bit-exact with Pillow's `Image.resize`.

Idefics3 (SmolVLM) was trained on images resized by Pillow, and its reference
processor still resizes with Pillow. OpenCV's INTER_LANCZOS4 is another filter
(8 taps, no antialiasing when shrinking), so its pixels differ by many grey
levels. Pillow is not a runtime dependency, so this is Pillow's algorithm
(libImaging/Resample.c) in numpy:

* per output pixel, taps over `support = 3 * max(scale, 1)` input pixels, the
  Lanczos-3 kernel stretched by the scale when shrinking (that is the antialiasing);
* weights normalised to sum 1, then fixed point with 22 fraction bits;
* a horizontal pass, then a vertical pass, each rounding to uint8 in between.

Qwen2-VL's reference processor resizes with Pillow's BICUBIC: the same passes with
Pillow's cubic kernel (a = -0.5, support 2).
"""
from __future__ import annotations

import math

import numpy as np

PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images
SUPPORT = 3.0  # Lanczos-3
BICUBIC_SUPPORT = 2.0
BICUBIC_A = -0.5  # Pillow's bicubic_filter


def _lanczos(x: np.ndarray) -> np.ndarray:
    """sinc(x) * sinc(x / 3) on [-3, 3), 0 outside (Pillow's half-open window)."""
    inside = (x >= -SUPPORT) & (x < SUPPORT)
    return np.where(inside, np.sinc(x) * np.sinc(x / SUPPORT), 0.0)


def _bicubic(x: np.ndarray) -> np.ndarray:
    """Pillow's bicubic_filter: Keys' cubic convolution with a = -0.5 on (-2, 2)."""
    x = np.abs(x)
    a = BICUBIC_A
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _coefficients(in_size: int, out_size: int, kernel=_lanczos,
                  kernel_support: float = SUPPORT) -> tuple[np.ndarray, np.ndarray]:
    """(first input index [out], fixed-point weights [out, taps]) for one axis."""
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = kernel_support * filter_scale
    taps = int(math.ceil(support)) * 2 + 1
    centers = (np.arange(out_size) + 0.5) * scale
    # Pillow rounds with (int)(v + 0.5), which truncates towards zero
    first = np.clip(np.trunc(centers - support + 0.5).astype(np.int64), 0, None)
    last = np.clip(np.trunc(centers + support + 0.5).astype(np.int64), None, in_size)
    offsets = np.arange(taps)
    used = offsets[None, :] < (last - first)[:, None]
    weights = kernel((first[:, None] + offsets[None, :] - centers[:, None] + 0.5) / filter_scale)
    weights = np.where(used, weights, 0.0)
    totals = weights.sum(axis=1, keepdims=True)
    weights = np.divide(weights, totals, out=weights, where=totals != 0)
    fixed = np.trunc(weights * (1 << PRECISION_BITS) + np.where(weights < 0, -0.5, 0.5))
    return first, fixed.astype(np.int64)


CHUNK_BYTES = 256 << 10  # the int32 sums of this many output lines at a time stay in the cache


def _resample_axis(img: np.ndarray, out_size: int, axis: int, kernel=_lanczos,
                   kernel_support: float = SUPPORT) -> np.ndarray:
    """One pass along `axis` (0 rows, 1 columns) of a uint8 (H, W, C) image.

    The resampled axis is laid out first, so that each tap gathers whole lines (a copy of
    contiguous bytes, not a strided gather); the sums are int32 as in Pillow (its fixed
    point is chosen so that they fit), a cache-sized block of output lines at a time."""
    in_size = img.shape[axis]
    first, weights = _coefficients(in_size, out_size, kernel, kernel_support)
    weights = weights.astype(np.int32)
    moved = np.moveaxis(img, axis, 0)
    rest = moved.shape[1:]
    lines = np.ascontiguousarray(moved).reshape(in_size, -1)  # [in, everything else]
    out = np.empty((out_size, lines.shape[1]), np.uint8)
    block = max(1, CHUNK_BYTES // (4 * lines.shape[1]))
    acc = np.empty((block, lines.shape[1]), np.int32)
    term = np.empty_like(acc)
    for start in range(0, out_size, block):
        n = min(block, out_size - start)
        total, product = acc[:n], term[:n]
        total.fill(1 << (PRECISION_BITS - 1))
        for tap in range(weights.shape[1]):
            index = np.minimum(first[start:start + n] + tap, in_size - 1)  # unused taps have weight 0
            np.multiply(lines[index], weights[start:start + n, tap, None], out=product)
            total += product
        np.right_shift(total, PRECISION_BITS, out=total)
        np.clip(total, 0, 255, out=total)
        out[start:start + n] = total
    return np.ascontiguousarray(np.moveaxis(out.reshape(out_size, *rest), 0, axis))


def resize_lanczos(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """RGB8 (H, W, 3) → (height, width, 3), the pixels Pillow's LANCZOS resize gives."""
    if height < 1 or width < 1:
        raise ValueError(f"resize target must be positive, got {height}x{width}")
    out = rgb
    if out.shape[1] != width:  # Pillow: horizontal pass first, then vertical
        out = _resample_axis(out, width, axis=1)
    if out.shape[0] != height:
        out = _resample_axis(out, height, axis=0)
    return out if out is not rgb else rgb.copy()


def resize_bicubic(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """RGB8 (H, W, 3) → (height, width, 3), the pixels Pillow's BICUBIC resize gives."""
    if height < 1 or width < 1:
        raise ValueError(f"resize target must be positive, got {height}x{width}")
    out = rgb
    if out.shape[1] != width:  # Pillow: horizontal pass first, then vertical
        out = _resample_axis(out, width, 1, _bicubic, BICUBIC_SUPPORT)
    if out.shape[0] != height:
        out = _resample_axis(out, height, 0, _bicubic, BICUBIC_SUPPORT)
    return out if out is not rgb else rgb.copy()
