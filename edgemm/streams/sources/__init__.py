"""Video and image sources named by URI, in the style of jetson-inference's videoSource.

    csi://0                       MIPI CSI camera (nvarguscamerasrc; needs GStreamer)
    v4l2:///dev/video0            USB camera (also plain /dev/video0, or v4l2://0)
    rtsp://host/path?latency=200  network camera (GStreamer, else OpenCV's FFMPEG)
    clip.mp4  file:///data/clip   video file (.mp4 .mkv .avi .mov .webm .m4v, or any file://)
    photo.jpg                     one image
    frames/   'frames/*.png'      a folder of images, or a glob, in name order
    synthetic://?fps=10&seed=0    generated scenes with ground truth (demos, tests)

    with open_source("csi://0") as source:
        for frame in source:          # Frame: index, RGB image, capture_time, ...
            ...

Every source yields RGB uint8 frames (OpenCV's BGR is converted here, once).
Live sources (cameras, paced synthetic) keep producing frames whether or not anyone
is keeping up; downstream takes the latest frame. Files are read losslessly, frame by
frame, and `read()` returns None at their end. Cameras that fail to open or stop
delivering are reopened with exponential backoff (or, with `wait_for_camera=False`, a
camera that does not open at first is an error at once, as `edgemm stream` wants it).
A source reports whether it delivers to `on_health` (the daemon's stream state).

Checks that need a device or the file system (missing file, missing /dev/video node,
OpenCV without GStreamer) happen in `open()`, which `read()`, `with` and iteration
call for you; `check()` makes the ones that open nothing. `parse_uri` only rejects URIs
that are wrong as written. What no retry can fix (no GStreamer, or no such GStreamer
element, a path that is no camera, a device edgemm may not open, a synthetic frame over
the pixel limit) is a `SourceUnusable`; everything else may go away by itself.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from edgemm.model.image import DEFAULT_MAX_PIXELS
from edgemm.streams.sources.base import Source
from edgemm.streams.sources.capture import CsiSource, RtspSource, V4l2Source
from edgemm.streams.sources.files import ImageFilesSource, VideoFileSource
from edgemm.streams.sources.synthetic import (DEFAULT_MAX_SYNTHETIC_PIXELS, SYNTHETIC_SIZE, SyntheticSource,
                                              check_synthetic_size)
from edgemm.streams.sources.uri import SourceSpec, parse_uri

CSI_DEFAULTS = {"width": 1280, "height": 720, "fps": 30.0}


def open_source(uri: str, *, fps: float | None = None, width: int | None = None,
                height: int | None = None, latency_ms: int = 200, reconnect: bool = True,
                max_backoff_s: float = 8.0, max_reconnects: int | None = None,
                wait_for_camera: bool = True, max_pixels: int = DEFAULT_MAX_PIXELS,
                max_synthetic_pixels: int = DEFAULT_MAX_SYNTHETIC_PIXELS,
                sleep: Callable[[float], Any] | None = None,
                clock: Callable[[], float] = time.monotonic) -> Source:
    """The source for `uri`, not yet opened (`open()`, `with`, `read()` or iteration do).

    Options written in the URI (`csi://0?width=1920`, `rtsp://…?latency=50`) win over
    the keyword arguments, which are defaults for the whole command line or config.
    `wait_for_camera=False`: a camera that does not open at first is a SourceError from
    `open()` instead of being retried (one that opened and then stops is still retried).
    `max_pixels` bounds image files and synthetic frames, `max_synthetic_pixels` synthetic
    frames too (SourceUnusable here if over).
    """
    spec = parse_uri(uri)
    opts = spec.options
    retry = dict(reconnect=reconnect, max_backoff_s=max_backoff_s,
                 max_reconnects=max_reconnects, wait_for_camera=wait_for_camera, sleep=sleep)
    if spec.kind == "csi":
        size = {k: _pick(opts, k, given, CSI_DEFAULTS[k])
                for k, given in (("width", width), ("height", height), ("fps", fps))}
        return CsiSource(uri, int(spec.location), **size, **retry)
    if spec.kind == "v4l2":
        return V4l2Source(uri, spec.location, width=_pick(opts, "width", width),
                          height=_pick(opts, "height", height), fps=_pick(opts, "fps", fps),
                          **retry)
    if spec.kind == "rtsp":
        return RtspSource(uri, spec.location, latency_ms=_pick(opts, "latency", latency_ms),
                          backend=opts.get("backend", "auto"), **retry)
    if spec.kind == "video":
        return VideoFileSource(uri, spec.location)
    if spec.kind == "synthetic":
        return SyntheticSource(uri, fps=_pick(opts, "fps", fps, 0.0), seed=opts.get("seed", 0),
                               count=opts.get("count"), size=opts.get("size", SYNTHETIC_SIZE),
                               text_probability=opts.get("text", 0.5), hold=opts.get("hold", 1),
                               max_pixels=max_pixels,
                               max_synthetic_pixels=max_synthetic_pixels,
                               sleep=sleep, clock=clock)
    return ImageFilesSource(uri, spec.kind, spec.location, max_pixels=max_pixels)


def check_uri(uri: str, *, max_pixels: int = DEFAULT_MAX_PIXELS,
              max_synthetic_pixels: int = DEFAULT_MAX_SYNTHETIC_PIXELS) -> SourceSpec:
    """parse_uri, and the limits a URI can break as written: a synthetic `size` whose
    frames would be over `max_pixels` or `max_synthetic_pixels` (SourceUnusable). Opens
    and makes nothing."""
    spec = parse_uri(uri)
    if spec.kind == "synthetic":
        check_synthetic_size(uri, spec.options.get("size", SYNTHETIC_SIZE), max_pixels, max_synthetic_pixels)
    return spec


def _pick(options: dict[str, Any], name: str, given: Any, default: Any = None) -> Any:
    """URI option, else the keyword argument, else the default."""
    if name in options:
        return options[name]
    return default if given is None else given
