"""Cameras through OpenCV captures (CSI through GStreamer, V4L2, RTSP), reopened with backoff
when they fail to open or to deliver."""
from __future__ import annotations

import logging
import os
import stat
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from edgemm.streams.errors import SourceError, SourceUnusable
from edgemm.streams.sources import gstreamer
from edgemm.streams.sources.base import Frame, Source
from edgemm.util.backoff import Backoff
from edgemm.util.files import file_kind
from edgemm.util.opencv import cv2

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5
V4L2_MAJOR = 81  # Linux's character-device major number of every V4L2 node (linux/major.h)


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
                return self._frame(to_rgb(image), media_time=self._media_time())
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
        self.pipeline = gstreamer.csi_pipeline(sensor_id, width, height, fps)
        self.open_hint = (f" (no camera on sensor {sensor_id}, a mode it lacks, "
                          "or nvargus-daemon is not running)")

    def _preflight(self) -> None:
        gstreamer.check_pipeline(self._shown, self.pipeline)

    def _open_capture(self) -> Any | None:
        return video_capture(self.pipeline, cv2.CAP_GSTREAMER)


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
        capture = video_capture(self.device, cv2.CAP_V4L2)
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
        self._args = gstreamer.rtsp_capture_args(self.location, self.latency_ms, self.backend,
                                                 gstreamer.gstreamer_available())
        if self._args[1] == cv2.CAP_GSTREAMER:
            gstreamer.check_pipeline(self._shown, self._args[0])

    def _open_capture(self) -> Any | None:
        assert self._args is not None
        return video_capture(*self._args)


def video_capture(target: str, api: int, params: list[int] | None = None) -> Any | None:
    """An opened cv2.VideoCapture, or None (OpenCV reports failure by not opening)."""
    capture = cv2.VideoCapture(target, api, params or [])
    if capture.isOpened():
        return capture
    capture.release()
    return None


def to_rgb(image: np.ndarray) -> np.ndarray:
    """OpenCV's BGR (or grey, or BGRA) → RGB uint8."""
    if image.ndim == 2:
        return cv2.cvtColor(image, cv2.COLOR_GRAY2RGB)
    if image.shape[2] == 4:
        return cv2.cvtColor(image, cv2.COLOR_BGRA2RGB)
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
