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

CUBIC_A = -0.5  # torch uses Pillow's a for antialiased bicubic (-0.75 without antialias)
SUPPORT = 2.0  # the cubic kernel's half-width
MAX_PRECISION = 22
BAND = 32  # outputs per matrix product: few zeros in a block, still big enough for BLAS


def _cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution kernel with a = -0.5, 0 from |x| = 2 on."""
    x = np.abs(x)
    a = CUBIC_A
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(first input index [out], int16 weights [out, taps], fraction bits) for one axis."""
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
    weights = np.where(used, _cubic((offsets[None, :] + first[:, None] - centers[:, None] + 0.5) * inv_scale), 0.0)
    totals = weights.sum(axis=1, keepdims=True)
    weights = np.divide(weights, totals, out=np.zeros_like(weights), where=totals != 0)
    top = weights.max(initial=0.0)
    bits = 0
    while bits < MAX_PRECISION and int(0.5 + top * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    scaled = weights * (1 << bits)
    fixed = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5))
    return first, fixed.astype(np.int64), bits


@lru_cache(maxsize=64)
def _plan(in_size: int, out_size: int) -> tuple[list, int, type]:
    """One axis's resize as matrix products: per BAND outputs (first output, end, first input,
    end, weights [outputs, inputs]), the fraction bits, and the float type that sums exactly.

    Every weight is an integer, every pixel too: each product and partial sum is an integer
    no larger than 255 * sum|weights| + the rounding offset, which float32 holds exactly
    below 2**24 (upscaling and mild shrinking), float64 always. So BLAS gives torch's int32
    sums to the last bit. Cached: a camera's frames repeat their sizes."""
    first, weights, bits = _coefficients(in_size, out_size)
    taps = weights.shape[1]
    bound = 255 * int(np.abs(weights).sum(axis=1).max()) + (1 << bits)
    dtype = np.float32 if bound < 2 ** 24 else np.float64
    bands = []
    for start in range(0, out_size, BAND):
        stop = min(start + BAND, out_size)
        lo, hi = int(first[start]), int(min(in_size, first[stop - 1] + taps))
        block = np.zeros((stop - start, hi - lo), dtype)
        rows = np.broadcast_to(np.arange(stop - start)[:, None], (stop - start, taps))
        cols = np.minimum(first[start:stop, None] + np.arange(taps), in_size - 1) - lo  # unused taps weigh 0
        np.add.at(block, (rows, cols), weights[start:stop])
        bands.append((start, stop, lo, hi, block))
    return bands, bits, dtype


def _resample_axis(planes: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One pass along `axis` (1 rows, 2 columns) of (C, H, W) planes of integer pixel values,
    then torch's rounding back to integers 0..255 ((sum + 2**(bits-1)) >> bits, clipped)."""
    bands, bits, dtype = _plan(planes.shape[axis], out_size)
    x = planes.astype(dtype, copy=False)
    if axis == 2:
        flat = x.reshape(-1, x.shape[2])
        out = np.empty((flat.shape[0], out_size), dtype)
        for start, stop, lo, hi, block in bands:
            out[:, start:stop] = flat[:, lo:hi] @ block.T
        out = out.reshape(x.shape[0], x.shape[1], out_size)
    else:
        out = np.empty((x.shape[0], out_size, x.shape[2]), dtype)
        for start, stop, lo, hi, block in bands:
            np.matmul(block, x[:, lo:hi], out=out[:, start:stop])
    out += 1 << (bits - 1)
    out *= 1 / (1 << bits)  # a power of two: exact, and floor() then is the shift
    np.floor(out, out=out)
    return np.clip(out, 0, 255, out=out)


def resize_planes(planes: np.ndarray, height: int, width: int) -> np.ndarray:
    """(C, H, W) pixel values 0..255 (any float or integer type) → (C, height, width) float32
    or float64 holding exactly the integers torch's antialiased uint8 bicubic gives."""
    if height < 1 or width < 1:
        raise ValueError(f"resize target must be positive, got {height}x{width}")
    out = planes
    if out.shape[2] != width:  # torch: horizontal pass first, then vertical
        out = _resample_axis(out, width, axis=2)
    if out.shape[1] != height:
        out = _resample_axis(out, height, axis=1)
    return out if out is not planes else planes.astype(np.float32)


def resize_bicubic(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """RGB8 (H, W, 3) → (height, width, 3), the pixels torch's antialiased uint8 bicubic gives."""
    out = resize_planes(rgb.transpose(2, 0, 1), height, width)
    return np.ascontiguousarray(out.transpose(1, 2, 0)).astype(np.uint8)
