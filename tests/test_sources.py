"""Sources by URI: parsing, pipelines, files/folders/globs/videos, synthetic pacing, reconnects.

Nothing here touches a camera or the network, and nothing sleeps for real: files are
written into tmp_path, and clocks and sleeps are injected.
"""
from __future__ import annotations

import ctypes.util
import os
import shutil
import threading

import cv2
import numpy as np
import pytest

from edgemm.streams.sources import capture, gstreamer
from edgemm.errors import InputError
from edgemm.model.errors import ImageError
from edgemm.model.scenes import Scene, make_scene
from edgemm.streams.errors import SourceError, SourceUnusable
from edgemm.streams.sources import check_uri, open_source
from edgemm.streams.sources.capture import CaptureSource
from edgemm.streams.sources.gstreamer import csi_pipeline, pipeline_elements, rtsp_capture_args, rtsp_pipeline
from edgemm.streams.sources.synthetic import SyntheticSource
from edgemm.streams.sources.uri import KINDS, SourceSpec, parse_uri, redact_uri

RED_BGR, GREEN_BGR, BLUE_BGR = (0, 0, 255), (0, 255, 0), (255, 0, 0)
NO_GSTREAMER = ("csi://0 needs OpenCV built with GStreamer (this OpenCV has none; "
                "on a Jetson use JetPack's python3-opencv)")


def write_png(path, bgr, size=(8, 8)):
    assert cv2.imwrite(str(path), np.full((*size, 3), bgr, np.uint8))
    return path


def write_video(path, colours_bgr, size=64):
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10, (size, size))
    assert writer.isOpened()
    for bgr in colours_bgr:
        writer.write(np.full((size, size, 3), bgr, np.uint8))
    writer.release()
    return path


@pytest.fixture
def no_gstreamer(monkeypatch):
    monkeypatch.setattr(gstreamer, "gstreamer_available", lambda: False)


# ---- parsing --------------------------------------------------------------------------

@pytest.mark.parametrize("uri, kind, location, options", [
    ("csi://0", "csi", "0", {}),
    ("csi://1?width=1920&height=1080&fps=29.97", "csi", "1",
     {"width": 1920, "height": 1080, "fps": 29.97}),
    ("v4l2:///dev/video0", "v4l2", "/dev/video0", {}),
    ("v4l2:///dev/video1?width=640&fps=15", "v4l2", "/dev/video1", {"width": 640, "fps": 15.0}),
    ("v4l2://2", "v4l2", "/dev/video2", {}),
    ("/dev/video0", "v4l2", "/dev/video0", {}),
    ("rtsp://cam.local:8554/live", "rtsp", "rtsp://cam.local:8554/live", {}),
    ("rtsp://u:pw@10.0.0.5/stream?latency=50&channel=1&subtype=0", "rtsp",
     "rtsp://u:pw@10.0.0.5/stream?channel=1&subtype=0", {"latency": 50}),
    ("rtsp://cam/x?backend=ffmpeg", "rtsp", "rtsp://cam/x", {"backend": "ffmpeg"}),
    ("clip.mp4", "video", "clip.mp4", {}),
    ("data/CLIP.MKV", "video", "data/CLIP.MKV", {}),
    ("file:///data/recording", "video", "/data/recording", {}),
    ("file://clip.webm", "video", "clip.webm", {}),
    ("file://photo.jpg", "image", "photo.jpg", {}),
    ("photo.jpeg", "image", "photo.jpeg", {}),
    ("scan.TIFF", "image", "scan.TIFF", {}),
    ("frames/*.png", "glob", "frames/*.png", {}),
    ("img_[0-9].jpg", "glob", "img_[0-9].jpg", {}),
    ("frame?.png", "glob", "frame?.png", {}),
    ("synthetic://", "synthetic", "", {}),
    ("synthetic://?fps=10&seed=3&count=5&size=128&text=0.25", "synthetic", "",
     {"fps": 10.0, "seed": 3, "count": 5, "size": 128, "text": 0.25}),
])
def test_parse_uri(uri, kind, location, options):
    assert parse_uri(uri) == SourceSpec(kind, location, options)
    assert kind in KINDS


def test_parse_uri_folder(tmp_path):
    assert parse_uri(str(tmp_path)) == SourceSpec("folder", str(tmp_path))
    assert parse_uri(f"file://{tmp_path}") == SourceSpec("folder", str(tmp_path))


@pytest.mark.parametrize("uri, message", [
    ("", "source URI is empty"),
    ("   ", "source URI is empty"),
    ("http://cam/video.mjpg", r"unknown source scheme http:// .*supported: csi://N, v4l2://"),
    ("csi://front", "csi:// needs a sensor number, e.g. csi://0"),
    ("csi://0?exposure=3", r"unknown option 'exposure' for csi:// \(known: fps, height, width\)"),
    ("csi://0?fps=fast", "option fps must be a number, got 'fast'"),
    ("csi://0?width=0", "option width must be >= 1"),
    ("csi://0?width=12.5", "option width must be an integer"),
    ("csi://0?fps=30&fps=60", "option 'fps' is given twice"),
    ("v4l2://dev/video0", r"v4l2:// needs a device node, e.g. v4l2:///dev/video0"),
    ("rtsp:///stream", "rtsp:// needs a host"),
    ("rtsp://cam/x?backend=vlc", "option backend must be one of auto, gstreamer, ffmpeg"),
    ("rtsp://cam/x?latency=-5", "option latency must be >= 0"),
    ("synthetic://?text=2", "option text must be between 0 and 1"),
    ("synthetic://?count=-1", "option count must be >= 0"),
    ("synthetic://?fps=nan", "option fps must be 0 or between 0.001 and 1000"),
    ("synthetic://?size=8", "option size must be >= 32"),
    ("synthetic://scenes", "synthetic:// takes only options"),
    ("file://", "file:// needs a path"),
    ("no/such/thing", "no such file or folder: no/such/thing"),
])
def test_parse_uri_refuses(uri, message):
    with pytest.raises(SourceError, match=message) as info:
        parse_uri(uri)
    assert "\n" not in str(info.value)


def test_source_error_is_an_input_error():
    assert issubclass(SourceError, InputError) and SourceError.exit_code == 2


def test_unknown_file_type_is_refused(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hi")
    with pytest.raises(SourceError, match=r"don't know how to read .*notes.txt: expected an image"):
        parse_uri(str(notes))


def test_rtsp_credentials_stay_out_of_messages():
    with pytest.raises(SourceError) as info:
        parse_uri("rtsp://admin:secret@cam/x?latency=soon")
    assert "secret" not in str(info.value) and "rtsp://***@cam/x" in str(info.value)


@pytest.mark.parametrize("uri, shown", [
    # an unescaped @, #, / or ? in the password: hidden up to the last @ a host follows
    ("rtsp://admin:p@ssw0rd@10.0.0.5:554/live", "rtsp://***@10.0.0.5:554/live"),
    ("rtsp://admin:pa#ss@10.0.0.5/live", "rtsp://***@10.0.0.5/live"),
    ("rtsp://admin:pa/ss@10.0.0.5/live", "rtsp://***@10.0.0.5/live"),
    ("rtsp://admin:pa?ss@10.0.0.5/live?latency=soon", "rtsp://***@10.0.0.5/live?latency=soon"),
    ("rtsp://admin:p@s/s#w?d@[fe80::1]:554/x", "rtsp://***@[fe80::1]:554/x"),
    ("rtsp://admin:secret@", "rtsp://***@"),
    # a query's password, any case; its other parameters and the path are kept
    ("rtsp://10.0.0.5/live?user=admin&password=s3cr3t", "rtsp://10.0.0.5/live?user=admin&password=***"),
    ("rtsp://cam/x?PWD=a&Pass=b#c&bypass=1&Passwd=d", "rtsp://cam/x?PWD=***&Pass=***&bypass=1&Passwd=***"),
    ("rtsp://admin:x@cam/x?channel=1&password=y", "rtsp://***@cam/x?channel=1&password=***"),
    # nothing to hide: unchanged
    ("rtsp://cam:554/Streaming/Channels/101?transport=tcp", "rtsp://cam:554/Streaming/Channels/101?transport=tcp"),
    ("synthetic://?fps=5&count=3", "synthetic://?fps=5&count=3"),
    ("/dev/video0", "/dev/video0"),
])
def test_redaction_hides_every_part_that_could_be_a_password(uri, shown):
    assert redact_uri(uri) == shown


@pytest.mark.parametrize("uri, secret", [("rtsp://admin:pa#ss@10.0.0.5/live", "pa#ss"),
                                         ("rtsp://admin:p@ssw0rd@10.0.0.5/live", "ssw0rd"),
                                         ("rtsp://admin:pa/ss@10.0.0.5/live", "pa/ss")])
def test_a_refused_rtsp_uri_never_shows_its_password(uri, secret):
    """The config file's streams are checked with these messages (stderr, the journal)."""
    from edgemm.streams.manager import check_configured
    from edgemm.config import config_from_dict
    specs = config_from_dict({"streams": [{"id": "door", "source": uri}]}).streams
    with pytest.raises(InputError) as info:
        check_configured(specs, 4)
    assert secret not in str(info.value) and "rtsp://***@10.0.0.5" in str(info.value)


# ---- GStreamer pipelines and backends ------------------------------------------------

def test_csi_pipeline_defaults():
    pipeline = csi_pipeline(0)
    for part in ("nvarguscamerasrc sensor-id=0 !",
                 "video/x-raw(memory:NVMM), width=1280, height=720, framerate=30/1 !",
                 "nvvidconv ! video/x-raw, format=BGRx !",
                 "videoconvert ! video/x-raw, format=BGR !",
                 "appsink drop=true max-buffers=1"):
        assert part in pipeline
    assert pipeline.startswith("nvarguscamerasrc") and pipeline.endswith("max-buffers=1")


def test_csi_pipeline_options():
    pipeline = csi_pipeline(1, 1920, 1080, 29.97)
    assert "sensor-id=1" in pipeline
    assert "width=1920, height=1080, framerate=2997/100" in pipeline


def test_csi_uri_options_win_over_keywords():
    source = open_source("csi://1?width=1920", width=640, height=1080)
    assert "sensor-id=1" in source.pipeline
    assert "width=1920, height=1080, framerate=30/1" in source.pipeline
    assert source.live


def test_rtsp_pipeline():
    pipeline = rtsp_pipeline("rtsp://cam/x?channel=1", 50)
    assert pipeline.startswith('rtspsrc location="rtsp://cam/x?channel=1" latency=50 ! ')
    for part in ("decodebin", "videoconvert", "video/x-raw,format=BGR",
                 "appsink drop=true max-buffers=1"):
        assert part in pipeline


def test_rtsp_capture_args_choose_backend():
    target, api, params = rtsp_capture_args("rtsp://cam/x", 100, "auto", gstreamer=True)
    assert api == cv2.CAP_GSTREAMER and "latency=100" in target and params == []
    target, api, _ = rtsp_capture_args("rtsp://cam/x", 100, "auto", gstreamer=False)
    assert (target, api) == ("rtsp://cam/x", cv2.CAP_FFMPEG)
    target, api, _ = rtsp_capture_args("rtsp://cam/x", 100, "ffmpeg", gstreamer=True)
    assert (target, api) == ("rtsp://cam/x", cv2.CAP_FFMPEG)


def test_rtsp_latency_from_uri_or_keyword():
    source = open_source("rtsp://cam/x?latency=50&channel=1", latency_ms=300)
    assert (source.location, source.latency_ms) == ("rtsp://cam/x?channel=1", 50)
    assert open_source("rtsp://cam/x", latency_ms=300).latency_ms == 300


def test_gstreamer_available_reads_build_information(monkeypatch):
    check = gstreamer.gstreamer_available.__wrapped__  # uncached
    monkeypatch.setattr(cv2, "getBuildInformation",
                        lambda: "  Video I/O:\n    GStreamer:                   YES (1.20.3)\n")
    assert check() is True
    monkeypatch.setattr(cv2, "getBuildInformation",
                        lambda: "  Video I/O:\n    GStreamer:                   NO\n")
    assert check() is False
    monkeypatch.setattr(cv2, "getBuildInformation", lambda: "  Video I/O:\n")
    assert check() is False


def test_csi_without_gstreamer(no_gstreamer):
    with pytest.raises(SourceError) as info:
        open_source("csi://0").open()
    assert str(info.value) == NO_GSTREAMER


def test_rtsp_forced_gstreamer_without_gstreamer(no_gstreamer):
    with pytest.raises(SourceError, match=r"rtsp://\*\*\*@cam/x needs OpenCV built with GStreamer"):
        open_source("rtsp://u:pw@cam/x?backend=gstreamer").open()


def test_rtsp_falls_back_to_ffmpeg(no_gstreamer, monkeypatch):
    opened = []

    def fake_capture(target, api, params=None):  # stands in for cv2: never connects
        opened.append((target, api))
        return None

    monkeypatch.setattr(capture, "video_capture", fake_capture)
    with pytest.raises(SourceError, match=r"could not open camera rtsp://cam/x"):
        open_source("rtsp://cam/x?latency=10", reconnect=False).open()
    assert opened == [("rtsp://cam/x", cv2.CAP_FFMPEG)]


@pytest.mark.parametrize("uri", ["v4l2:///dev/video99", "/dev/video99"])
def test_v4l2_missing_device(uri):
    with pytest.raises(SourceError) as info:
        open_source(uri).open()
    assert str(info.value) == "camera /dev/video99 not found (is it plugged in?)"


# ---- image files, folders, globs -----------------------------------------------------

def test_folder_yields_sorted_rgb_frames(tmp_path):
    write_png(tmp_path / "b_green.png", GREEN_BGR)
    write_png(tmp_path / "a_red.png", RED_BGR)
    write_png(tmp_path / "c_blue.jpg", BLUE_BGR)
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "sub.png").mkdir()           # a folder with an image's name
    write_png(tmp_path / "._a_red.png", RED_BGR)  # hidden (macOS companion)

    source = open_source(str(tmp_path))
    assert source.live is False
    frames = list(source)
    assert [f.name for f in frames] == ["a_red.png", "b_green.png", "c_blue.jpg"]
    assert [f.index for f in frames] == [0, 1, 2]
    red = frames[0].image
    assert red.shape == (8, 8, 3) and red.dtype == np.uint8
    assert tuple(red[0, 0]) == (255, 0, 0)  # RGB, red channel first
    assert tuple(frames[1].image[0, 0]) == (0, 255, 0)
    assert frames[2].image[0, 0, 2] > 200 and frames[2].image[0, 0, 0] < 60  # blue (JPEG)
    assert all(f.source == str(tmp_path) and f.truth is None for f in frames)
    assert source.read() is None and source.stats.frames == 3


def test_empty_folder(tmp_path):
    (tmp_path / "readme.md").write_text("no pictures here")
    with pytest.raises(SourceError, match=f"no images in folder {tmp_path}$"):
        open_source(str(tmp_path)).open()


def test_bad_image_in_folder_names_the_file(tmp_path):
    write_png(tmp_path / "a.png", RED_BGR)
    (tmp_path / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    write_png(tmp_path / "c.png", GREEN_BGR)
    source = open_source(str(tmp_path))
    assert source.read().name == "a.png"
    with pytest.raises(ImageError, match=r"b\.png"):
        source.read()
    # The caller may read on past the bad file.
    frame = source.read()
    assert (frame.name, frame.index) == ("c.png", 1)
    assert source.read() is None


def test_glob(tmp_path):
    for name in ("f2.png", "f1.png", "f3.png"):
        write_png(tmp_path / name, RED_BGR)
    write_png(tmp_path / "other.jpg", RED_BGR)
    frames = list(open_source(str(tmp_path / "f*.png")))
    assert [f.name for f in frames] == [str(tmp_path / n) for n in ("f1.png", "f2.png", "f3.png")]


def test_glob_without_matches(tmp_path):
    with pytest.raises(SourceError, match="no images match .*nothing_\\*.png"):
        open_source(str(tmp_path / "nothing_*.png")).open()


def test_single_image(tmp_path):
    path = write_png(tmp_path / "one.png", RED_BGR, size=(4, 6))
    with open_source(str(path)) as source:
        frame = source.read()
        assert (frame.index, frame.name, frame.image.shape) == (0, "one.png", (4, 6, 3))
        assert tuple(frame.image[0, 0]) == (255, 0, 0)
        assert source.read() is None


@pytest.mark.parametrize("name", ["missing.png", "missing.mp4"])
def test_missing_file(tmp_path, name):
    path = tmp_path / name
    with pytest.raises(SourceError, match=f"no such file or folder: {path}$"):
        list(open_source(str(path)))


# ---- video files ---------------------------------------------------------------------

def test_video_file_reads_every_frame_then_ends(tmp_path):
    colours = [RED_BGR, GREEN_BGR, BLUE_BGR, RED_BGR, GREEN_BGR]
    path = write_video(tmp_path / "clip.avi", colours)
    source = open_source(str(path))
    assert source.live is False
    frames = [source.read() for _ in range(5)]
    assert source.read() is None
    assert [f.index for f in frames] == [0, 1, 2, 3, 4]
    for frame in frames:
        assert frame.image.shape == (64, 64, 3) and frame.image.dtype == np.uint8
        assert frame.name is None
    red = frames[0].image[32, 32]
    assert red[0] > 200 and red[2] < 60  # RGB after BGR conversion (MJPG is lossy)
    source.close()


def test_video_file_by_file_uri(tmp_path):
    # No extension: only file:// says it is a video.
    path = write_video(tmp_path / "recording.avi", [RED_BGR] * 2).rename(tmp_path / "recording")
    with open_source(f"file://{path}") as source:
        assert len(list(source)) == 2


def test_unreadable_video(tmp_path):
    path = tmp_path / "broken.mp4"
    path.write_bytes(b"not a video" * 50)
    with pytest.raises(SourceError, match="could not open video .*broken.mp4"):
        open_source(str(path)).open()


# ---- synthetic -----------------------------------------------------------------------

class FakeClock:
    """A monotonic clock that only moves when slept on (or advanced by the test)."""

    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_synthetic_is_deterministic_and_carries_truth():
    first = list(open_source("synthetic://?seed=7&count=3&size=32"))
    again = list(open_source("synthetic://?seed=7&count=3&size=32"))
    assert len(first) == 3
    for a, b in zip(first, again):
        assert np.array_equal(a.image, b.image)
    for i, frame in enumerate(first):
        assert isinstance(frame.truth, Scene) and frame.truth.seed == 7 + i
        assert frame.image is frame.truth.image and frame.image.shape == (32, 32, 3)
        assert np.array_equal(frame.image, make_scene(7 + i, size=32).image)
    other = open_source("synthetic://?seed=8&count=1&size=32").read()
    assert not np.array_equal(first[0].image, other.image)


def test_synthetic_text_option_reaches_the_scenes():
    frames = list(open_source("synthetic://?count=5&size=64&text=0"))
    assert all(f.truth.text is None for f in frames)


def test_synthetic_count_and_liveness():
    unpaced = open_source("synthetic://?count=2&size=32")
    assert unpaced.live is False
    assert [f.index for f in unpaced] == [0, 1] and unpaced.read() is None
    assert open_source("synthetic://?fps=5").live is True
    assert open_source("synthetic://", fps=5).live is True  # keyword default


def test_synthetic_pacing_uses_clock_and_sleep():
    clock = FakeClock()
    source = open_source("synthetic://?fps=10&count=4&size=32", sleep=clock.sleep, clock=clock)
    frames = list(source)
    assert len(frames) == 4
    assert clock.sleeps == pytest.approx([0.1, 0.1, 0.1])


def test_synthetic_late_reader_gets_no_burst():
    clock = FakeClock()
    source = SyntheticSource(fps=10, size=32, sleep=clock.sleep, clock=clock)
    source.read()                    # due at once
    clock.now += 0.35                # the reader was busy for 3.5 frame periods
    source.read()                    # late: delivered at once
    source.read()                    # then back on a 0.1 s schedule from there
    assert clock.sleeps == pytest.approx([0.1])


def test_synthetic_unpaced_never_sleeps():
    clock = FakeClock()
    list(SyntheticSource(count=3, size=32, sleep=clock.sleep, clock=clock))
    assert clock.sleeps == []


# ---- reconnect and backoff -----------------------------------------------------------

class FakeCapture:
    def __init__(self):
        self.released = False

    def release(self):
        self.released = True


class FakeCamera(CaptureSource):
    """Fails its first `fail_opens` opens; then each grab pops from `grabs` (True = frame)."""

    def __init__(self, fail_opens=0, grabs=None, uri="fake://cam", **kw):
        self.sleeps: list[float] = []
        super().__init__(uri, live=True, sleep=self.sleeps.append, **kw)
        self.fail_opens, self.opens = fail_opens, 0
        self.grabs = list(grabs) if grabs is not None else None
        self.captures: list[FakeCapture] = []

    def _open_capture(self):
        self.opens += 1
        if self.opens <= self.fail_opens:
            return None
        self.captures.append(FakeCapture())
        return self.captures[-1]

    def _grab(self):
        if self.grabs is not None and not self.grabs.pop(0):
            return None
        bgr = np.zeros((2, 2, 3), np.uint8)
        bgr[..., 2] = 255  # red in OpenCV's order
        return bgr


def test_reconnect_backs_off_exponentially_up_to_the_cap():
    camera = FakeCamera(fail_opens=6, max_backoff_s=4.0)
    frame = camera.read()
    assert camera.sleeps == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert camera.stats.reconnects == 6 and camera.opens == 7
    assert frame.index == 0 and tuple(frame.image[0, 0]) == (255, 0, 0)
    assert camera.stats.frames == 1


def test_backoff_restarts_after_a_good_frame():
    camera = FakeCamera(grabs=[True, False, False, True, False, True])
    assert [camera.read().index for _ in range(3)] == [0, 1, 2]
    assert camera.sleeps == [0.5, 1.0, 0.5]
    assert camera.stats.reconnects == 3
    assert all(c.released for c in camera.captures[:-1])  # old captures released


def test_gives_up_after_max_reconnects():
    camera = FakeCamera(fail_opens=10**6, max_reconnects=3, max_backoff_s=8.0)
    camera.open()  # a camera that is not up yet is retried by read(), not refused here
    with pytest.raises(SourceError) as info:
        camera.read()
    assert str(info.value) == "camera fake://cam disconnected; gave up after 3 reconnects"
    assert camera.sleeps == [0.5, 1.0, 2.0] and camera.stats.reconnects == 3


def test_no_reconnect_fails_at_once():
    with pytest.raises(SourceError, match="could not open camera fake://cam"):
        FakeCamera(fail_opens=1, reconnect=False).open()
    camera = FakeCamera(grabs=[True, False], reconnect=False)
    camera.read()
    with pytest.raises(SourceError, match="camera fake://cam disconnected$"):
        camera.read()
    assert camera.sleeps == []


def test_many_failures_do_not_overflow_the_backoff():
    camera = FakeCamera(max_backoff_s=8.0)
    camera._retry.failures = 5000
    assert camera._retry.delay() == 8.0


def test_frames_mask_credentials():
    camera = FakeCamera(uri="rtsp://admin:secret@cam/x")
    assert camera.read().source == "rtsp://***@cam/x"
    assert camera.uri == "rtsp://admin:secret@cam/x"


def test_close_wakes_a_reader_in_backoff():
    class DeadCamera(FakeCamera):
        def __init__(self):
            CaptureSource.__init__(self, "fake://dead", live=True, max_backoff_s=30.0)
            self.fail_opens, self.opens, self.grabs, self.captures = 10**6, 0, None, []

    camera = DeadCamera()  # default sleep: an Event wait that close() interrupts
    results = []
    reader = threading.Thread(target=lambda: results.append(camera.read()))
    reader.start()
    while camera.stats.reconnects == 0 and reader.is_alive():
        threading.Event().wait(0.01)
    camera.close()
    reader.join(timeout=5)
    assert not reader.is_alive() and results == [None]
    assert camera.read() is None


class StalledCamera(FakeCamera):
    """A network camera whose open (or, with `stall_reads`, each read) blocks until `answer` is set,
    as FFmpeg's does on a server that accepts the connection and never speaks."""

    def __init__(self, stall_reads: bool = False):
        super().__init__()
        self.stall_reads = stall_reads
        self.entered, self.answer = threading.Event(), threading.Event()

    def _open_capture(self):
        if not self.stall_reads:
            self.entered.set()
            self.answer.wait()
        return super()._open_capture()

    def _grab(self):
        if self.stall_reads:
            self.entered.set()
            self.answer.wait()
        return super()._grab()


@pytest.mark.parametrize("stall_reads", [False, True], ids=["open", "read"])
def test_close_does_not_wait_for_a_stalled_open_or_read_and_the_capture_is_released_after(stall_reads):
    """close() waited for the reader's lock, held through the whole blocking open (the daemon's
    DELETE, on its event loop, took 8.6 s). Now it marks the source closed and returns; the
    reader releases the capture when its call returns."""
    camera = StalledCamera(stall_reads)
    results = []
    reader = threading.Thread(target=lambda: results.append(camera.read()), daemon=True)
    reader.start()
    assert camera.entered.wait(10)
    closer = threading.Thread(target=camera.close, daemon=True)
    closer.start()
    closer.join(10)
    try:
        assert not closer.is_alive(), "close() waited for the stalled camera"
        assert camera.read() is None  # closed: no frame, and no waiting either
    finally:
        camera.answer.set()
    reader.join(10)
    assert not reader.is_alive() and results == [None]  # nothing delivered after close
    assert camera.captures and all(c.released for c in camera.captures)
    assert camera._capture is None


# ---- limits before work, paths that are no file, cameras that can never open -------------

def opened_within(source, seconds: float = 10.0) -> BaseException | None:
    """source.open() in a thread: the error it raised (None if it opened); a hang fails."""
    out: list = []

    def target():
        try:
            source.open()
            out.append(None)
        except BaseException as e:  # returned to the test
            out.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{source!r}.open() blocked"
    return out[0]


def test_synthetic_size_over_the_pixel_limit_is_refused_before_a_frame(monkeypatch):
    made = []
    monkeypatch.setattr("edgemm.model.scenes.make_scene", lambda *a, **k: made.append(1))
    with pytest.raises(SourceUnusable) as info:
        open_source("synthetic://?size=10000")  # 10⁸ pixels: 300 MB a frame, 40 M allowed by default
    assert str(info.value) == ("synthetic://?size=10000: size 10000 makes 100000000 pixels per frame, "
                               "above limits.max_pixels (25000000)")
    with pytest.raises(SourceUnusable, match=r"size 65 makes 4225 pixels .*\(4096\)"):
        open_source("synthetic://?size=65", max_pixels=64 * 64)
    with pytest.raises(SourceUnusable, match=r"size 65 makes 4225 pixels"):
        check_uri("synthetic://?size=65", max_pixels=64 * 64)  # the check the daemon makes of its config
    assert made == []
    assert open_source("synthetic://?size=64&count=1", max_pixels=64 * 64) is not None
    assert check_uri("synthetic://?size=64", max_pixels=64 * 64).options == {"size": 64}


@pytest.mark.parametrize("name", ["clip.mp4", "photo.png"])
def test_a_fifo_as_a_file_source_is_refused_without_blocking(tmp_path, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)  # opening it for reading would wait for a writer for ever
    for uri in (str(fifo), f"file://{fifo}"):
        error = opened_within(open_source(uri))
        assert isinstance(error, SourceUnusable), error
        assert str(error) == f"{fifo} is not a regular file: it is a FIFO"


def test_a_device_as_a_file_source_is_refused():
    error = opened_within(open_source("file:///dev/zero"))  # a video to OpenCV: it would read for ever
    assert isinstance(error, SourceUnusable)
    assert str(error) == ("/dev/zero is not a regular file: it is a character device; "
                          "for a camera use v4l2:///dev/zero")


@pytest.mark.parametrize("uri, message", [
    ("v4l2:///etc/passwd", "/etc/passwd is not a camera: it is a regular file, not a V4L2 device node"),
    ("v4l2:///tmp", "/tmp is not a camera: it is a folder, not a V4L2 device node"),
    ("v4l2:///dev/null", "/dev/null is not a camera: character device 1:3, V4L2 devices are 81:N"),
])
def test_a_v4l2_path_that_is_no_camera_is_unusable(uri, message):
    source = open_source(uri)
    with pytest.raises(SourceUnusable) as info:
        source.check()  # the check that opens nothing, as POST /v1/streams makes it
    assert str(info.value) == message
    assert isinstance(opened_within(open_source(uri)), SourceUnusable)


def test_a_v4l2_device_without_permission_is_unusable(monkeypatch):
    # /dev/null stands in for a camera node (major 81) that this user may not open (tests run as root)
    monkeypatch.setattr(capture, "V4L2_MAJOR", os.major(os.stat("/dev/null").st_rdev))
    monkeypatch.setattr(capture.os, "access", lambda path, mode: False)
    with pytest.raises(SourceUnusable, match=r"^camera /dev/null: permission denied \(add the user to the group"):
        open_source("v4l2:///dev/null").check()


def test_a_missing_v4l2_device_may_yet_appear():
    with pytest.raises(SourceError) as info:
        open_source("v4l2:///dev/video99").check()
    assert not isinstance(info.value, SourceUnusable)  # udev may create it after the daemon started


def test_pipeline_elements():
    assert pipeline_elements(csi_pipeline(0)) == ["nvarguscamerasrc", "nvvidconv", "videoconvert", "appsink"]
    assert pipeline_elements(rtsp_pipeline("rtsp://cam/x", 10)) == ["rtspsrc", "decodebin", "videoconvert", "appsink"]


def test_csi_whose_pipeline_cannot_be_built_is_unusable(monkeypatch):
    """GStreamer in OpenCV, but no nvarguscamerasrc (not a Jetson, or no JetPack plugins)."""
    monkeypatch.setattr(gstreamer, "gstreamer_available", lambda: True)
    monkeypatch.setattr(gstreamer, "gstreamer_element_exists", lambda name: name != "nvarguscamerasrc")
    opened = []
    monkeypatch.setattr(capture, "video_capture", lambda *args: opened.append(args))
    with pytest.raises(SourceUnusable) as info:
        open_source("csi://0").open()
    assert str(info.value) == ("csi://0: GStreamer has no element nvarguscamerasrc "
                               "(NVIDIA's GStreamer plugins come with JetPack, on a Jetson only)")
    assert opened == []  # refused before OpenCV was asked
    monkeypatch.setattr(gstreamer, "gstreamer_element_exists", lambda name: name != "rtspsrc")
    with pytest.raises(SourceUnusable, match=r"^rtsp://cam/x\?backend=gstreamer: GStreamer has no element rtspsrc"):
        open_source("rtsp://cam/x?backend=gstreamer").open()


@pytest.mark.skipif(ctypes.util.find_library("gstreamer-1.0") is None, reason="needs libgstreamer-1.0")
def test_gstreamer_element_exists_asks_the_real_registry():
    gstreamer.gstreamer_element_exists.cache_clear()
    try:
        assert gstreamer.gstreamer_element_exists("fakesrc") is True  # in GStreamer's core
        assert gstreamer.gstreamer_element_exists("nvarguscamerasrc-nowhere") is False
    finally:
        gstreamer.gstreamer_element_exists.cache_clear()


@pytest.mark.skipif(shutil.which("gst-inspect-1.0") is None, reason="needs GStreamer's gst-inspect-1.0")
def test_gstreamer_element_exists_without_the_library_asks_gst_inspect(monkeypatch):
    monkeypatch.setattr(gstreamer, "_gstreamer_registry", lambda: None)
    gstreamer.gstreamer_element_exists.cache_clear()
    try:
        assert gstreamer.gstreamer_element_exists("fakesrc") is True
        assert gstreamer.gstreamer_element_exists("nvarguscamerasrc-nowhere") is False
    finally:
        gstreamer.gstreamer_element_exists.cache_clear()


def test_gstreamer_element_exists_says_none_when_nobody_can_tell(monkeypatch):
    monkeypatch.setattr(gstreamer, "_gstreamer_registry", lambda: None)
    monkeypatch.setattr(gstreamer.shutil, "which", lambda name: None)
    gstreamer.gstreamer_element_exists.cache_clear()
    try:
        assert gstreamer.gstreamer_element_exists("nvarguscamerasrc") is None
    finally:
        gstreamer.gstreamer_element_exists.cache_clear()


def test_without_gstreamer_csi_is_unusable(no_gstreamer):
    with pytest.raises(SourceUnusable):
        open_source("csi://0").check()


def test_a_camera_that_does_not_open_first_is_an_error_when_not_waited_for():
    camera = FakeCamera(fail_opens=1, wait_for_camera=False)
    with pytest.raises(SourceError, match="^could not open camera fake://cam$"):
        camera.open()
    assert camera.sleeps == []
    # one that opened, then stops delivering, is still reconnected
    camera = FakeCamera(grabs=[True, False, True], wait_for_camera=False)
    assert [camera.read().index for _ in range(2)] == [0, 1]
    assert camera.sleeps == [0.5] and camera.stats.reconnects == 1


def test_a_source_reports_its_health_on_changes_only():
    camera = FakeCamera(fail_opens=2, grabs=[True, True, False, True])
    reports = []
    camera.on_health = reports.append
    camera.open()
    assert reports == ["could not open camera fake://cam"]
    camera.read()  # two failed opens, then a frame
    assert reports == ["could not open camera fake://cam"] * 3 + [None]
    camera.read()  # delivering goes on: nothing to report
    assert len(reports) == 4
    camera.read()  # a grab fails, the camera is reopened, and delivers again
    assert reports[4:] == ["camera fake://cam delivers no frames", None]
    assert camera.stats.last_error == "camera fake://cam delivers no frames"


def test_video_frames_carry_the_file_timestamps(tmp_path):
    path = write_video(tmp_path / "clip.avi", [RED_BGR] * 5)  # 10 fps
    frames = list(open_source(str(path)))
    assert [f.media_time for f in frames] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert open_source("synthetic://?count=1&size=32").read().media_time is None
