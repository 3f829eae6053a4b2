"""Files read losslessly, frame by frame: a video file, one image, a folder's or a glob's images."""
from __future__ import annotations

import glob
import os
import stat
from typing import Any

from edgemm.model.image import DEFAULT_MAX_PIXELS, load_image
from edgemm.streams.errors import SourceError, SourceUnusable
from edgemm.streams.sources.base import Frame, Source
from edgemm.streams.sources.capture import CaptureSource, video_capture
from edgemm.streams.sources.uri import IMAGE_EXTENSIONS
from edgemm.util.files import file_kind
from edgemm.util.opencv import cv2


class VideoFileSource(CaptureSource):
    """A video file, every frame in order; read() returns None at its end."""

    def __init__(self, uri: str, path: str):
        super().__init__(uri, live=False, reconnect=False)
        self.path = path
        self._fps = 0.0

    @property
    def fps(self) -> float:
        """The file's nominal frame rate, once open (0 when it does not say): `--view`'s output rate."""
        return self._fps

    def _preflight(self) -> None:
        require_regular_file(self.path)

    def _open_capture(self) -> Any | None:
        capture = video_capture(self.path, cv2.CAP_ANY)
        if capture is None:
            raise SourceError(f"could not open video {self.path} "
                              "(unsupported format or codec, or a corrupt file)")
        self._fps = capture.get(cv2.CAP_PROP_FPS) or 0.0
        return capture

    def _media_time(self) -> float | None:
        """The frame's timestamp in the file, in seconds (after read(): the frame read's)."""
        msec = self._capture.get(cv2.CAP_PROP_POS_MSEC)
        if msec > 0 or self._next_index == 0:
            return msec / 1e3
        # a backend that keeps no timestamps: the nominal frame rate, else none
        return self._next_index / self._fps if self._fps > 0 else None


def require_regular_file(path: str) -> None:
    """SourceError unless `path` is a regular file: a FIFO or a device would block the
    open (or never end), and is not a video or an image. Asked of stat, never by opening."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise SourceError(f"no such file or folder: {path}") from None
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        hint = f"; for a camera use v4l2://{path}" if stat.S_ISCHR(mode) else ""
        raise SourceUnusable(f"{path} is not a regular file: it is {file_kind(mode)}{hint}")


class ImageFilesSource(Source):
    """One image file, a folder's images or a glob's images, in name order.

    A file that will not decode raises its ImageError (naming the file) from read();
    the source has moved past it, so the caller may read on or stop.
    """

    def __init__(self, uri: str, kind: str, location: str, *,
                 max_pixels: int = DEFAULT_MAX_PIXELS):
        super().__init__(uri, live=False)
        self.kind = kind            # "image", "folder" or "glob"
        self.location = location
        self.max_pixels = max_pixels
        self.paths: list[str] = []
        self._position = 0

    def _open(self) -> None:
        self.paths = _image_paths(self.kind, self.location)

    def _next_frame(self) -> Frame | None:
        if self._position >= len(self.paths):
            return None
        path = self.paths[self._position]
        self._position += 1
        image = load_image(path, max_pixels=self.max_pixels)
        # A glob may span folders, so its frames keep the path as matched.
        name = path if self.kind == "glob" else os.path.basename(path)
        return self._frame(image, name=name)


def _image_paths(kind: str, location: str) -> list[str]:
    if kind == "glob":
        paths = [p for p in sorted(glob.glob(location)) if _is_image_file(p)]
        if not paths:
            raise SourceError(f"no images match {location}")
        return paths
    if kind == "image":
        require_regular_file(location)
        return [location]
    if not os.path.exists(location):
        raise SourceError(f"no such file or folder: {location}")
    # Hidden files are skipped, as glob does: macOS leaves "._photo.jpg" companions.
    names = [n for n in sorted(os.listdir(location)) if not n.startswith(".")]
    paths = [p for p in (os.path.join(location, n) for n in names) if _is_image_file(p)]
    if not paths:
        raise SourceError(f"no images in folder {location}")
    return paths


def _is_image_file(path: str) -> bool:
    return path.lower().endswith(IMAGE_EXTENSIONS) and os.path.isfile(path)
