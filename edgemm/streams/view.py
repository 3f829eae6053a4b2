"""What a stream sees and says, as pictures: annotated frames out, and the latest frame as a JPEG.

    run_stream ─► view.answer(frame, record)   a frame's answer (the emit loop, in frame order)
               ─► view.frame(frame)            every source frame, once, in source order
                                               (files: the emit loop; live sources: the reader)

`edgemm stream SOURCE --view OUT` draws the latest answer (and its tier and latency) on
every source frame and writes it to OUT: a video file (.mp4, .avi), a folder of JPEGs,
display://0, or rtp://host:port (H.264 over RTP through GStreamer, as jetson-inference's
video-output does). Frames between answers carry the latest answer, so OUT keeps the
source's frame rate. The daemon keeps only each stream's latest answered frame
(`LatestFrame`), encoded as a bounded JPEG when someone asks for it, once per answer.
"""
from __future__ import annotations

import os
import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgemm.errors import InputError
from edgemm.util.opencv import cv2
from edgemm.streams.sources.base import Frame
from edgemm.streams.sources.gstreamer import gstreamer_available, gstreamer_element_exists

VIDEO_CODECS = {".mp4": "mp4v", ".avi": "MJPG"}  # fourccs every OpenCV build writes without extra codecs
DEFAULT_FPS = 10.0  # the output's frame rate when the source does not say its own
JPEG_MAX_SIDE = 640  # the daemon's frame.jpg: longest side, in pixels
KEPT_ANSWERED_FRAMES = 3  # a stream's last answers' frames kept (references, no copies) for /v1/events?frames=jpeg
JPEG_QUALITY = 80
_FONT = cv2.FONT_HERSHEY_SIMPLEX


# ---- drawing -------------------------------------------------------------------------------

def caption(record: dict | None) -> tuple[str, str]:
    """(the answer, the figures line) drawn for `record`; the figures line says when there is none yet."""
    if record is None:
        return "", "waiting for the first answer"
    if "error" in record:
        return "", f"error: {record['error']}"
    reused = " (reused)" if record.get("reused") else ""
    return str(record.get("answer", "")), (f"frame {record.get('frame')}  tier {record.get('tier')}  "
                                           f"{record.get('latency_ms', 0):.0f} ms{reused}")


def annotate(image: np.ndarray, record: dict | None) -> np.ndarray:
    """A copy of the RGB `image` with the answer and its figures in a dark band along the top."""
    out = image.copy()
    height, width = out.shape[:2]
    scale = max(0.35, min(1.2, width / 640))
    thickness = max(1, round(scale * 2))
    line = round(28 * scale)
    band = min(height, 2 * line + round(10 * scale))
    # darkened, not blacked out: the scene under the text stays visible
    out[:band] = (out[:band] * 0.35).astype(np.uint8)
    answer, figures = caption(record)
    for row, (text, colour) in enumerate(((answer, (255, 255, 255)), (figures, (150, 220, 255)))):
        # Hershey fonts draw ASCII only: anything else would come out as question marks anyway
        text = text.encode("ascii", "replace").decode("ascii")[:120]
        cv2.putText(out, text, (round(8 * scale), (row + 1) * line), _FONT, scale * (0.8 if row else 1.0),
                    colour, thickness, cv2.LINE_AA)
    return out


def jpeg(image: np.ndarray, max_side: int = JPEG_MAX_SIDE, quality: int = JPEG_QUALITY) -> bytes:
    """The RGB `image` as a JPEG, downscaled so its longest side is at most `max_side`."""
    height, width = image.shape[:2]
    if max(height, width) > max_side:
        factor = max_side / max(height, width)
        image = cv2.resize(image, (max(1, round(width * factor)), max(1, round(height * factor))),
                           interpolation=cv2.INTER_AREA)
    ok, data = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError("OpenCV could not encode a JPEG")
    return data.tobytes()


# ---- the daemon's latest frame -------------------------------------------------------------

class LatestFrame:
    """A stream's latest answered frame: kept by reference (no copy, no encoding) when its
    answer comes, encoded as a JPEG the first time it is asked for, once per answer."""

    every_frame = False  # only answers: run_stream does not hand over the frames between them

    def __init__(self):
        self._lock = threading.Lock()
        self._encode_lock = threading.Lock()  # held around an encode (never while _lock waits on it)
        self._image: np.ndarray | None = None
        self._number = 0  # answers seen
        self._encoded: tuple[int, bytes] | None = None  # (answer number, its JPEG)
        # the last few answers' frames by their source frame number, for GET /v1/events?frames=jpeg:
        # the result sent is its stream's newest, but a newer answer may come while it is encoded
        self._recent: deque[tuple[object, np.ndarray]] = deque(maxlen=KEPT_ANSWERED_FRAMES)
        # (a kept frame, its JPEG): each kept frame's, encoded once, however many listeners at whatever phase ask
        self._encoded_frames: deque[tuple[np.ndarray, bytes]] = deque(maxlen=KEPT_ANSWERED_FRAMES)

    def answer(self, frame: Frame, record: dict) -> None:
        if "error" in record:
            return
        with self._lock:
            self._image, self._number = frame.image, self._number + 1
            self._recent.append((record.get("frame"), frame.image))

    def frame(self, frame: Frame) -> None:
        pass

    def cached(self) -> tuple[int, bytes] | None:
        """The latest answer's JPEG if it was encoded already, else None (then: jpeg())."""
        with self._lock:
            encoded = self._encoded
            return encoded if encoded is not None and encoded[0] == self._number else None

    def jpeg(self) -> tuple[int, bytes] | None:
        """(the answer's number, the JPEG), or None before the first answer. Viewers asking at once
        wait for one encode: the encode lock is held around it, so an answer is encoded once."""
        with self._encode_lock:
            with self._lock:
                image, number, encoded = self._image, self._number, self._encoded
            if image is None:
                return None
            if encoded is not None and encoded[0] == number:
                return encoded
            encoded = (number, jpeg(image))  # answer() goes on meanwhile: it takes only _lock
            with self._lock:
                if self._encoded is None or self._encoded[0] < number:
                    self._encoded = encoded
            return encoded

    def jpeg_of(self, frame_number: object) -> bytes | None:
        """The JPEG of the answered frame with this source frame number (a result's `frame`), or None
        once KEPT_ANSWERED_FRAMES newer answers came: each encoded once, however many ask."""
        with self._encode_lock:
            with self._lock:
                # the newest of that number (a source that restarts numbers its frames anew)
                image = next((kept for number, kept in reversed(self._recent) if number == frame_number), None)
                data = next((data for kept, data in self._encoded_frames if kept is image), None)
            if image is None:
                return None
            if data is None:
                data = jpeg(image)
                with self._lock:
                    self._encoded_frames.append((image, data))
            return data


# ---- --view OUT ----------------------------------------------------------------------------

@dataclass
class ViewTarget:
    """A checked --view OUT: `kind` is video, folder, display or rtp."""
    kind: str
    location: str  # the file, the folder, the display number, host:port
    host: str = ""
    port: int = 0


def parse_view(out: str) -> ViewTarget:
    """--view OUT → what it names, or InputError (exit 2) with one line: checked before the model loads.
    A folder is created here, and a file's folder is written to once, so that what the OS
    refuses (a missing parent, permission, a read-only file system, a name too long) is said
    now, in the OS's own words, not when the first frame is written."""
    if not out:
        raise InputError("--view needs an OUT: a .mp4 or .avi file, a folder/, display://0 or rtp://host:port")
    if out.startswith("display://"):
        return _check_display(out)
    if out.startswith("rtp://"):
        return _check_rtp(out)
    if "://" in out:
        raise InputError(f"--view {out}: unknown scheme (a .mp4 or .avi file, a folder, display://0 "
                         "or rtp://host:port)")
    path = Path(out)
    try:
        if out.endswith("/") or path.is_dir():
            if path.exists() and not path.is_dir():
                raise InputError(f"--view {out}: exists and is not a folder")
            path.mkdir(parents=True, exist_ok=True)
            _try_writing_in(path)
            return ViewTarget("folder", out)
        if path.suffix.lower() not in VIDEO_CODECS:
            raise InputError(f"--view {out}: a video file must end in {' or '.join(VIDEO_CODECS)} "
                             "(or name a folder, ending in /, for JPEGs)")
        parent = path.parent
        if not parent.is_dir():
            raise InputError(f"--view {out}: no folder {parent}")
        if path.exists():
            if not path.is_file():
                raise InputError(f"--view {out}: exists and is not a regular file")
            os.close(os.open(path, os.O_WRONLY))  # opened, not truncated: the writer truncates it later
        else:
            _try_writing_in(parent)
    except OSError as e:
        raise InputError(f"--view {out}: cannot write there ({e.strerror or e})") from None
    return ViewTarget("video", out)


def _try_writing_in(folder: Path) -> None:
    """Create (and at once remove) a file in `folder`: an OSError says why nothing can be
    written there. os.access would not: it says yes to root on a read-only /sys."""
    with tempfile.TemporaryFile(dir=folder):
        pass


def _check_display(out: str) -> ViewTarget:
    number = out[len("display://"):]
    if not number.isdigit():
        raise InputError(f"--view {out}: a display is display://N (display://0)")
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        raise InputError(f"--view {out}: no display here (DISPLAY is not set)")
    info = cv2.getBuildInformation()
    gui = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.strip().startswith("GUI:")), "")
    if not gui or gui.upper() == "NONE":
        raise InputError(f"--view {out}: this OpenCV has no GUI (opencv-python-headless); install opencv-python, "
                         "or on a Jetson use JetPack's python3-opencv")
    return ViewTarget("display", number)


def _check_rtp(out: str) -> ViewTarget:
    host, _, port = out[len("rtp://"):].rstrip("/").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--view {out}: an RTP output is rtp://host:port (rtp://192.168.1.2:5000)")
    if not gstreamer_available():
        raise InputError(f"--view {out}: rtp:// needs OpenCV built with GStreamer (this OpenCV has none; "
                         "on a Jetson use JetPack's python3-opencv)")
    if _h264_encoder() is None:
        raise InputError(f"--view {out}: GStreamer has no H.264 encoder (nvv4l2h264enc or x264enc)")
    return ViewTarget("rtp", f"{host}:{port}", host, int(port))


def _h264_encoder() -> str | None:
    """The GStreamer pipeline's encoding part: the Jetson's hardware encoder, else x264."""
    if gstreamer_element_exists("nvv4l2h264enc"):
        return "nvvidconv ! video/x-raw(memory:NVMM) ! nvv4l2h264enc insert-sps-pps=true"
    if gstreamer_element_exists("x264enc"):
        return "x264enc tune=zerolatency speed-preset=ultrafast"
    return None


class AnnotatedView:
    """--view OUT: every source frame, with the latest answer drawn on it, to OUT.

    `frame` is called from one thread at a time (the emit loop, or a live source's reader);
    `answer` from the emit loop. Writers open on the first frame, when its size is known."""

    every_frame = True

    def __init__(self, target: ViewTarget, fps: float):
        self.target, self.fps = target, fps if fps > 0 else DEFAULT_FPS
        self.written = 0
        self._latest: dict | None = None
        self._lock = threading.Lock()
        self._writer = None  # cv2.VideoWriter, for video and rtp
        self._size: tuple[int, int] | None = None
        self._failed = False  # a write already refused: the stream ends with that error

    def answer(self, frame: Frame, record: dict) -> None:
        with self._lock:
            self._latest = record

    def frame(self, frame: Frame) -> None:
        with self._lock:
            record = self._latest
        image = cv2.cvtColor(annotate(frame.image, record), cv2.COLOR_RGB2BGR)
        kind = self.target.kind
        if kind == "folder":
            folder = Path(self.target.location)
            if self.written == 0:
                folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"frame_{frame.index:06d}.jpg"
            if not cv2.imwrite(str(path), image, [cv2.IMWRITE_JPEG_QUALITY, 90]):
                raise InputError(f"--view {self.target.location}: could not write {path.name}")
        elif kind == "display":
            cv2.imshow(f"edgemm {frame.source}", image)
            cv2.waitKey(1)
        else:
            self._write_video(image)
        self.written += 1

    def _write_video(self, image: np.ndarray) -> None:
        height, width = image.shape[:2]
        if self._writer is None:
            self._size = (width, height)
            self._writer = self._open_writer(width, height)
        elif (width, height) != self._size:  # a writer takes one size: later frames are fitted to it
            image = cv2.resize(image, self._size, interpolation=cv2.INTER_AREA)
        self._writer.write(image)  # says nothing when the file cannot take the frame: see _check_space, close
        if self.target.kind == "video":
            self._check_space()

    def _check_space(self) -> None:
        """A disk with no room left is said now, not after the stream: OpenCV's writer would
        go on taking frames that reach nothing (statvfs is one system call a frame)."""
        folder = os.path.dirname(os.path.abspath(self.target.location))
        try:
            space = os.statvfs(folder)
        except OSError:  # no such call on this filesystem: close() still checks the file
            return
        if space.f_bavail == 0 and space.f_blocks > 0:
            self._failed = True  # said here: close() need not say it again
            raise InputError(f"cannot write --view {self.target.location}: No space left on device "
                             f"(after {self.written} frames)")

    def _open_writer(self, width: int, height: int):
        target = self.target
        if target.kind == "rtp":
            pipeline = (f"appsrc ! videoconvert ! {_h264_encoder()} ! rtph264pay config-interval=1 pt=96 ! "
                        f"udpsink host={target.host} port={target.port} sync=false")
            writer = cv2.VideoWriter(pipeline, cv2.CAP_GSTREAMER, 0, self.fps, (width, height), True)
        else:
            fourcc = cv2.VideoWriter_fourcc(*VIDEO_CODECS[Path(target.location).suffix.lower()])
            writer = cv2.VideoWriter(target.location, fourcc, self.fps, (width, height), True)
        if not writer.isOpened():
            raise InputError(f"--view {target.location}: OpenCV could not open a video writer for it")
        return writer

    def close(self) -> None:
        """Releases the writer; a video file that does not hold every frame written to it is
        an InputError (exit 2), since OpenCV's writer reports no failure of its own."""
        if self._writer is not None:
            self._writer.release()
            self._writer = None
            if self.target.kind == "video" and not self._failed and not video_holds(self.target.location, self.written):
                raise InputError(f"cannot write --view {self.target.location}: it does not hold the "
                                 f"{self.written} frames written to it (a full disk, or a file size limit?)")
        if self.target.kind == "display":
            cv2.destroyAllWindows()


def video_holds(path: str, frames: int) -> bool:
    """Whether the video file at `path` says it has `frames` frames and its last one can be
    read: what a file cut short (its index or moov atom never written, its last frames lost)
    does not. Seeks to the last frame, rather than decoding them all: a few ms for any length."""
    capture = cv2.VideoCapture(path)
    try:
        return (capture.isOpened() and capture.get(cv2.CAP_PROP_FRAME_COUNT) == frames
                and capture.set(cv2.CAP_PROP_POS_FRAMES, frames - 1) and capture.grab())
    finally:
        capture.release()


def open_view(out: str, fps: float) -> AnnotatedView:
    """--view OUT for a source of `fps` frames a second (0: unknown, DEFAULT_FPS)."""
    return AnnotatedView(parse_view(out), fps)
