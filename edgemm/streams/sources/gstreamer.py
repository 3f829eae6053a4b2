"""GStreamer through OpenCV: whether it is there, which elements it has, and the pipelines
edgemm opens cameras with (csi://, rtsp://)."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
import shutil
import subprocess
from fractions import Fraction
from typing import Any

from edgemm.streams.errors import SourceUnusable
from edgemm.streams.sources.uri import redact_uri
from edgemm.util.opencv import cv2

# Bounded waits so a dead network camera is noticed and reconnected, not waited on forever.
FFMPEG_OPEN_TIMEOUT_MS = 10_000
FFMPEG_READ_TIMEOUT_MS = 5_000
GST_INSPECT_TIMEOUT_S = 10.0  # gst-inspect's first run scans the plugins; bounded all the same


@functools.lru_cache(maxsize=1)
def gstreamer_available() -> bool:
    """Whether this OpenCV was built with GStreamer (pip wheels are not; JetPack's is)."""
    found = re.search(r"^\s*GStreamer:\s*(\S+)", cv2.getBuildInformation(), re.MULTILINE)
    return found is not None and found.group(1).upper().startswith("YES")


@functools.lru_cache(maxsize=64)
def gstreamer_element_exists(name: str) -> bool | None:
    """Whether GStreamer has the element `name` (e.g. nvarguscamerasrc); None if this
    machine has no way to ask (no libgstreamer, no gst-inspect-1.0): the open then decides.

    Asked before OpenCV opens a pipeline: OpenCV only says "could not open" when an
    element is missing, with the cause in its log, and OpenCV 4.6 (Debian 12's) never
    returns from opening the CSI pipeline without nvarguscamerasrc.
    """
    registry = _gstreamer_registry()
    if registry is not None:
        factory = registry.gst_element_factory_find(name.encode())
        if factory:
            registry.gst_object_unref(factory)
        return bool(factory)
    tool = shutil.which("gst-inspect-1.0")
    if tool is None:
        return None
    try:
        return subprocess.run([tool, "--exists", name], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=GST_INSPECT_TIMEOUT_S).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None


@functools.lru_cache(maxsize=1)
def _gstreamer_registry() -> Any | None:
    """libgstreamer-1.0, initialised, through ctypes: the library OpenCV's GStreamer backend
    uses, in this process, so it sees the same plugins (None if it cannot be loaded)."""
    path = ctypes.util.find_library("gstreamer-1.0")
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)
        library.gst_init_check.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        library.gst_init_check.restype = ctypes.c_int
        library.gst_element_factory_find.argtypes = [ctypes.c_char_p]
        library.gst_element_factory_find.restype = ctypes.c_void_p
        library.gst_object_unref.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return library if library.gst_init_check(None, None, None) else None


def pipeline_elements(pipeline: str) -> list[str]:
    """The element names of a gst-launch style pipeline, without caps ("video/x-raw, …")."""
    parts = (part.strip().split(maxsplit=1) for part in pipeline.split("!"))
    return [words[0] for words in parts if words and "/" not in words[0]]


def check_pipeline(shown: str, pipeline: str) -> None:
    """SourceUnusable when OpenCV lacks GStreamer or GStreamer lacks one of the pipeline's
    elements (a csi:// camera off a Jetson, a JetPack without its camera plugins)."""
    if not gstreamer_available():
        raise SourceUnusable(_needs_gstreamer(shown))
    missing = [e for e in pipeline_elements(pipeline) if gstreamer_element_exists(e) is False]
    if missing:
        raise SourceUnusable(f"{shown}: GStreamer has no element {', '.join(missing)} "
                             f"({_element_hint(missing[0])})")


def _element_hint(element: str) -> str:
    if element.startswith("nv"):
        return "NVIDIA's GStreamer plugins come with JetPack, on a Jetson only"
    return "install the GStreamer plugin package that provides it"


def csi_pipeline(sensor_id: int, width: int = 1280, height: int = 720,
                 fps: float = 30.0) -> str:
    """Argus camera → NVMM → nvvidconv (hardware) to BGRx → BGR for OpenCV.

    The appsink keeps only the newest buffer, so a slow reader sees fresh frames.
    """
    return (f"nvarguscamerasrc sensor-id={sensor_id} ! "
            f"video/x-raw(memory:NVMM), width={width}, height={height}, "
            f"framerate={_framerate(fps)} ! "
            "nvvidconv ! video/x-raw, format=BGRx ! "
            "videoconvert ! video/x-raw, format=BGR ! "
            "appsink drop=true max-buffers=1")


def rtsp_pipeline(location: str, latency_ms: int = 200) -> str:
    """rtspsrc with a bounded jitter buffer (`latency`), any codec, newest frame only."""
    return (f'rtspsrc location="{location}" latency={latency_ms} ! decodebin ! '
            "videoconvert ! video/x-raw,format=BGR ! appsink drop=true max-buffers=1")


def rtsp_capture_args(location: str, latency_ms: int, backend: str,
                      gstreamer: bool) -> tuple[str, int, list[int]]:
    """(target, OpenCV backend, open params) for cv2.VideoCapture on an RTSP URL."""
    if backend == "gstreamer" or (backend == "auto" and gstreamer):
        if not gstreamer:
            raise SourceUnusable(_needs_gstreamer(redact_uri(location)))
        return rtsp_pipeline(location, latency_ms), cv2.CAP_GSTREAMER, []
    return location, cv2.CAP_FFMPEG, _ffmpeg_timeouts()


def _framerate(fps: float) -> str:
    """GStreamer wants a fraction: 30 → 30/1, 29.97 → 2997/100."""
    rate = Fraction(fps).limit_denominator(1001)
    return f"{rate.numerator}/{rate.denominator}"


def _ffmpeg_timeouts() -> list[int]:
    # The constants exist from OpenCV 4.6 (JetPack 5 ships 4.5); without them, OpenCV's
    # defaults apply. FFMPEG refuses unknown open params, so pass only these.
    names = ("CAP_PROP_OPEN_TIMEOUT_MSEC", "CAP_PROP_READ_TIMEOUT_MSEC")
    if not all(hasattr(cv2, n) for n in names):
        return []
    return [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, FFMPEG_OPEN_TIMEOUT_MS,
            cv2.CAP_PROP_READ_TIMEOUT_MSEC, FFMPEG_READ_TIMEOUT_MS]


def _needs_gstreamer(uri: str) -> str:
    return (f"{uri} needs OpenCV built with GStreamer (this OpenCV has none; "
            "on a Jetson use JetPack's python3-opencv)")
