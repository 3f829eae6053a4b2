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

import ctypes
import ctypes.util
import functools
import glob
import logging
import math
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from edgemm.util.backoff import Backoff
from edgemm.config import MAX_FPS, MIN_FPS
from edgemm.errors import InputError
from edgemm.util.files import file_kind
from edgemm.model.image import DEFAULT_MAX_PIXELS, load_image
from edgemm.util.opencv import cv2

__all__ = [
    "SourceError", "SourceUnusable", "Frame", "SourceSpec", "SourceStats", "Source", "CaptureSource",
    "CsiSource", "V4l2Source", "RtspSource", "VideoFileSource", "ImageFilesSource",
    "SyntheticSource", "open_source", "parse_uri", "check_uri", "network_address", "gstreamer_available",
    "csi_pipeline", "rtsp_pipeline", "rtsp_capture_args",
]

log = logging.getLogger(__name__)

KINDS = ("csi", "v4l2", "rtsp", "video", "image", "folder", "glob", "synthetic")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif")
VIDEO_EXTENSIONS = (".mp4", ".mkv", ".avi", ".mov", ".webm", ".m4v")
SUPPORTED = ("csi://N, v4l2:///dev/videoN, rtsp://host/path, file://PATH, synthetic://, "
             "or a video file, image file, folder or glob")

CSI_DEFAULTS = {"width": 1280, "height": 720, "fps": 30.0}
SYNTHETIC_SIZE = 256  # synthetic:// scenes' side in pixels unless ?size= says otherwise
# limits.max_synthetic_pixels' default. A synthetic frame is generated, not decoded, so the decode
# budget never sees it, and a 5000² scene (25 MP, within limits.max_pixels) took a daemon to
# ~900 MB per stream: 4 MP (2000²) keeps one stream's frames in flight to tens of MB
DEFAULT_MAX_SYNTHETIC_PIXELS = 4_000_000
FIRST_BACKOFF_S = 0.5
# Bounded waits so a dead network camera is noticed and reconnected, not waited on forever.
FFMPEG_OPEN_TIMEOUT_MS = 10_000
FFMPEG_READ_TIMEOUT_MS = 5_000
V4L2_MAJOR = 81  # Linux's character-device major number of every V4L2 node (linux/major.h)
GST_INSPECT_TIMEOUT_S = 10.0  # gst-inspect's first run scans the plugins; bounded all the same


class SourceError(InputError):
    """A source that cannot be opened or read; str(e) is one line for the user."""


class SourceUnusable(SourceError):
    """A source that no retry can fix (the daemon's stream goes to `failed`, not `retrying`)."""


@dataclass
class Frame:
    index: int               # 0-based number of this frame from its source
    image: np.ndarray        # RGB uint8 (H, W, 3)
    capture_time: float      # time.time() when it was captured (wall clock)
    source: str              # the source URI (credentials masked)
    truth: object | None = None  # the edgemm.model.scenes.Scene for synthetic frames
    name: str | None = None      # file name, for image files, folders and globs
    media_time: float | None = None  # seconds into a video file (its timestamp); None when live


@dataclass
class SourceSpec:
    """A parsed source URI.

    `location` is what the kind opens: sensor number, device node, the RTSP URL
    without edgemm's own options, a path or a glob pattern. `options` are edgemm's
    options from the query string, typed (`fps=10` → {"fps": 10.0}).
    """
    kind: str                # one of KINDS
    location: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class SourceStats:
    frames: int = 0       # frames delivered
    reconnects: int = 0   # reopen attempts after a failure, over the source's life
    last_error: str | None = None  # why it last failed to open or deliver


# ---- opening a source by URI ----------------------------------------------------------

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


RTSP_PORTS = {"rtsp": 554, "rtsps": 322}  # the schemes' registered ports, when the URI gives none


def network_address(uri: str) -> tuple[str, int] | None:
    """The (host in lower case, port) a network source connects to (rtsp://, rtsps://), None for
    a local one (a camera, a file, synthetic scenes); SourceError if the URI is malformed."""
    spec = parse_uri(uri)
    if spec.kind != "rtsp":
        return None
    parts = urllib.parse.urlsplit(spec.location)
    try:
        port = parts.port
    except ValueError as e:  # _rtsp_spec checked the port; this is the same check, never a crash
        raise SourceError(f"{redact_uri(uri)}: not a valid rtsp:// address ({str(e).lower()})") from None
    return (parts.hostname or "").lower(), port or RTSP_PORTS[parts.scheme.lower()]


def check_uri(uri: str, *, max_pixels: int = DEFAULT_MAX_PIXELS,
              max_synthetic_pixels: int = DEFAULT_MAX_SYNTHETIC_PIXELS) -> SourceSpec:
    """parse_uri, and the limits a URI can break as written: a synthetic `size` whose
    frames would be over `max_pixels` or `max_synthetic_pixels` (SourceUnusable). Opens
    and makes nothing."""
    spec = parse_uri(uri)
    if spec.kind == "synthetic":
        _check_synthetic_size(uri, spec.options.get("size", SYNTHETIC_SIZE), max_pixels, max_synthetic_pixels)
    return spec


def _check_synthetic_size(uri: str, size: int, max_pixels: int, max_synthetic_pixels: int) -> None:
    # refused before a frame is made: a frame is size² × 3 bytes, several in flight per stream
    for limit, name in ((max_pixels, "limits.max_pixels"), (max_synthetic_pixels, "limits.max_synthetic_pixels")):
        if size * size > limit:
            raise SourceUnusable(f"{redact_uri(uri)}: size {size} makes {size * size} pixels per frame, "
                                 f"above {name} ({limit})")


def _pick(options: dict[str, Any], name: str, given: Any, default: Any = None) -> Any:
    """URI option, else the keyword argument, else the default."""
    if name in options:
        return options[name]
    return default if given is None else given


# ---- parsing URIs ---------------------------------------------------------------------

@dataclass(frozen=True)
class _Option:
    type: type                       # int, float or str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    least_positive: float | None = None  # a value above 0 is at least this (0 itself keeps its meaning)


_OPTIONS = {
    # fps 0 is "as fast as possible"; a tiny one (1e-320) would make a frame interval of inf
    "fps": _Option(float, minimum=0, maximum=MAX_FPS, least_positive=MIN_FPS),
    "width": _Option(int, minimum=1),
    "height": _Option(int, minimum=1),
    "latency": _Option(int, minimum=0),
    "backend": _Option(str, choices=("auto", "gstreamer", "ffmpeg")),
    "seed": _Option(int, minimum=0),
    "count": _Option(int, minimum=0),
    "size": _Option(int, minimum=32),   # smaller scenes have no room for their shapes
    "text": _Option(float, minimum=0, maximum=1),
    "hold": _Option(int, minimum=1, maximum=1_000_000),  # synthetic: frames each scene lasts
}
# The options each URI kind takes. For rtsp these are edgemm's own and are removed from
# the URL handed to the camera; the camera's own query parameters pass through untouched.
_KIND_OPTIONS = {
    "csi": ("width", "height", "fps"),
    "v4l2": ("width", "height", "fps"),
    "rtsp": ("latency", "backend"),
    "synthetic": ("fps", "seed", "count", "size", "text", "hold"),
}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
_GLOB_CHARS = re.compile(r"[*?\[]")


def parse_uri(uri: str) -> SourceSpec:
    """Split a source URI into kind, location and typed options; SourceError if malformed.

    Plain paths are classified by extension (or as a folder if one exists there);
    whether a file exists is checked when the source is opened.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise SourceError(f"source URI is empty (expected {SUPPORTED})")
    match = _SCHEME.match(uri)
    if match is None:
        if uri.startswith("/dev/video"):
            return SourceSpec("v4l2", uri)
        return _path_spec(uri, from_file_uri=False)
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "csi":
        return _csi_spec(uri, rest)
    if scheme == "v4l2":
        return _v4l2_spec(uri, rest)
    if scheme in ("rtsp", "rtsps"):
        return _rtsp_spec(uri, rest)
    if scheme == "file":
        return _path_spec(rest, from_file_uri=True)
    if scheme == "synthetic":
        return _synthetic_spec(uri, rest)
    raise SourceError(f"unknown source scheme {scheme}:// in {redact_uri(uri)} "
                      f"(supported: {SUPPORTED})")


def _csi_spec(uri: str, rest: str) -> SourceSpec:
    sensor, query = _split_query(rest)
    if not sensor.isdigit():
        raise SourceError(f"{uri}: csi:// needs a sensor number, e.g. csi://0")
    return SourceSpec("csi", str(int(sensor)), _parse_options(uri, "csi", query))


def _v4l2_spec(uri: str, rest: str) -> SourceSpec:
    device, query = _split_query(rest)
    if device.isdigit():  # v4l2://0, as OpenCV numbers cameras
        device = f"/dev/video{int(device)}"
    if not device.startswith("/"):
        raise SourceError(f"{uri}: v4l2:// needs a device node, e.g. v4l2:///dev/video0")
    return SourceSpec("v4l2", device, _parse_options(uri, "v4l2", query))


def _rtsp_spec(uri: str, rest: str) -> SourceSpec:
    address, query = _split_query(rest)
    if not uri.isprintable() or any(c in uri for c in ' "\\'):
        # a URL percent-encodes these; a quote would end rtspsrc's location="…" in the GStreamer
        # pipeline, and what follows it would be pipeline elements of the client's choosing
        raise SourceError(f"{redact_uri(uri)}: an rtsp:// URI has no spaces, quotes, backslashes or control "
                          "characters (percent-encode them)")
    authority = address.split("/", 1)[0]
    if "#" in uri or authority.count("@") > 1:
        # GStreamer's RTSP URL parser takes the first @ and reads past a #, Python's and FFmpeg's
        # the last @ and stop at #: the host checked (server.source_hosts) must be the one reached
        raise SourceError(f"{redact_uri(uri)}: an rtsp:// URI has at most one @ (user:password@host) and no #")
    host = authority.rpartition("@")[2]
    if not host:
        raise SourceError(f"{redact_uri(uri)}: rtsp:// needs a host, e.g. rtsp://192.168.1.10/stream")
    try:  # a port out of 1..65535 or not a number, a bracket left open: refused now, not retried for ever
        port = urllib.parse.urlsplit("rtsp://" + host).port
    except ValueError as e:
        raise SourceError(f"{redact_uri(uri)}: not a valid rtsp:// address ({str(e).lower()})") from None
    if port == 0:
        raise SourceError(f"{redact_uri(uri)}: not a valid rtsp:// address (port 0)")
    ours = [p for p in query.split("&") if p.split("=", 1)[0] in _KIND_OPTIONS["rtsp"]]
    theirs = [p for p in query.split("&") if p and p not in ours]
    location = uri[:len(uri) - len(rest)] + address + ("?" + "&".join(theirs) if theirs else "")
    return SourceSpec("rtsp", location, _parse_options(redact_uri(uri), "rtsp", "&".join(ours)))


def _synthetic_spec(uri: str, rest: str) -> SourceSpec:
    path, query = _split_query(rest)
    if path.strip("/"):
        raise SourceError(f"{uri}: synthetic:// takes only options, "
                          "e.g. synthetic://?fps=10&seed=0")
    return SourceSpec("synthetic", "", _parse_options(uri, "synthetic", query))


def _path_spec(path: str, from_file_uri: bool) -> SourceSpec:
    if not path:
        raise SourceError(f"file:// needs a path (expected {SUPPORTED})")
    if os.path.isdir(path):
        return SourceSpec("folder", path)
    if _GLOB_CHARS.search(path) and not os.path.exists(path):
        return SourceSpec("glob", path)
    extension = os.path.splitext(path)[1].lower()
    if extension in VIDEO_EXTENSIONS:
        return SourceSpec("video", path)
    if extension in IMAGE_EXTENSIONS:
        return SourceSpec("image", path)
    if from_file_uri:  # file:// says "a file": let OpenCV try it as a video
        return SourceSpec("video", path)
    if not os.path.exists(path):
        raise SourceError(f"no such file or folder: {path}")
    raise SourceError(f"don't know how to read {path}: expected an image "
                      f"({' '.join(IMAGE_EXTENSIONS)}), a video ({' '.join(VIDEO_EXTENSIONS)}), "
                      "a folder or a glob")


def _split_query(rest: str) -> tuple[str, str]:
    before, _, query = rest.partition("?")
    return before, query


def _parse_options(uri: str, kind: str, query: str) -> dict[str, Any]:
    """`fps=10&seed=0` → {"fps": 10.0, "seed": 0}, refusing unknown, repeated or bad values."""
    allowed = _KIND_OPTIONS[kind]
    options: dict[str, Any] = {}
    for pair in filter(None, query.split("&")):
        name, _, text = pair.partition("=")
        if name not in allowed:
            raise SourceError(f"{uri}: unknown option {name!r} for {kind}:// "
                              f"(known: {', '.join(sorted(allowed))})")
        if name in options:
            raise SourceError(f"{uri}: option {name!r} is given twice")
        options[name] = _option_value(uri, name, text)
    return options


def _option_value(uri: str, name: str, text: str) -> Any:
    option = _OPTIONS[name]
    if option.choices:
        if text not in option.choices:
            raise SourceError(f"{uri}: option {name} must be one of "
                              f"{', '.join(option.choices)}, got {text!r}")
        return text
    try:
        value = option.type(text)
    except ValueError:
        kind = "an integer" if option.type is int else "a number"
        raise SourceError(f"{uri}: option {name} must be {kind}, got {text!r}") from None
    low = -math.inf if option.minimum is None else option.minimum
    high = math.inf if option.maximum is None else option.maximum
    too_small = option.least_positive is not None and 0 < value < option.least_positive
    if not (low <= value <= high) or not math.isfinite(value) or too_small:
        bounds = f"between {low:g} and {high:g}" if option.maximum is not None else f">= {low:g}"
        if option.least_positive is not None:
            bounds = f"0 or between {option.least_positive:g} and {high:g}"
        raise SourceError(f"{uri}: option {name} must be {bounds}, got {text!r}")
    return value


# what may follow the @ that ends the user info: a host (a name, an address, [an IPv6 one]) and a port
_HOST_PORT = re.compile(r"(\[[^\]/?#@]*\]|[A-Za-z0-9._~%-]*)(:[0-9]*)?(?=[/?#]|$)")
# a query's password, as cheap cameras take it (rtsp://cam/live?user=admin&password=…), any case
_QUERY_SECRET = re.compile(r"([?&;](?:password|passwd|pass|pwd)=)[^&]*", re.IGNORECASE)


def redact_uri(uri: str) -> str:
    """The URI with what could be a secret as ***, for logs, errors and JSON output:
    rtsp://user:secret@cam/ → rtsp://***@cam/, ?password=secret → ?password=***.

    The user info is everything up to the last @ that a host (and port) follows, whatever it
    holds. A password is often left unescaped, and the parsers disagree on where it ends:
    urllib and FFmpeg (OpenCV) end the authority at the first /, ? or #, GStreamer's rtspsrc at
    the first / or ? and takes the first @; so rtsp://admin:p@ss/w?rd#1@cam/live could mean a
    password up to any of them, and all of it is hidden. A URI without @ keeps its host and path."""
    match = _SCHEME.match(uri)
    if match is None:
        return uri
    rest = match.group(2)
    ats = [i for i, c in enumerate(rest) if c == "@"]
    if ats:
        before_host = [i for i in ats if _HOST_PORT.match(rest, i + 1)]
        rest = "***" + rest[(before_host or ats)[-1]:]
    return uri[:match.start(2)] + _QUERY_SECRET.sub(r"\1***", rest)


# ---- GStreamer pipelines --------------------------------------------------------------

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


def _check_pipeline(shown: str, pipeline: str) -> None:
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


# ---- the source interface -------------------------------------------------------------

class Source:
    """A stream of RGB frames. Subclasses implement `_open`, `_next_frame`, `_close`.

    `read()` may be called from one thread while another calls `close()`: close cuts
    a backoff wait short, never waits for a camera call under way (the reader releases the
    capture when that call returns), and later reads return None. A closed source stays closed.

    `on_health`, if set, is called from the reading thread with the reason each time
    the source fails to open or deliver (and retries), and with None when it delivers
    a frame after not delivering (its first frame, or the first after a failure).
    """

    def __init__(self, uri: str, *, live: bool, sleep: Callable[[float], Any] | None = None):
        self.uri = uri
        self.live = live
        self.stats = SourceStats()
        self._shown = redact_uri(uri)
        self._closed = threading.Event()
        # Default wait: an Event, so close() wakes a reader sleeping in a backoff.
        self._sleep = sleep if sleep is not None else self._closed.wait
        self._lock = threading.Lock()  # one cv2 call at a time: never release mid-read
        self._opened = False
        self._next_index = 0
        self.on_health: Callable[[str | None], Any] | None = None
        self._delivering = False

    def check(self) -> None:
        """The checks that open nothing (no device, no network, no file's content): raise
        SourceUnusable for what no retry fixes, SourceError for what is wrong now."""

    def open(self) -> None:
        try:
            with self._lock:
                self._ensure_open()
        finally:
            self._release_if_closed()

    def read(self) -> Frame | None:
        """The next frame; None at the end of a file (or once closed)."""
        if self._closed.is_set():
            return None  # without the lock: another reader may be stuck in a camera call
        try:
            with self._lock:
                if self._closed.is_set():
                    return None
                self._ensure_open()
                frame = self._next_frame()
                return None if self._closed.is_set() else frame  # closed meanwhile: nothing more
        finally:
            self._release_if_closed()

    def close(self) -> None:
        """Mark the source closed, and release what it holds unless a reader is in a call to
        it (an RTSP open or read can block for many seconds inside FFmpeg or GStreamer): that
        reader releases it as its call returns. Never waits, so the event loop may call it."""
        self._closed.set()
        self._release_if_closed()

    def _release_if_closed(self) -> None:
        # close() marks before trying the lock, a reader tries it after leaving it: whichever
        # comes second finds the lock free and the mark set, so the capture is always released
        if self._closed.is_set() and self._lock.acquire(blocking=False):
            try:
                self._close()
            finally:
                self._lock.release()

    def __enter__(self) -> Source:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Frame]:
        while (frame := self.read()) is not None:
            yield frame

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._shown!r}, live={self.live})"

    def _ensure_open(self) -> None:
        if not self._opened:
            self._open()
            self._opened = True

    def _frame(self, image: np.ndarray, truth: object | None = None,
               name: str | None = None, media_time: float | None = None) -> Frame:
        """Stamp a captured image with its number, time and source."""
        frame = Frame(self._next_index, image, time.time(), self._shown, truth, name, media_time)
        self._next_index += 1
        self.stats.frames += 1
        if not self._delivering:
            self._delivering = True
            self._report(None)
        return frame

    def _failing(self, reason: str) -> None:
        """The source could not open or deliver, and will try again."""
        self._delivering = False
        self.stats.last_error = reason
        self._report(reason)

    def _report(self, reason: str | None) -> None:
        if self.on_health is not None:
            self.on_health(reason)

    def _open(self) -> None:
        pass

    def _next_frame(self) -> Frame | None:
        raise NotImplementedError

    def _close(self) -> None:
        pass


# ---- OpenCV captures: cameras and video files -----------------------------------------

class CaptureSource(Source):
    """Frames from a cv2.VideoCapture-like object.

    Subclasses override `_open_capture()` (a capture, or None if it could not open
    now) and, if needed, `_grab()` (a BGR image, or None), `_preflight()` (raise
    SourceUnusable for what no retry can fix, SourceError for what is wrong now) and
    `_media_time()`. A live source that fails to open or to deliver a frame is reopened
    after 0.5, 1, 2, 4 … s (capped at max_backoff_s); the backoff restarts after the
    next good frame. A non-live source ends instead. With `wait_for_camera=False` a
    camera that does not open the first time is a SourceError from `open()`.
    """
    open_hint = ""  # what to check when the camera does not open, e.g. " (is it plugged in?)"

    def __init__(self, uri: str, *, live: bool, reconnect: bool = True,
                 max_backoff_s: float = 8.0, max_reconnects: int | None = None,
                 wait_for_camera: bool = True, sleep: Callable[[float], Any] | None = None):
        super().__init__(uri, live=live, sleep=sleep)
        self.reconnect = reconnect
        self.max_backoff_s = max_backoff_s
        self.max_reconnects = max_reconnects
        self.wait_for_camera = wait_for_camera
        self._capture: Any = None
        self._retry = Backoff(FIRST_BACKOFF_S, max_backoff_s)  # counts failed reconnects since the last good frame

    def check(self) -> None:
        self._preflight()

    def _preflight(self) -> None:
        pass

    def _open_capture(self) -> Any | None:
        raise NotImplementedError

    def _grab(self) -> np.ndarray | None:
        ok, image = self._capture.read()
        return image if ok and image is not None and image.size else None

    def _media_time(self) -> float | None:
        return None

    def _open(self) -> None:
        self._preflight()
        self._capture = self._open_capture()
        if self._capture is None:
            reason = f"could not open camera {self._shown}{self.open_hint}"
            if not (self.live and self.reconnect and self.wait_for_camera):
                raise SourceError(reason)
            self._failing(reason)  # a live camera that is not up yet is retried by the first read()

    def _next_frame(self) -> Frame | None:
        while not self._closed.is_set():
            image = self._grab() if self._capture is not None else None
            if image is not None:
                self._retry.reset()
                return self._frame(_to_rgb(image), media_time=self._media_time())
            if not self.live:
                return None  # end of a video file
            self._reconnect()
        return None

    def _reconnect(self) -> None:
        if not self.reconnect:
            raise SourceError(f"camera {self._shown} disconnected")
        if self.max_reconnects is not None and self._retry.failures >= self.max_reconnects:
            raise SourceError(f"camera {self._shown} disconnected; "
                              f"gave up after {self._retry.failures} reconnects")
        delay = self._retry.delay()
        reason = (f"camera {self._shown} delivers no frames" if self._capture is not None
                  else f"could not open camera {self._shown}{self.open_hint}")
        self._failing(reason)
        log.warning("%s; reconnecting in %.1f s", reason, delay)
        self._close()
        self._sleep(delay)
        self._retry.next()  # counted after the wait, as max_reconnects counts reconnects made
        self.stats.reconnects += 1
        if not self._closed.is_set():
            self._capture = self._open_capture()

    def _close(self) -> None:
        if self._capture is not None and hasattr(self._capture, "release"):
            self._capture.release()
        self._capture = None


class CsiSource(CaptureSource):
    """A MIPI CSI camera through nvarguscamerasrc (Jetson only)."""

    def __init__(self, uri: str, sensor_id: int, *, width: int = 1280, height: int = 720,
                 fps: float = 30.0, **retry: Any):
        super().__init__(uri, live=True, **retry)
        self.pipeline = csi_pipeline(sensor_id, width, height, fps)
        self.open_hint = (f" (no camera on sensor {sensor_id}, a mode it lacks, "
                          "or nvargus-daemon is not running)")

    def _preflight(self) -> None:
        _check_pipeline(self._shown, self.pipeline)

    def _open_capture(self) -> Any | None:
        return _video_capture(self.pipeline, cv2.CAP_GSTREAMER)


class V4l2Source(CaptureSource):
    """A V4L2 camera (USB webcam, HDMI grabber) by device node."""

    def __init__(self, uri: str, device: str, *, width: int | None = None,
                 height: int | None = None, fps: float | None = None, **retry: Any):
        super().__init__(uri, live=True, **retry)
        self.device = device
        self._settings = {cv2.CAP_PROP_FRAME_WIDTH: width, cv2.CAP_PROP_FRAME_HEIGHT: height,
                          cv2.CAP_PROP_FPS: fps}
        self.open_hint = " (busy in another program, or not a capture device)"

    def _preflight(self) -> None:
        # Missing at start is a mistake to report (and a device that may yet appear);
        # missing later is an unplug to wait out.
        try:
            mode = os.stat(self.device)
        except FileNotFoundError:
            raise SourceError(f"camera {self.device} not found (is it plugged in?)") from None
        except OSError as e:
            raise SourceUnusable(f"camera {self.device}: {e.strerror}") from None
        if not stat.S_ISCHR(mode.st_mode):
            raise SourceUnusable(f"{self.device} is not a camera: it is {file_kind(mode.st_mode)}, "
                                 "not a V4L2 device node")
        if sys.platform.startswith("linux") and os.major(mode.st_rdev) != V4L2_MAJOR:
            raise SourceUnusable(f"{self.device} is not a camera: character device "
                                 f"{os.major(mode.st_rdev)}:{os.minor(mode.st_rdev)}, "
                                 f"V4L2 devices are {V4L2_MAJOR}:N")
        if not os.access(self.device, os.R_OK | os.W_OK):
            raise SourceUnusable(f"camera {self.device}: permission denied "
                                 "(add the user to the group that owns it, usually 'video')")

    def _open_capture(self) -> Any | None:
        if not os.path.exists(self.device):
            return None
        capture = _video_capture(self.device, cv2.CAP_V4L2)
        if capture is not None:
            for prop, value in self._settings.items():
                if value is not None:
                    capture.set(prop, value)
            capture.set(cv2.CAP_PROP_BUFFERSIZE, 1)  # fewer queued, stale frames
        return capture


class RtspSource(CaptureSource):
    """A network camera: GStreamer's rtspsrc when OpenCV has it, else FFMPEG."""

    def __init__(self, uri: str, location: str, *, latency_ms: int = 200,
                 backend: str = "auto", **retry: Any):
        super().__init__(uri, live=True, **retry)
        self.location = location
        self.latency_ms = latency_ms
        self.backend = backend
        self._args: tuple[str, int, list[int]] | None = None
        self.open_hint = " (unreachable, refused, or no such stream)"

    def _preflight(self) -> None:
        self._args = rtsp_capture_args(self.location, self.latency_ms, self.backend,
                                       gstreamer_available())
        if self._args[1] == cv2.CAP_GSTREAMER:
            _check_pipeline(self._shown, self._args[0])

    def _open_capture(self) -> Any | None:
        assert self._args is not None
        return _video_capture(*self._args)


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
        _require_regular_file(self.path)

    def _open_capture(self) -> Any | None:
        capture = _video_capture(self.path, cv2.CAP_ANY)
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


def _require_regular_file(path: str) -> None:
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


def _video_capture(target: str, api: int, params: list[int] | None = None) -> Any | None:
    """An opened cv2.VideoCapture, or None (OpenCV reports failure by not opening)."""
    capture = cv2.VideoCapture(target, api, params or [])
    if capture.isOpened():
        return capture
    capture.release()
    return None


def _to_rgb(image: np.ndarray) -> np.ndarray:
    """OpenCV's BGR (or grey, or BGRA) → RGB uint8."""
    if image.ndim == 2:
        return cv2.cvtColor(image, cv2.COLOR_GRAY2RGB)
    if image.shape[2] == 4:
        return cv2.cvtColor(image, cv2.COLOR_BGRA2RGB)
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


# ---- image files, folders, globs ------------------------------------------------------

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
        _require_regular_file(location)
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


# ---- synthetic scenes -----------------------------------------------------------------

class SyntheticSource(Source):
    """Generated scenes (edgemm.model.scenes) with their ground truth, for demos and tests.

    Frame i is make_scene(seed + i), so a run is reproducible. With fps > 0 frames are
    released on a fixed schedule, like a camera: a fast reader waits, a slow one gets
    the next frame at once but never a burst to catch up. fps 0 is as fast as possible.
    `hold` > 1: each scene lasts that many frames (frame i shows make_scene(seed + i // hold)),
    with fresh sensor noise on each, like a camera watching a scene that changes now and
    then (what alerts are for: a condition that holds for a while).
    """
    HOLD_NOISE = 3  # ± grey levels of the noise a held scene gets per frame

    def __init__(self, uri: str = "synthetic://", *, fps: float = 0.0, seed: int = 0,
                 count: int | None = None, size: int = SYNTHETIC_SIZE, text_probability: float = 0.5,
                 hold: int = 1, max_pixels: int = DEFAULT_MAX_PIXELS, max_synthetic_pixels: int = DEFAULT_MAX_SYNTHETIC_PIXELS,
                 sleep: Callable[[float], Any] | None = None, clock: Callable[[], float] = time.monotonic):
        _check_synthetic_size(uri, size, max_pixels, max_synthetic_pixels)
        super().__init__(uri, live=fps > 0, sleep=sleep)
        self.fps, self.seed, self.count = fps, seed, count
        self.size, self.text_probability, self.hold = size, text_probability, hold
        self._scene, self._scene_seed = None, None  # the scene being held, and the seed it was made from
        self._clock = clock
        self._due = 0.0

    def _open(self) -> None:
        self._due = self._clock()

    def _next_frame(self) -> Frame | None:
        if self.count is not None and self._next_index >= self.count:
            return None
        # Imported here: the inference path never loads the scene generator.
        from edgemm.model.scenes import make_scene
        seed = self.seed + self._next_index // self.hold
        if self._scene is None or self._scene_seed != seed:
            self._scene = make_scene(seed, size=self.size, text_probability=self.text_probability)
            self._scene_seed = seed
        scene, image = self._scene, self._scene.image
        if self.hold > 1:  # a held scene: the same content, not the same pixels
            noise = np.random.default_rng(self._next_index).integers(-self.HOLD_NOISE, self.HOLD_NOISE + 1,
                                                                      image.shape, dtype=np.int16)
            image = np.clip(image + noise, 0, 255).astype(np.uint8)
        self._wait_until_due()
        return self._frame(image, truth=scene)

    def _wait_until_due(self) -> None:
        if self.fps <= 0:
            return
        now = self._clock()
        if self._due > now:
            self._sleep(self._due - now)
        # Late frames restart the schedule from now rather than bursting to catch up.
        self._due = max(self._due, now) + 1.0 / self.fps
