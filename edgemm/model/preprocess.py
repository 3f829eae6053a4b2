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
    std = np.asarray(std, np.float32)
    scale = (1 / (255 * std))[:, None, None]
    offset = (-np.asarray(mean, np.float32) / std)[:, None, None]
    out = np.empty((1, 3, height, width), np.float32)
    # numpy's multiply converts, transposes (HWC → CHW) and scales in one pass straight into
    # the output; the add is a second, in place. cv2.dnn.blobFromImage does it all in one
    # C++ call but splits it over OpenCV's threads, and when onnxruntime has the other cores
    # busy those threads wait their turn: 0.9 ms against 0.13 ms on a loaded 2-core machine.
    np.multiply(resize_rgb(rgb, height, width).transpose(2, 0, 1), scale, out=out[0])
    out[0] += offset
    return out
