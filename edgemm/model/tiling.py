"""Idefics3 / SmolVLM image processing: resize, cut into tiles, append the global image.

What `Idefics3ImageProcessor` (transformers, Pillow backend) does for one image:

    resize so the longest edge is `longest_edge` (the other side even, aspect kept)
    → round each side up to a multiple of `tile` (the encoder's input side)
    → if larger than one tile: the rows x cols tiles, row by row, then the whole
      image squeezed to tile x tile (the "global image"); else just that one tile
    → x * rescale_factor, then (x - mean) / std, channels first

Every resize is Lanczos as Pillow does it (edgemm.model.resample), so the pixels
match the reference processor's. `longest_edge` is the knob the resolution tiers
turn: one tile (global image only), 2x2, up to the model's configured maximum.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgemm.model.resample import resize_lanczos

MAX_IMAGE_SIZE = 4096  # the processor's absolute cap on either side


@dataclass(frozen=True)
class TileLayout:
    resized: tuple[int, int]  # (h, w) after the longest-edge resize
    grid: tuple[int, int]  # (h, w) rounded up to tile multiples
    rows: int  # 0 and 0 when the image is a single tile (no split)
    cols: int

    @property
    def tiles(self) -> int:
        """Encoder images: the split tiles plus the global image, or just one."""
        return self.rows * self.cols + 1 if self.rows else 1


def _longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """Longest side → longest_edge, the other by the aspect ratio, made even."""
    aspect = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    # then below the processor's absolute maximum, truncating as it does
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both sides rounded up to multiples of `tile`, the short side via the aspect ratio."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def tile_layout(height: int, width: int, longest_edge: int, tile: int) -> TileLayout:
    """How an image of height x width is cut at this longest edge (no pixels touched)."""
    resized = _longest_edge_size(height, width, longest_edge)
    grid = _tile_multiple_size(*resized, tile)
    if grid[0] > tile or grid[1] > tile:
        return TileLayout(resized, grid, grid[0] // tile, grid[1] // tile)
    return TileLayout(resized, grid, 0, 0)


def tile_pixels(rgb: np.ndarray, longest_edge: int, tile: int, rescale: float,
                mean: Sequence[float], std: Sequence[float]) -> tuple[np.ndarray, TileLayout]:
    """RGB8 (H, W, 3) → float32 [tiles, 3, tile, tile] and the layout that produced it."""
    layout = tile_layout(rgb.shape[0], rgb.shape[1], longest_edge, tile)
    image = resize_lanczos(rgb, *layout.resized)
    image = resize_lanczos(image, *layout.grid)
    if layout.rows:
        crops = [image[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]
                 for r in range(layout.rows) for c in range(layout.cols)]
        crops.append(resize_lanczos(image, tile, tile))
    else:
        crops = [image]
    tiles = np.stack(crops).transpose(0, 3, 1, 2)  # [T, 3, tile, tile]
    # as transformers: rescale in float64, store float32, normalise in float32
    x = (tiles.astype(np.float64) * rescale).astype(np.float32)
    mean32 = np.asarray(mean, np.float32)[None, :, None, None]
    std32 = np.asarray(std, np.float32)[None, :, None, None]
    return (x - mean32) / std32, layout
