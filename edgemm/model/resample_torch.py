"""Bicubic resize of RGB8 images, bit-exact with torch's antialiased uint8 `interpolate`.

transformers' default image processors for InternVL (`GotOcr2ImageProcessor`, the
torchvision backend a user gets whenever torchvision is installed) resize uint8
tensors with torchvision's `resize(..., BICUBIC, antialias=True)`, which on a CPU hands
the uint8 image straight to torch's `interpolate(mode="bicubic", antialias=True)`.
That kernel (aten/src/ATen/native/cpu/UpSampleKernel.cpp, the same sums on its AVX2
and its generic path) is Pillow-SIMD's algorithm, not Pillow's:

* per output pixel, taps over `support = 2 * max(scale, 1)` input pixels, the cubic
  kernel with a = -0.5 stretched by the scale when shrinking (the antialiasing);
* weights normalised to sum 1, then int16 fixed point with as many fraction bits as
  the largest weight of the axis allows (at most 22; Pillow always uses 22);
* a horizontal pass, then a vertical pass, each rounding to uint8 in between.

So Pillow's BICUBIC (transformers' PIL backend) differs from it by a grey level here
and there; this module gives torch's pixels. Neither Pillow nor torch is a runtime
dependency: this is the algorithm in numpy.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from edgemm.model.resample import BICUBIC_SUPPORT as SUPPORT, bicubic_kernel, resample_lines

MAX_PRECISION = 22
# the kernel is Pillow's (a = -0.5, support 2: torch uses Pillow's a for antialiased bicubic,
# -0.75 without antialias), bit for bit: see bicubic_kernel


@lru_cache(maxsize=16)  # an InternVL image needs four (the grid's two axes, the thumbnail's two)
def _coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(first input index [out], int16-range weights [out, taps], fraction bits) for one axis,
    made once per (in_size, out_size) and shared (read-only): a camera's frames all have
    one size, so every frame after the first reuses them.

    The weights are cut to the taps some output uses: torch allocates
    ceil(support) * 2 + 1 taps, but a window 2 * support wide covers at most
    ceil(2 * support) + 1 inputs (5 of 7 for a small shrink, 4 of 5 for an enlargement), and
    the taps past it have weight 0 everywhere, so the tap loop would add zeros. Kept as
    int32 (the sums' type): at most 16 sizes, a few MB even for strips of 25 megapixels."""
    scale = in_size / out_size
    support = SUPPORT * scale if scale >= 1 else SUPPORT
    taps = int(math.ceil(support)) * 2 + 1
    inv_scale = 1 / scale if scale >= 1 else 1.0
    centers = scale * (np.arange(out_size) + 0.5)
    # static_cast<int64_t>(v + 0.5): truncation towards zero, as torch writes it
    first = np.maximum(np.trunc(centers - support + 0.5).astype(np.int64), 0)
    size = np.clip(np.minimum(np.trunc(centers + support + 0.5).astype(np.int64), in_size) - first, 0, taps)
    offsets = np.arange(taps)
    used = offsets[None, :] < size[:, None]
    weights = np.where(used, bicubic_kernel((offsets[None, :] + first[:, None] - centers[:, None] + 0.5) * inv_scale), 0.0)
    totals = weights.sum(axis=1, keepdims=True)
    weights = np.divide(weights, totals, out=np.zeros_like(weights), where=totals != 0)
    top = weights.max(initial=0.0)
    bits = 0
    while bits < MAX_PRECISION and int(0.5 + top * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    scaled = weights * (1 << bits)
    fixed = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    fixed = np.ascontiguousarray(fixed[:, :max(1, int(size.max(initial=0)))])
    first.flags.writeable = fixed.flags.writeable = False
    return first, fixed, bits


def _resample_first_axis(lines: np.ndarray, out_size: int) -> np.ndarray:
    """One pass along the first axis of uint8 (N, ...) → (out_size, ...), every channel and
    line at once: edgemm.model.resample's blocked tap loop (int32 sums as torch sums them,
    |sum| < 255 * 1.1 * 2**22 < 2**31, then torch's rounding: (sum + 2**(bits-1)) >> bits,
    clipped to 0..255). Each tap gathers whole lines, a plain copy.

    A tap loop, not matrix products: BLAS would be several times faster on an idle core,
    but its thread pool stalls on a busy one (two prepare threads, the encoder's threads),
    and float32 sums are not exact once they pass 2**24; float64 banded products, exact,
    were slower than this loop with one thread (docs/BENCHMARKS.md)."""
    first, weights, bits = _coefficients(lines.shape[0], out_size)
    flat = lines.reshape(lines.shape[0], -1)
    return resample_lines(flat, first, weights, bits).reshape(out_size, *lines.shape[1:])


def resize_rows_of_planes(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 (H, W, C) → (height, C, width), the pixels torch's antialiased uint8 bicubic gives,
    laid out row by row with each row's channel planes side by side.

    That layout is what both passes want: the horizontal pass (torch's first) runs on the
    image's columns, (W, C, H), its taps whole columns of all channels; its result, turned
    to (H, C, width), gives the vertical pass whole rows. Crops of it, seen as (C, h, w),
    are the encoder's tiles (edgemm.model.families.internvl) without another copy."""
    if height < 1 or width < 1:
        raise ValueError(f"resize target must be positive, got {height}x{width}")
    if rgb.shape[1] != width:
        columns = _resample_first_axis(np.ascontiguousarray(rgb.transpose(1, 2, 0)), width)  # (width, C, H)
        rows = np.ascontiguousarray(columns.transpose(2, 1, 0))
    else:
        rows = np.ascontiguousarray(rgb.transpose(0, 2, 1))  # always a copy: never the caller's image
    return _resample_first_axis(rows, height) if rows.shape[0] != height else rows


def resize_planes(planes: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 (C, H, W) → (C, height, width), the pixels torch's antialiased uint8 bicubic gives."""
    return np.ascontiguousarray(resize_rows_of_planes(planes.transpose(1, 2, 0), height, width).transpose(1, 0, 2))


def resize_bicubic_torch(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """RGB8 (H, W, 3) → (height, width, 3), the pixels torch's antialiased uint8 bicubic gives
    (not Pillow's: for those, edgemm.model.resample.resize_bicubic)."""
    return np.ascontiguousarray(resize_rows_of_planes(rgb, height, width).transpose(0, 2, 1))
