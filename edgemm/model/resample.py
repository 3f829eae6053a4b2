"""Lanczos resize of RGB8 images, bit-exact with Pillow's `Image.resize(..., LANCZOS)`
(and its BILINEAR and BICUBIC filters, the same algorithm with another kernel: `resize_pil`).

Idefics3 (SmolVLM) was trained on images resized by Pillow, and its reference
processor still resizes with Pillow. OpenCV's INTER_LANCZOS4 is another filter
(8 taps, no antialiasing when shrinking), so its pixels differ by many grey
levels. Pillow is not a runtime dependency, so this is Pillow's algorithm
(libImaging/Resample.c) in numpy:

* per output pixel, taps over `support = 3 * max(scale, 1)` input pixels, the
  Lanczos-3 kernel stretched by the scale when shrinking (that is the antialiasing);
* weights normalised to sum 1, then fixed point with 22 fraction bits;
* a horizontal pass, then a vertical pass, each rounding to uint8 in between.
"""
from __future__ import annotations

import math

import numpy as np

PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images
SUPPORT = 3.0  # Lanczos-3


def _lanczos(x: np.ndarray) -> np.ndarray:
    """sinc(x) * sinc(x / 3) on [-3, 3), 0 outside (Pillow's half-open window)."""
    inside = (x >= -SUPPORT) & (x < SUPPORT)
    return np.where(inside, np.sinc(x) * np.sinc(x / SUPPORT), 0.0)


def _bilinear(x: np.ndarray) -> np.ndarray:
    """Pillow's triangle filter, support 1."""
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


def _bicubic(x: np.ndarray) -> np.ndarray:
    """Pillow's cubic convolution with a = -0.5, support 2."""
    a, x = -0.5, np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


# preprocessor_config.json "resample" (PIL's numbering) → (kernel, support)
FILTERS = {1: (_lanczos, SUPPORT), 2: (_bilinear, 1.0), 3: (_bicubic, 2.0)}
FILTER_NAMES = {1: "Lanczos", 2: "bilinear", 3: "bicubic"}


def _coefficients(in_size: int, out_size: int, kernel=_lanczos, kernel_support: float = SUPPORT
                  ) -> tuple[np.ndarray, np.ndarray]:
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


def _resample_axis(img: np.ndarray, out_size: int, axis: int, resample: int = 1) -> np.ndarray:
    """One pass along `axis` (0 rows, 1 columns) of a uint8 (H, W, C) image."""
    in_size = img.shape[axis]
    first, weights = _coefficients(in_size, out_size, *FILTERS[resample])
    acc = np.full(img.shape[:axis] + (out_size,) + img.shape[axis + 1:], 1 << (PRECISION_BITS - 1), np.int64)
    for tap in range(weights.shape[1]):
        index = np.minimum(first + tap, in_size - 1)  # unused taps have weight 0
        w = weights[:, tap]
        w = w[:, None, None] if axis == 0 else w[None, :, None]
        acc += np.take(img, index, axis=axis).astype(np.int64) * w
    return np.clip(acc >> PRECISION_BITS, 0, 255).astype(np.uint8)


def resize_lanczos(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """RGB8 (H, W, 3) → (height, width, 3), the pixels Pillow's LANCZOS resize gives."""
    return resize_pil(rgb, height, width, 1)


def resize_pil(rgb: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """RGB8 (H, W, 3) → (height, width, 3), the pixels Pillow's resize gives with the filter
    `resample` (PIL's numbering: 1 Lanczos, 2 bilinear, 3 bicubic; see FILTERS)."""
    if height < 1 or width < 1:
        raise ValueError(f"resize target must be positive, got {height}x{width}")
    if resample not in FILTERS:
        raise ValueError(f"resample {resample} is not one of Pillow's filters implemented here ({sorted(FILTERS)})")
    out = rgb
    if out.shape[1] != width:  # Pillow: horizontal pass first, then vertical
        out = _resample_axis(out, width, axis=1, resample=resample)
    if out.shape[0] != height:
        out = _resample_axis(out, height, axis=0, resample=resample)
    return out if out is not rgb else rgb.copy()
