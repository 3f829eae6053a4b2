"""Source URIs as written: their kind, location and typed options, and the same URI with its
secrets hidden (for logs, errors and JSON output)."""
from __future__ import annotations

import math
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from edgemm.config import MAX_FPS, MIN_FPS
from edgemm.streams.errors import SourceError

KINDS = ("csi", "v4l2", "rtsp", "video", "image", "folder", "glob", "synthetic")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif")
VIDEO_EXTENSIONS = (".mp4", ".mkv", ".avi", ".mov", ".webm", ".m4v")
SUPPORTED = ("csi://N, v4l2:///dev/videoN, rtsp://host/path, file://PATH, synthetic://, "
             "or a video file, image file, folder or glob")


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
