"""Lanczos, bicubic and bilinear resize of RGB8 images, bit-exact with Pillow's `Image.resize`.

Idefics3 (SmolVLM) was trained on images resized by Pillow, and its reference
processor still resizes with Pillow. OpenCV's INTER_LANCZOS4 is another filter
(8 taps, no antialiasing when shrinking), so its pixels differ by many grey
levels. Pillow is not a runtime dependency, so this is Pillow's algorithm
(libImaging/Resample.c) in numpy:

* per output pixel, taps over `support = 3 * max(scale, 1)` input pixels, the
  Lanczos-3 kernel stretched by the scale when shrinking (that is the antialiasing);
* weights normalised to sum 1, then fixed point with 22 fraction bits;
* a horizontal pass, then a vertical pass, each rounding to uint8 in between (the
  other way round for an image over 100 times taller than wide, as Pillow 12 does).

Qwen2-VL's and LLaVA's reference processors resize with Pillow's BICUBIC: the same passes
with Pillow's cubic kernel (a = -0.5, support 2); Gemma 3's with BILINEAR (support 1).
`resize_pil` takes the filter by PIL's number and can compute a window of the result alone.
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


def bicubic_kernel(x: np.ndarray) -> np.ndarray:
    """Pillow's bicubic_filter: Keys' cubic convolution with a = -0.5 on (-2, 2). torch's
    antialiased bicubic (edgemm.model.resample_torch) has the same kernel, written
    ((a·x - 5a)·x + 8a)·x - 4a on [1, 2): with a = -0.5, a power of two, both orders of
    operations round alike, so they agree bit for bit."""
    x = np.abs(x)
    a = BICUBIC_A
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _bilinear(x: np.ndarray) -> np.ndarray:
    """Pillow's triangle filter, support 1."""
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


COEFFICIENTS_PER_CHUNK = 1 << 21  # weights (outputs x taps) made at once: 16 MB per array

# preprocessor_config.json "resample" (PIL's numbering) → (kernel, support)
FILTERS = {1: (_lanczos, SUPPORT), 2: (_bilinear, 1.0), 3: (bicubic_kernel, BICUBIC_SUPPORT)}
FILTER_NAMES = {1: "Lanczos", 2: "bilinear", 3: "bicubic"}


def _coefficients(in_size: int, out_size: int, kernel=_lanczos, kernel_support: float = SUPPORT,
                  span: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(first input index [out], fixed-point weights [out, taps]) for one axis; for the
    outputs in `span` (start, stop) only, if given: each output's weights depend on its
    own index alone, so a part of the resize is exactly that part of the whole."""
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = kernel_support * filter_scale
    taps = int(math.ceil(support)) * 2 + 1
    centers = (np.arange(*(span or (0, out_size))) + 0.5) * scale
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
                   kernel_support: float = SUPPORT, span: tuple[int, int] | None = None) -> np.ndarray:
    """One pass along `axis` (0 rows, 1 columns) of a uint8 (H, W, C) image (the outputs in
    `span` only, if given).

    The resampled axis is laid out first, so that each tap gathers whole lines (a copy of
    contiguous bytes, not a strided gather). The weights of a strong shrink of a long axis
    (a 25-megapixel strip to 896 pixels: 56 000 taps each) are made a chunk of outputs at
    a time, so their memory stays near COEFFICIENTS_PER_CHUNK entries instead of growing
    with the image."""
    start, stop = span or (0, out_size)
    in_size = img.shape[axis]
    moved = np.moveaxis(img, axis, 0)
    rest = moved.shape[1:]
    lines = np.ascontiguousarray(moved).reshape(in_size, -1)  # [in, everything else]
    out = np.empty((stop - start, lines.shape[1]), np.uint8)
    taps = int(math.ceil(kernel_support * max(in_size / out_size, 1.0))) * 2 + 1
    step = max(1, COEFFICIENTS_PER_CHUNK // taps)
    for a in range(start, stop, step):
        b = min(a + step, stop)
        first, weights = _coefficients(in_size, out_size, kernel, kernel_support, (a, b))
        resample_lines(lines, first, weights, out=out[a - start:b - start])
    return np.ascontiguousarray(np.moveaxis(out.reshape(stop - start, *rest), 0, axis))


def resample_lines(lines: np.ndarray, first: np.ndarray, weights: np.ndarray, bits: int = PRECISION_BITS,
                   out: np.ndarray | None = None) -> np.ndarray:
    """uint8 [in, X] → [len(first), X] (into `out` if given): each output line the weighted sum
    of its taps' lines in fixed point with `bits` fraction bits, rounded as
    (sum + 2**(bits-1)) >> bits and clipped to 0..255, as Pillow (22 bits) and torch (its
    own bits per axis, edgemm.model.resample_torch) both do."""
    in_size, count = lines.shape[0], len(first)
    if out is None:
        out = np.empty((count, lines.shape[1]), np.uint8)
    if weights.shape[1] > count:  # more taps than outputs (a strong shrink): one dot product per output
        for i, (a, w) in enumerate(zip(first, weights)):
            n = min(len(w), in_size - a)
            total = (1 << (bits - 1)) + w[:n] @ lines[a:a + n].astype(np.int64)
            out[i] = np.clip(total >> bits, 0, 255)
        return out
    # the sums are int32 as in Pillow (its fixed point is chosen so that they fit), a
    # cache-sized block of output lines at a time
    weights = weights.astype(np.int32, copy=False)
    block = max(1, CHUNK_BYTES // (4 * lines.shape[1]))
    acc = np.empty((min(block, count), lines.shape[1]), np.int32)  # no more lines than there are outputs
    term = np.empty_like(acc)
    for begin in range(0, count, block):
        n = min(block, count - begin)
        total, product = acc[:n], term[:n]
        total.fill(1 << (bits - 1))
        for tap in range(weights.shape[1]):
            index = np.minimum(first[begin:begin + n] + tap, in_size - 1)  # unused taps have weight 0
            np.multiply(lines[index], weights[begin:begin + n, tap, None], out=product)
            total += product
        np.right_shift(total, bits, out=total)
        np.clip(total, 0, 255, out=total)
        out[begin:begin + n] = total
    return out


def resize_lanczos(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """RGB8 (H, W, 3) → (height, width, 3), the pixels Pillow's LANCZOS resize gives."""
    return resize_pil(rgb, height, width, 1)


def resize_bicubic(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """RGB8 (H, W, 3) → (height, width, 3), the pixels Pillow's BICUBIC resize gives."""
    return resize_pil(rgb, height, width, 3)


def resize_pil(rgb: np.ndarray, height: int, width: int, resample: int,
               rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> np.ndarray:
    """RGB8 (H, W, 3) → (height, width, 3), the pixels Pillow's resize gives with the filter
    `resample` (PIL's numbering: 1 Lanczos, 2 bilinear, 3 bicubic; see FILTERS).

    `rows` / `cols` (start, stop): only that window of the result, computed without the
    rest (a centre crop of a huge resize costs the crop, not the resize)."""
    if height < 1 or width < 1:
        raise ValueError(f"resize target must be positive, got {height}x{width}")
    if resample not in FILTERS:
        raise ValueError(f"resample {resample} is not one of Pillow's filters implemented here ({sorted(FILTERS)})")
    rows, cols = rows or (0, height), cols or (0, width)
    if not (0 <= rows[0] < rows[1] <= height and 0 <= cols[0] < cols[1] <= width):
        raise ValueError(f"window rows {rows} cols {cols} is not inside {height}x{width}")
    kernel, support = FILTERS[resample]

    def horizontal(img: np.ndarray) -> np.ndarray:  # an axis kept at its size is only cut
        return _resample_axis(img, width, 1, kernel, support, cols) if img.shape[1] != width \
            else img[:, cols[0]:cols[1]]

    def vertical(img: np.ndarray) -> np.ndarray:
        return _resample_axis(img, height, 0, kernel, support, rows) if img.shape[0] != height \
            else img[rows[0]:rows[1]]

    # Pillow 12's Image.resize: horizontal pass first, then vertical; but an image more than
    # 100 times taller than wide, shrunk in height, goes through the vertical pass first
    tall = rgb.shape[0] > rgb.shape[1] * 100 and height < rgb.shape[0]
    out = horizontal(vertical(rgb)) if tall else vertical(horizontal(rgb))
    return out.copy() if np.may_share_memory(out, rgb) else out  # never a view of the caller's image
