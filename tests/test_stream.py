"""Stream mode: the newest-wins slot, frame filtering, change gating (frames that barely
changed never reach the pipeline), run_stream on files (lossless, errors in place),
max_frames, drops on a fast live source, graceful stop, streams sharing one pipeline that
outlives them, and `edgemm stream` on the command line.

Timing is controlled with threading.Events wrapped around the runtime's stages, never by
sleeping. Only the last test looks at what the model answers: it needs the trained model.
"""
from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from click.testing import CliRunner

from edgemm.streams.sources import capture, gstreamer
from edgemm.cli.main import main
from edgemm.engine.pipeline import Pipeline
from edgemm.model.scenes import make_scene
from edgemm.streams.errors import SourceError
from edgemm.streams.sources import open_source
from edgemm.streams.sources.base import Frame, Source
from edgemm.streams.sources.capture import CaptureSource
from edgemm.streams.sources.gstreamer import gstreamer_available
from edgemm.streams.run import _END, ChangeGate, FrameFilter, LatestSlot, StreamOptions, run_stream

WAIT_S = 30  # upper bound for anything that should happen "now"; never a timing assumption
FAST = {"tier": "low", "max_new_tokens": 2}
ANSWER_FIELDS = {"frame", "tier", "answer", "stage_ms", "e2e_ms", "dropped"}


def frame(index: int, image=None) -> Frame:
    return Frame(index, image, 0.0, "test://")


def run_in_thread(runtime, source, options, emit, stop=None, pipeline=None):
    """run_stream, bounded: a hang fails the test instead of freezing the run. Without a
    `pipeline`, in one of its own that is closed at the end (as `edgemm stream` runs it)."""
    own = pipeline is None
    pipeline = pipeline if pipeline is not None else Pipeline(runtime, queue_size=options.share(source.live))
    out: dict = {}

    def target():
        try:
            out["summary"] = run_stream(pipeline, source, options, emit, stop)
        except BaseException as e:  # surfaced below
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "run_stream did not return"
    assert pipeline.alive() and not pipeline._closed, "run_stream closed the pipeline it was given"
    if own:
        pipeline.close()
    if "error" in out:
        raise out["error"]
    return out["summary"]


# ---- LatestSlot --------------------------------------------------------------------------------

def test_latest_slot_keeps_the_newest_and_counts_the_drop():
    slot = LatestSlot()
    slot.put("old")
    slot.put("new")
    assert slot.get() == "new"
    assert slot.dropped == 1
    slot.put("next")  # an emptied slot takes the next item without a drop
    assert slot.get() == "next" and slot.dropped == 1


def test_latest_slot_get_waits_for_a_put():
    slot = LatestSlot()
    got = []
    reader = threading.Thread(target=lambda: got.append(slot.get()))
    reader.start()
    reader.join(0.05)
    assert reader.is_alive() and not got  # nothing there yet: get() waits
    slot.put("item")
    reader.join(WAIT_S)
    assert got == ["item"]


def test_latest_slot_gives_the_waiting_frame_before_the_end():
    """The end of a source does not replace the last frame nobody took yet: it is given
    out first, and not counted as a drop (a paced synthetic count=N lost its last one)."""
    slot = LatestSlot()
    slot.put("frame")
    slot.put(_END)
    assert slot.dropped == 0
    slot.put("late frame")  # frames after the end are ignored, and not counted as drops
    assert slot.get() == "frame"
    assert slot.get() is _END and slot.get() is _END  # the end stays the end
    assert slot.dropped == 0


def test_latest_slot_gives_the_waiting_frame_before_the_source_error():
    slot = LatestSlot()
    slot.put("frame")
    failure = SourceError("camera fake:// disconnected")
    slot.put(failure)
    slot.put(_END)  # the error is final: the end does not replace it
    assert slot.get() == "frame" and slot.get() is failure and slot.dropped == 0


# ---- FrameFilter ----------------------------------------------------------------------------------

def test_frame_filter_every():
    kept = [i for i in range(8) if FrameFilter(3, None).keep(frame(i))]
    assert kept == [0, 3, 6]
    one = FrameFilter(1, None)
    assert all(one.keep(frame(i)) for i in range(5))


def test_frame_filter_fps_spaces_kept_frames_by_the_interval():
    now = [1000.0]  # a monotonic clock is far from 0 (seconds since boot)
    f = FrameFilter(1, 2.0, clock=lambda: now[0])
    kept = []
    for i in range(25):  # 8 frames a second for 3 s, filtered to 2 a second
        now[0] = 1000.0 + i * 0.125
        if f.keep(frame(i)):
            kept.append(now[0])
    assert kept == [1000.0, 1000.5, 1001.0, 1001.5, 1002.0, 1002.5, 1003.0]


def test_frame_filter_fps_after_a_gap_does_not_burst():
    now = [1000.0]
    f = FrameFilter(1, 2.0, clock=lambda: now[0])
    kept = []
    for t in (1000.0, 1002.0, 1002.125, 1002.25, 1002.5):  # the source stalled for 2 s
        now[0] = t
        if f.keep(frame(len(kept))):
            kept.append(t)
    assert all(b - a >= 0.5 for a, b in zip(kept, kept[1:])), kept
    assert kept == [1000.0, 1002.0, 1002.5]


def test_frame_filter_every_and_fps_together():
    now = [1000.0]
    f = FrameFilter(2, 1.0, clock=lambda: now[0])
    kept = []
    for i in range(12):  # 4 frames a second; every 2nd is a candidate, at most 1 a second
        now[0] = 1000.0 + i * 0.25
        if f.keep(frame(i)):
            kept.append(i)
    assert kept == [0, 4, 8]


# ---- ChangeGate ------------------------------------------------------------------------------------

def test_change_gate_reuses_for_an_identical_frame_only():
    gate = ChangeGate(threshold=2.0)
    scene = make_scene(7).image
    assert gate(scene) is False  # nothing to compare with yet
    assert gate(scene.copy()) is True
    assert gate(255 - scene) is False  # very different
    other = make_scene(8).image
    assert gate(other) is False
    assert gate(other.copy()) is True  # compared with the last processed frame
    gate.forget()  # the last processed frame failed: the next one is processed
    assert gate(other.copy()) is False


# ---- run_stream on files ------------------------------------------------------------------------

@pytest.fixture
def folder(tmp_path) -> Path:
    """Six scenes as PNG (00, 01, 02, 04, 05, 06) and a corrupt 03.png between them."""
    for i in range(7):
        path = tmp_path / f"{i:02d}.png"
        if i == 3:
            path.write_bytes(b"not a png at all")
        else:
            cv2.imwrite(str(path), cv2.cvtColor(make_scene(30 + i, size=64).image, cv2.COLOR_RGB2BGR))
    return tmp_path


def test_folder_is_lossless_in_order_with_the_bad_file_in_place(runtime, folder):
    records = []
    source = open_source(str(folder))
    summary = run_in_thread(runtime, source, StreamOptions("how many shapes are there ?", lossless_inflight=1,
                                                           generation=FAST), records.append)
    assert len(records) == 7
    assert set(records[3]) == {"error"} and "03.png" in records[3]["error"]
    answers = records[:3] + records[4:]
    assert [r["name"] for r in answers] == ["00.png", "01.png", "02.png", "04.png", "05.png", "06.png"]
    assert all(ANSWER_FIELDS <= set(r) and "error" not in r for r in answers)
    assert [r["frame"] for r in answers] == sorted(r["frame"] for r in answers)
    assert all(r["tier"] == "low" and r["dropped"] == 0 for r in answers)
    assert (summary.frames, summary.errors, summary.dropped, summary.skipped) == (6, 1, 0, 0)
    assert len(summary.latencies_ms) == 6


def test_max_frames_on_an_unpaced_synthetic_source(runtime):
    records = []
    source = open_source("synthetic://?count=50")
    assert not source.live
    summary = run_in_thread(runtime, source, StreamOptions("describe the image", max_frames=3,
                                                           generation=FAST), records.append)
    assert [r["frame"] for r in records] == [0, 1, 2]
    assert all(ANSWER_FIELDS <= set(r) for r in records)
    assert summary.frames == 3 and summary.errors == 0 and summary.dropped == 0
    assert source.stats.frames < 50  # it stopped reading, not read to the end


def test_every_skips_are_counted(runtime):
    records = []
    summary = run_in_thread(runtime, open_source("synthetic://?count=7&size=64"),
                            StreamOptions("p", every=3, generation=FAST), records.append)
    assert [r["frame"] for r in records] == [0, 3, 6]
    assert summary.frames == 3 and summary.skipped == 4


# ---- change gating in the stream: a frame that barely changed never enters the pipeline ----------

class EncodedImages:
    """runtime.encode counting the images that reach it (the pipeline's encode stage)."""

    def __init__(self, runtime):
        self.original, self.count = runtime.encode, 0

    def __call__(self, pixel_values, keys=None, route=None):
        self.count += len(pixel_values)
        return self.original(pixel_values, keys, route)


def test_change_gate_on_files_reuses_answers_without_the_encoder(runtime, tmp_path, monkeypatch):
    a, b = make_scene(7, size=64).image, make_scene(8, size=64).image
    for i, image in enumerate((a, a, a, b, b, a)):  # PNG is lossless: repeats are identical
        cv2.imwrite(str(tmp_path / f"{i:02d}.png"), cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
    encoded = EncodedImages(runtime)
    monkeypatch.setattr(runtime, "encode", encoded)
    records = []
    with Pipeline(runtime) as pipeline:
        summary = run_in_thread(runtime, open_source(str(tmp_path)),
                                StreamOptions("p", change_threshold=2.0, generation=FAST), records.append,
                                pipeline=pipeline)
    assert [r["frame"] for r in records] == list(range(6))
    assert [r["reused"] for r in records] == [False, True, True, False, True, False]
    assert encoded.count == 3  # only the processed frames reached the encoder …
    assert pipeline.stats.items["prepare"] == 3  # … or entered the pipeline at all
    for i in (1, 2, 4):  # the answer of the processed frame it resembles, with no stage time
        assert (records[i]["answer"], records[i]["tier"]) == (records[i - 1]["answer"], records[i - 1]["tier"])
        assert records[i]["stage_ms"] == {} and records[i]["latency_ms"] == 0.0
    assert all(ANSWER_FIELDS <= set(r) for r in records)
    assert (summary.frames, summary.reused, summary.errors) == (6, 3, 0)


class StaticLiveSource(Source):
    """A camera looking at a scene where nothing happens: `count` identical frames, each
    one made only once the previous one's line was emitted (so none is dropped)."""

    def __init__(self, count: int):
        super().__init__("fake://static-camera", live=True)
        self.count = count
        self.image = make_scene(9, size=64).image
        self.emitted = threading.Semaphore(0)  # released by the test's emit

    def _next_frame(self):
        if self._next_index > 0:
            assert self.emitted.acquire(timeout=WAIT_S), "the stream stopped emitting"
        return None if self._next_index >= self.count else self._frame(self.image.copy())


def test_change_gate_on_a_live_camera_reaches_the_encoder_once(runtime, monkeypatch):
    encoded = EncodedImages(runtime)
    monkeypatch.setattr(runtime, "encode", encoded)
    source = StaticLiveSource(count=20)
    records = []

    def emit(record):
        records.append(record)
        source.emitted.release()

    summary = run_in_thread(runtime, source, StreamOptions("p", change_threshold=1.0, generation=FAST), emit)
    assert [r["frame"] for r in records] == list(range(20))
    assert encoded.count == 1  # the first frame; every later one was answered from it
    assert records[0]["reused"] is False and all(r["reused"] for r in records[1:])
    assert len({r["answer"] for r in records}) == 1
    assert (summary.frames, summary.reused, summary.dropped, summary.errors) == (20, 19, 0, 0)


def test_change_gate_processes_the_next_frame_after_a_failed_one(runtime, monkeypatch):
    """The frame the gate compares with failed: a frame like it is processed, not given
    the error (the source waits for that failure before it delivers the second frame)."""
    failed = threading.Event()

    class FailureSignalling(Pipeline):
        def _fail(self, req, error):
            super()._fail(req, error)  # the future's callbacks (the gate's forget) run in here
            failed.set()

    class TwoIdenticalFrames(Source):
        image = make_scene(5, size=64).image

        def __init__(self):
            super().__init__("fake://two", live=False)

        def _next_frame(self):
            if self._next_index == 1:
                assert failed.wait(WAIT_S), "the first frame never failed"
            return None if self._next_index >= 2 else self._frame(self.image.copy())

    prepare = runtime.prepare
    calls = []

    def fail_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the first frame's preprocessing broke")
        return prepare(*args, **kwargs)

    monkeypatch.setattr(runtime, "prepare", fail_first)
    records = []
    with FailureSignalling(runtime) as pipeline:
        summary = run_in_thread(runtime, TwoIdenticalFrames(), StreamOptions("p", change_threshold=2.0,
                                                                             generation=FAST),
                                records.append, pipeline=pipeline)
    assert "broke" in records[0]["error"]
    assert records[1]["frame"] == 1 and records[1]["reused"] is False and "answer" in records[1]
    assert (summary.frames, summary.errors, summary.reused) == (1, 1, 0)


# ---- one pipeline for several streams ---------------------------------------------------------------

def test_streams_share_one_pipeline_that_outlives_them(runtime):
    pool = threading.BoundedSemaphore(2 * 2)  # as the daemon's: both streams' shares together
    with Pipeline(runtime, queue_size=2, reserved=2 * 2) as pipeline:
        runs = {}

        def one(name, seed):
            source = open_source(f"synthetic://?count=6&size=64&seed={seed}")
            records = []
            options = StreamOptions("p", lossless_inflight=2, generation=FAST, change_threshold=0.5, pool=pool)
            runs[name] = (run_stream(pipeline, source, options, records.append), records)

        threads = [threading.Thread(target=one, args=(name, seed), daemon=True)
                   for name, seed in (("a", 0), ("b", 100))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in threads)
        for name in "ab":
            summary, records = runs[name]
            assert [r["frame"] for r in records] == list(range(6)) and summary.frames == 6, name
        # both streams ended: the pipeline is still open and answering
        assert pipeline.alive() and pipeline.infer(make_scene(1, size=64).image, "p", **FAST).text is not None
        assert pipeline.stats.completed == 13
    # every share taken was given back (a BoundedSemaphore refuses one given back twice)
    assert all(pool.acquire(timeout=WAIT_S) for _ in range(4)) and not pool.acquire(blocking=False)


# ---- a fast live source: newest frame wins ------------------------------------------------------

class FastLiveSource(Source):
    """A camera that never waits: tiny distinct frames, as fast as they can be made.

    Sets `produced` once `signal_after` frames were made (the test's slow decoder waits on
    it) and ends once the test sets `enough`.
    """

    def __init__(self, signal_after: int):
        super().__init__("fake://fast-camera", live=True)
        self.signal_after = signal_after
        self.produced = threading.Event()
        self.enough = threading.Event()

    def _next_frame(self):
        if self.enough.is_set():
            return None
        i = self._next_index
        if i >= self.signal_after:
            self.produced.set()
        image = np.full((32, 32, 3), i % 256, np.uint8)
        image[0, 0] = (i // 256 % 256, i // 65536 % 256, 0)
        return self._frame(image)


def test_a_fast_live_source_drops_stale_frames_newest_first(runtime, monkeypatch):
    source = FastLiveSource(signal_after=60)
    open_batch = runtime.open_batch

    def slow_decode(route, finished, steps_by_rows=None):
        assert source.produced.wait(WAIT_S)  # the model "is slow" until 60 frames were captured
        return open_batch(route, finished, steps_by_rows)

    monkeypatch.setattr(runtime, "open_batch", slow_decode)
    records = []

    def emit(record):
        records.append(record)
        if len(records) == 4:
            source.enough.set()  # the camera stops after four answers

    summary = run_in_thread(runtime, source, StreamOptions("p", generation=FAST), emit)
    indices = [r["frame"] for r in records]
    assert len(records) >= 4 and all("error" not in r for r in records)
    assert summary.dropped > 0
    assert indices == sorted(set(indices))  # strictly increasing: newest-wins never reorders
    assert summary.frames == len(records) and summary.errors == 0
    # every captured frame was either answered or counted as dropped: none vanished
    assert summary.frames + summary.dropped == source.stats.frames
    reported = [r["dropped"] for r in records]
    assert reported == sorted(reported) and reported[-1] <= summary.dropped


class FailingLiveSource(Source):
    """A camera that gives three frames, then fails for good (no reconnect)."""

    def __init__(self):
        super().__init__("fake://dying-camera", live=True)

    def _next_frame(self):
        if self._next_index >= 3:
            raise SourceError("camera fake://dying-camera disconnected")
        return self._frame(np.full((32, 32, 3), 50 * self._next_index, np.uint8))


def test_a_live_source_failure_is_reported(runtime):
    records = []
    summary = run_in_thread(runtime, FailingLiveSource(), StreamOptions("p", generation=FAST),
                            records.append)
    assert summary.errors == 1
    assert records and "disconnected" in records[-1].get("error", "")
    assert summary.frames + summary.dropped == 3  # the error is not a dropped frame


# ---- graceful stop ------------------------------------------------------------------------------

def test_stop_answers_every_frame_already_taken(runtime, monkeypatch):
    submitted = []
    three_in = threading.Event()

    class CountingPipeline(Pipeline):
        def submit(self, request, block=True, timeout=None):
            future = super().submit(request, block, timeout)
            submitted.append(request.tag.index)
            if len(submitted) >= 3:
                three_in.set()
            return future

    open_batch = runtime.open_batch

    def decode_once_three_are_in(route, finished, steps_by_rows=None):
        assert three_in.wait(WAIT_S)  # so that frames are in flight when the stop comes
        return open_batch(route, finished, steps_by_rows)

    monkeypatch.setattr(runtime, "open_batch", decode_once_three_are_in)
    stop = threading.Event()
    records = []

    def emit(record):
        records.append(record)
        stop.set()  # after the first answer

    source = open_source("synthetic://?count=50&size=64")
    with CountingPipeline(runtime) as pipeline:
        summary = run_in_thread(runtime, source, StreamOptions("p", generation=FAST), emit, stop, pipeline)
    assert 3 <= len(submitted) < 50
    assert [r["frame"] for r in records] == submitted == list(range(len(submitted)))
    assert all("error" not in r for r in records)
    assert summary.frames == len(submitted)


def test_stop_while_a_live_camera_is_reconnecting(runtime, monkeypatch):
    """Ctrl-C with the camera unplugged: the reader is inside read(), retrying; stop must end it."""
    monkeypatch.setattr(logging.getLogger("edgemm.streams.sources.capture"), "disabled", True)  # reconnect warnings

    class UnpluggedCamera(CaptureSource):
        def __init__(self):
            super().__init__("fake://unplugged", live=True, max_backoff_s=0.05)

        def _open_capture(self):
            return None

    source = UnpluggedCamera()
    stop = threading.Event()
    done = threading.Event()
    pipeline = Pipeline(runtime)
    thread = threading.Thread(target=lambda: (run_stream(pipeline, source, StreamOptions("p"),
                                                         lambda r: None, stop), done.set()),
                              daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while source.stats.reconnects < 1:  # until the reader is inside the reconnect loop
            assert time.monotonic() < deadline, "the reader never tried to reconnect"
            time.sleep(0.005)
        stop.set()
        assert done.wait(5), "run_stream kept waiting on the camera after stop was set"
    finally:
        source.close()  # lets the reader out if run_stream did not
        thread.join(WAIT_S)
        pipeline.close()


# ---- the command line ----------------------------------------------------------------------------

@pytest.fixture
def cli(tmp_path):
    """`edgemm stream …` in-process on one onnxruntime thread; restores the signal handlers
    the command installs, so pytest keeps its own Ctrl-C handling."""
    config = tmp_path / "edgemm.yaml"
    config.write_text("backend:\n  intra_op_threads: 1\n  warmup: false\n")
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def invoke(*args: str):
        return CliRunner().invoke(main, ["stream", *map(str, args), "--config", str(config)])

    yield invoke
    for s, handler in saved.items():
        signal.signal(s, handler)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_cli_stream_prints_json_lines(cli):
    result = cli("synthetic://?count=5", "--max-frames", "3", "--tier", "low", "--max-new-tokens", "2")
    assert result.exit_code == 0, result.output
    records = json_lines(result.stdout)
    assert [r["frame"] for r in records] == [0, 1, 2]
    assert all(ANSWER_FIELDS <= set(r) for r in records)
    assert all(r["tier"] == "low" and isinstance(r["answer"], str) and r["dropped"] == 0 for r in records)
    assert all(isinstance(r["stage_ms"], dict) and "encode" in r["stage_ms"] for r in records)
    summary = [line for line in result.stderr.splitlines() if line.startswith("edgemm: summary: ")]
    assert len(summary) == 1 and json.loads(summary[0].split(": ", 2)[2])["frames"] == 3


def test_cli_stream_out_file(cli, tmp_path):
    out = tmp_path / "answers.jsonl"
    result = cli("synthetic://?count=5", "--max-frames", "3", "--tier", "low", "--max-new-tokens", "2",
                 "--out", out)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    records = json_lines(out.read_text())
    assert [r["frame"] for r in records] == [0, 1, 2] and all(ANSWER_FIELDS <= set(r) for r in records)


def test_cli_stream_missing_path(cli, tmp_path):
    result = cli(tmp_path / "no-such-clip.mp4")
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgemm: error:") and "no-such-clip.mp4" in lines[0]


@pytest.mark.skipif(gstreamer_available(), reason="this OpenCV has GStreamer: csi:// would try a camera")
def test_cli_stream_csi_without_gstreamer(cli):
    result = cli("csi://0")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgemm: error:") and "GStreamer" in lines[0]


# ---- end to end: needs the trained model ------------------------------------------------------------

def test_end_to_end_counts_shapes_in_a_video(cli, tmp_path):
    path = tmp_path / "clip.avi"
    scenes = [make_scene(200 + i, n_shapes=n) for i, n in enumerate((1, 2, 3, 4, 2))]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 5.0, (256, 256))
    assert writer.isOpened()
    for scene in scenes:
        writer.write(cv2.cvtColor(scene.image, cv2.COLOR_RGB2BGR))
    writer.release()

    result = cli(path, "--prompt", "how many shapes are there ?")
    assert result.exit_code == 0, result.output
    records = json_lines(result.stdout)
    assert [r["frame"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["answer"] for r in records] == [s.count() for s in scenes]


# ---- stream details: the last paced frame, --fps on files, a closed stdout, bad --out, cameras --------

def test_frame_filter_fps_goes_by_the_file_timestamps_not_the_clock():
    f = FrameFilter(1, 2.0, clock=lambda: 1000.0)  # the file is read in no time: the clock stands still
    kept = [i for i in range(30) if f.keep(Frame(i, None, 0.0, "clip", media_time=i * 0.1 + (3e-17 if i % 3 else 0)))]
    assert kept == [0, 5, 10, 15, 20, 25]


def stderr_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if not line.startswith("edgemm: warning:")]


def summary_of(result) -> dict:
    lines = [line for line in result.stderr.splitlines() if line.startswith("edgemm: summary: ")]
    assert len(lines) == 1, result.stderr
    return json.loads(lines[0].split(": ", 2)[2])


def test_cli_paced_synthetic_answers_every_frame_with_no_drops(cli):
    """5 frames a second: the tiny model keeps up, so all N are answered, the last one too."""
    result = cli("synthetic://?fps=5&count=6&size=64", "--tier", "low", "--max-new-tokens", "1")
    assert result.exit_code == 0, result.output
    records = json_lines(result.stdout)
    assert [r["frame"] for r in records] == list(range(6))
    assert all(r["dropped"] == 0 for r in records)
    assert (summary_of(result)["frames"], summary_of(result)["dropped"]) == (6, 0)


def test_cli_fps_on_a_video_file_samples_by_its_timestamps(cli, tmp_path):
    path = tmp_path / "three_seconds.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (64, 64))
    assert writer.isOpened()
    for i in range(30):  # 3 s at 10 fps
        writer.write(cv2.cvtColor(make_scene(300 + i, size=64).image, cv2.COLOR_RGB2BGR))
    writer.release()
    result = cli(path, "--fps", "2", "--tier", "low", "--max-new-tokens", "1")
    assert result.exit_code == 0, result.output
    assert [r["frame"] for r in json_lines(result.stdout)] == [0, 5, 10, 15, 20, 25]
    summary = summary_of(result)
    assert (summary["frames"], summary["skipped"], summary["dropped"]) == (6, 24, 0)


def test_cli_stream_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """`edgemm stream … | head -1`: the reader leaves after one line; the stream stops, says
    its summary on stderr and exits 0 (no BrokenPipeError, no 'internal error')."""
    config = tmp_path / "edgemm.yaml"
    config.write_text("backend:\n  intra_op_threads: 1\n  warmup: false\n")
    command = [sys.executable, "-m", "edgemm.cli.main", "stream", "synthetic://?count=200&size=64",
               "--tier", "low", "--max-new-tokens", "1", "--config", str(config)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = json.loads(process.stdout.readline())
        process.stdout.close()  # as head -1 does
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    text = stderr.decode()
    assert first["frame"] == 0
    assert process.returncode == 0, text
    assert "Error" not in text and "internal error" not in text and "Traceback" not in text
    lines = text.splitlines()
    assert lines and lines[-1].startswith("edgemm: summary: ")
    assert json.loads(lines[-1].split(": ", 2)[2])["frames"] < 200  # it stopped, it did not read on


def test_cli_stream_unwritable_out_is_exit_2(cli, tmp_path):
    out = tmp_path / "no-such-folder" / "answers.jsonl"
    result = cli("synthetic://?count=2&size=64", "--out", out)
    assert result.exit_code == 2
    assert stderr_lines(result) == [f"edgemm: error: cannot write --out {out}: No such file or directory"]


@pytest.mark.parametrize("flag, value, said", [
    ("--every", str(10**12), "1000000000000 is not in 1..1000"),  # the config's and the API's bound on every
    ("--every", "0", "0 is not in 1..1000"),
    ("--fps", "nan", "nan is not a finite number"),  # click's FloatRange let NaN through
    ("--fps", "inf", "inf is not a finite number"),
    ("--fps", "1e-320", "1e-320 is not in 0.001..1000"),  # an interval of inf between frames
    ("--fps", "-1", "-1.0 is not in 0.001..1000"),
    ("--change-threshold", "nan", "nan is not a finite number"),
    ("--change-threshold", "inf", "inf is not a finite number"),
    ("--change-threshold", "-0.5", "-0.5 is not in 0..255"),
    ("--change-threshold", "256", "256.0 is not in 0..255"),
    ("--max-frames", "-1", "-1 is not in the range x>=1."),
])
def test_cli_stream_bad_numbers_are_exit_2_in_one_line(cli, flag, value, said):
    result = cli("synthetic://?count=2&size=64", flag, value)
    assert result.exit_code == 2, result.output
    assert stderr_lines(result) == [f"edgemm: error: Invalid value for '{flag}': {said} "
                                    "(see 'main stream --help')"]  # CliRunner's prog name


def test_cli_stream_takes_the_bounds_themselves(cli):
    result = cli("synthetic://?count=2&size=64", "--every", "1000", "--fps", "1000", "--change-threshold", "255",
                 "--tier", "low", "--max-new-tokens", "1")
    assert result.exit_code == 0, result.output
    assert len([line for line in result.stdout.splitlines() if line.startswith("{")]) == 1  # frame 0 of 2


def test_cli_stream_synthetic_frames_over_max_synthetic_pixels_are_exit_2(cli, tmp_path):
    """A generated 25 MP scene per frame is within limits.max_pixels but not decoded, so no
    decode budget bounds it: refused before the model loads, not generated."""
    result = cli("synthetic://?count=1&size=5000")
    assert result.exit_code == 2, result.output
    assert stderr_lines(result) == ["edgemm: error: synthetic://?count=1&size=5000: size 5000 makes 25000000 "
                                    "pixels per frame, above limits.max_synthetic_pixels (4000000)"]
    config = tmp_path / "small.yaml"
    config.write_text("limits:\n  max_synthetic_pixels: 4096\n")  # the limit is the config's, not a constant
    result = CliRunner().invoke(main, ["stream", "synthetic://?count=1&size=65", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert stderr_lines(result)[-1].endswith("above limits.max_synthetic_pixels (4096)")


def test_cli_stream_unavailable_provider_is_exit_2(tmp_path):
    config = tmp_path / "edgemm.yaml"
    config.write_text("backend:\n  providers: [cuda]\n  warmup: false\n")  # not in the CPU onnxruntime build
    result = CliRunner().invoke(main, ["stream", "synthetic://?count=2&size=64", "--config", str(config)])
    assert result.exit_code == 2, result.output
    lines = stderr_lines(result)
    assert len(lines) == 1 and lines[0].startswith("edgemm: error: none of backend.providers ['cuda'] is available")


def invoke_bounded(cli, *args):
    """cli(*args) in a thread: a camera retried for ever fails the test instead of hanging it."""
    out = []
    thread = threading.Thread(target=lambda: out.append(cli(*args)), daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive(), f"edgemm stream {' '.join(args)} did not end"
    return out[0]


def test_cli_csi_whose_pipeline_cannot_be_built_exits_2(cli, monkeypatch):
    """GStreamer present, nvarguscamerasrc absent (faked: this machine is no Jetson)."""
    monkeypatch.setattr(gstreamer, "gstreamer_available", lambda: True)
    monkeypatch.setattr(gstreamer, "gstreamer_element_exists", lambda name: name != "nvarguscamerasrc")
    result = invoke_bounded(cli, "csi://0")
    assert result.exit_code == 2
    assert stderr_lines(result) == ["edgemm: error: csi://0: GStreamer has no element nvarguscamerasrc "
                                    "(NVIDIA's GStreamer plugins come with JetPack, on a Jetson only)"]


def test_cli_csi_camera_that_does_not_open_exits_2(cli, monkeypatch):
    """The pipeline's elements are there (or nobody can say), but OpenCV cannot open it: no
    camera on that sensor. Reported at once, not retried for ever."""
    monkeypatch.setattr(gstreamer, "gstreamer_available", lambda: True)
    monkeypatch.setattr(gstreamer, "gstreamer_element_exists", lambda name: None)
    monkeypatch.setattr(capture, "video_capture", lambda *args: None)  # OpenCV: not opened
    result = invoke_bounded(cli, "csi://1")
    assert result.exit_code == 2
    assert stderr_lines(result) == ["edgemm: error: could not open camera csi://1 (no camera on sensor 1, "
                                    "a mode it lacks, or nvargus-daemon is not running)"]


class SlowFiles(Source):
    """A lossless (or live) source whose every read takes a while, as OpenCV decoding a frame
    does: a reader is inside read() when the stream ends."""

    def __init__(self, live: bool):
        super().__init__("fake://slow", live=live)

    def _next_frame(self):
        time.sleep(0.1)
        return self._frame(np.full((32, 32, 3), self._next_index % 256, np.uint8))


@pytest.mark.parametrize("live", [False, True], ids=["files", "live"])
def test_an_emit_that_fails_ends_the_streams_threads_before_run_stream_returns(runtime, live):
    """`edgemm stream --out /dev/full`: emit raises; run_stream raises that error only once its
    reader (and feeder, stopper) have ended — one left inside a native call at interpreter exit
    could abort the process."""
    def emit(record):
        raise OSError(28, "No space left on device")

    before = set(threading.enumerate())
    with pytest.raises(OSError, match="No space left"):
        run_in_thread(runtime, SlowFiles(live), StreamOptions("describe the image", generation=FAST), emit)
    left = [t.name for t in set(threading.enumerate()) - before
            if t.name in ("edgemm-reader", "edgemm-feeder", "edgemm-stopper")]
    assert left == []
