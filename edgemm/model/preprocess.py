"""Image → pixel_values: the one place that decides how pixels reach the encoder.

Training, calibration and the runtime all go through `to_pixel_values`, so the
model never sees pixels prepared differently from the ones it was trained on.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgemm.util.opencv import cv2


def resize_rgb(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize an RGB8 image to (height, width): area filter down, linear up."""
    if rgb.shape[0] == height and rgb.shape[1] == width:
        return rgb
    shrinking = rgb.shape[0] * rgb.shape[1] > height * width
    interp = cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
    return cv2.resize(rgb, (width, height), interpolation=interp)


def to_pixel_values(rgb: np.ndarray, height: int, width: int,
                    mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """RGB8 (H, W, 3) → float32 (1, 3, height, width), normalised per channel:
    (x / 255 - mean) / std, computed as one scale and one offset per channel."""
    out = np.empty((1, 3, height, width), np.float32)
    # per channel, OpenCV's addWeighted converts and applies x * scale + offset in one pass,
    # straight into that channel's plane of the output: 0.13 ms at 256 px, against 0.2 ms for
    # the same in numpy and 0.9 ms for cv2.dnn.blobFromImage when other work keeps the cores
    # busy (it splits its work over OpenCV's threads, which then wait their turn)
    planes = cv2.split(resize_rgb(rgb, height, width))
    for c, (plane, m, s) in enumerate(zip(planes, mean, std)):
        scale = 1 / (255 * float(s))
        cv2.addWeighted(plane, scale, plane, 0.0, -float(m) / float(s), dst=out[0, c], dtype=cv2.CV_32F)
    return out


def rescale_normalize(image: np.ndarray, rescale: float, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 [H, W, 3] → float32 [1, 3, H, W] as transformers' PIL backend computes it:
    rescale in float64, store float32, normalise in float32."""
    x = (image.transpose(2, 0, 1)[None].astype(np.float64) * rescale).astype(np.float32)
    return (x - np.asarray(mean, np.float32)[None, :, None, None]) / np.asarray(std, np.float32)[None, :, None, None]
