"""The daemon's streams tell the truth about their sources, against a real daemon on a
temporary socket (test_server's): a source that has never delivered a frame is
`retrying` with the last error, never `running`; a source no retry can fix is refused
by POST /v1/streams with 400, or, named in the config, goes to `failed` with its cause;
a camera that delivered and then stops is `retrying` until it delivers again. Also: SSE
events are numbered with SSE's own `id:` field.

Cameras that cannot be on this machine are faked the way tests/test_sources.py fakes
them (OpenCV without GStreamer, GStreamer without nvarguscamerasrc); the RTSP camera
that refuses connections is real (127.0.0.1, port 1).
"""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from test_server import assert_error, metric, raw_client, running, sock_path, synthetic, wait_until
from test_sources import StalledCamera

import edgemm.streams.manager
from edgemm.streams.sources import gstreamer
from edgemm.config import load_config
from edgemm.server.daemon import Daemon
from edgemm.errors import ConfigError, InputError
from edgemm.streams.sources.capture import CaptureSource

NEVER_OPENS = "rtsp://127.0.0.1:1/x"  # nothing listens on port 1: every open is refused


def stream(stream_id: str, source: str) -> dict:
    return {"id": stream_id, "source": source, "prompt": "how many shapes are there ?", "tier": "low",
            "max_new_tokens": 1}


@pytest.fixture
def quiet(monkeypatch):
    """The sources' and streams' warnings (reconnecting …) stay out of the test output."""
    for name in ("edgemm.streams.sources.capture", "edgemm"):
        monkeypatch.setattr(edgemm.streams.manager.logging.getLogger(name), "disabled", True)


def test_a_stream_that_never_delivered_is_retrying_with_the_last_error(runtime, quiet):
    with running(runtime, source_hosts=["127.0.0.1:1"]) as d, raw_client(sock_path(d)) as http:
        created = http.post("/v1/streams", json=stream("gate", NEVER_OPENS))
        assert created.status_code == 201, created.text
        wait_until(lambda: http.get("/v1/streams/gate").json()["state"] == "retrying", what="state retrying")
        figures = http.get("/v1/streams/gate").json()
        assert figures["frames"] == 0
        assert figures["last_error"] == ("could not open camera rtsp://127.0.0.1:1/x "
                                         "(unreachable, refused, or no such stream)")
        assert metric(http.get("/metrics").text, 'edgemm_stream_running{stream="gate"}') == 0
        assert http.delete("/v1/streams/gate").status_code == 200


@pytest.mark.parametrize("source, message", [
    ("v4l2:///etc/passwd", "/etc/passwd is not a camera: it is a regular file, not a V4L2 device node"),
    ("synthetic://?size=10000", "synthetic://?size=10000: size 10000 makes 100000000 pixels per frame, "
                                "above limits.max_pixels (25000000)"),
    # within max_pixels: a 25 MP generated scene per frame took the daemon to ~900 MB per stream
    ("synthetic://?fps=1000&size=5000", "synthetic://?fps=1000&size=5000: size 5000 makes 25000000 pixels per "
                                        "frame, above limits.max_synthetic_pixels (4000000)"),
    ("synthetic://?size=2001", "synthetic://?size=2001: size 2001 makes 4004001 pixels per frame, "
                               "above limits.max_synthetic_pixels (4000000)"),
    ("v4l2:///dev/video99", "camera /dev/video99 not found (is it plugged in?)"),
    ("csi://0", "csi://0 needs OpenCV built with GStreamer (this OpenCV has none; "
                "on a Jetson use JetPack's python3-opencv)"),
])
def test_the_api_refuses_a_source_that_cannot_work_with_400(runtime, monkeypatch, source, message):
    monkeypatch.setattr(gstreamer, "gstreamer_available", lambda: False)
    with running(runtime) as d, raw_client(sock_path(d)) as http:
        error = assert_error(http.post("/v1/streams", json=stream("cam", source)), 400)
        assert error["message"] == message
        assert http.get("/v1/streams").json()["data"] == []  # never started


def test_the_api_refuses_a_csi_camera_whose_pipeline_cannot_be_built(runtime, monkeypatch):
    """GStreamer, but no nvarguscamerasrc: accepted with 201 and retried for ever, before."""
    monkeypatch.setattr(gstreamer, "gstreamer_available", lambda: True)
    monkeypatch.setattr(gstreamer, "gstreamer_element_exists", lambda name: name != "nvarguscamerasrc")
    with running(runtime) as d, raw_client(sock_path(d)) as http:
        error = assert_error(http.post("/v1/streams", json=stream("cam", "csi://0")), 400)
        assert "GStreamer has no element nvarguscamerasrc" in error["message"]


def test_configured_sources_that_can_never_open_fail_and_are_not_retried(runtime, monkeypatch, quiet):
    monkeypatch.setattr(gstreamer, "gstreamer_available", lambda: False)
    streams = [stream("passwd", "v4l2:///etc/passwd"), stream("csi", "csi://0"), synthetic("synth")]
    with running(runtime, {"streams": streams}) as d, raw_client(sock_path(d)) as http:
        wait_until(lambda: {s["id"]: s["state"] for s in http.get("/v1/streams").json()["data"]}
                   == {"passwd": "failed", "csi": "failed", "synth": "running"}, what="the failed states")
        passwd, csi = (http.get(f"/v1/streams/{name}").json() for name in ("passwd", "csi"))
        assert passwd["last_error"] == "/etc/passwd is not a camera: it is a regular file, not a V4L2 device node"
        assert "needs OpenCV built with GStreamer" in csi["last_error"]
        for name in ("passwd", "csi"):  # given up at once: no retry loop goes on
            thread = d.service.streams.get(name).thread
            thread.join(10)
            assert not thread.is_alive()
        assert (passwd["retries"], csi["retries"]) == (0, 0)
        text = http.get("/metrics").text
        assert metric(text, 'edgemm_stream_running{stream="passwd"}') == 0
        assert metric(text, 'edgemm_stream_running{stream="synth"}') == 1


class FlakyCamera(CaptureSource):
    """A camera that delivers until `unplugged` is set, and again once it is cleared."""

    def __init__(self, uri: str):
        super().__init__(uri, live=True, max_backoff_s=0.05)
        self.unplugged = threading.Event()
        self.paced = threading.Event()  # waited on between frames: about 50 frames a second

    def _open_capture(self):
        return None if self.unplugged.is_set() else object()

    def _grab(self):
        self.paced.wait(0.02)
        return None if self.unplugged.is_set() else np.full((32, 32, 3), 80, np.uint8)


def test_a_camera_that_stops_after_delivering_is_retrying_until_it_delivers_again(runtime, monkeypatch, quiet):
    camera = FlakyCamera("rtsp://flaky/x")
    monkeypatch.setattr(edgemm.streams.manager, "open_source", lambda uri, **kw: camera)
    with running(runtime, source_hosts=["flaky"]) as d, raw_client(sock_path(d)) as http:
        assert http.post("/v1/streams", json=stream("flaky", "rtsp://flaky/x")).status_code == 201
        state = lambda: http.get("/v1/streams/flaky").json()["state"]  # noqa: E731
        wait_until(lambda: state() == "running" and http.get("/v1/streams/flaky").json()["frames"] > 0,
                   what="the camera to deliver")
        camera.unplugged.set()
        wait_until(lambda: state() == "retrying", what="state retrying after the camera stopped")
        assert http.get("/v1/streams/flaky").json()["last_error"] in (
            "camera rtsp://flaky/x delivers no frames",
            "could not open camera rtsp://flaky/x (unreachable, refused, or no such stream)")
        camera.unplugged.clear()
        wait_until(lambda: state() == "running", what="state running once it delivers again")
        assert http.get("/v1/streams/flaky").json()["source_reconnects"] >= 1


def test_stream_events_carry_sse_ids_in_order(runtime):
    with running(runtime, {"streams": [synthetic("synth")]}) as d, raw_client(sock_path(d), timeout=30) as http:
        ids, records = [], []
        with http.stream("GET", "/v1/streams/synth/events") as response:
            for line in response.iter_lines():
                if line.startswith("id: "):
                    ids.append(int(line[4:]))
                elif line.startswith("data: "):
                    records.append(json.loads(line[6:]))
                    if len(records) == 3:
                        break
        assert len(ids) == 3 and ids == list(range(ids[0], ids[0] + 3)) and ids[0] >= 1
        assert all(r["stream"] == "synth" and "frame" in r for r in records)


def test_a_configured_synthetic_size_over_the_pixel_limit_fails_the_start(runtime, tmp_path):
    cfg = load_config({"limits": {"max_pixels": 256 * 256},
                       "server": {"socket": str(tmp_path / "edgemm.sock")},
                       "streams": [stream("big", "synthetic://?size=300")]})
    with pytest.raises(InputError) as info:
        Daemon(cfg, runtime=runtime).run()
    assert str(info.value) == ("config: streams[0].source (big): synthetic://?size=300: size 300 makes "
                               "90000 pixels per frame, above limits.max_pixels (65536)")
    assert not (tmp_path / "edgemm.sock").exists()  # refused before the socket was made


class StalledCameras:
    """open_source's stand-in: each source made is a StalledCamera (tests/test_sources.py), whose
    open blocks until its `answer` is set, as FFmpeg's does on a server that accepts the RTSP
    connection and never speaks (the hostile tester's `socket.listen()` and nothing more)."""

    def __init__(self):
        self.made: list[StalledCamera] = []

    def __call__(self, uri: str, **limits) -> StalledCamera:
        self.made.append(StalledCamera())
        return self.made[-1]

    def opening(self) -> list[StalledCamera]:
        return [c for c in self.made if c.entered.is_set()]

    def answer_all(self) -> None:
        for camera in self.made:
            camera.answer.set()


def test_deleting_a_stream_whose_open_blocks_answers_at_once_and_the_loop_stays_free(runtime, monkeypatch, quiet):
    """The DELETE of a stream still opening its camera waited, on the event loop, for the open to
    return (8.6 s for FFmpeg's timeout; /healthz and the watchdog's heartbeat waited with it)."""
    cameras = StalledCameras()
    monkeypatch.setattr(edgemm.streams.manager, "open_source", cameras)
    try:
        with running(runtime, max_streams=1, source_hosts=["stalled"]) as d, \
                raw_client(sock_path(d), timeout=15) as http:
            assert http.post("/v1/streams", json=stream("cam", "rtsp://stalled/x")).status_code == 201
            wait_until(lambda: len(cameras.opening()) == 1, what="the stream to be opening its camera")
            (camera,) = cameras.opening()
            assert http.delete("/v1/streams/cam").status_code == 200
            assert http.get("/healthz").json() == {"status": "ok"}
            assert not camera.answer.is_set() and camera.captures == []  # all while the open still blocks
            # the deleted stream's thread is still in the open: it counts toward max_streams until it ends
            error = assert_error(http.post("/v1/streams", json=synthetic("next")), 503)
            assert "deleted streams have not ended yet" in error["message"]
            camera.answer.set()
            wait_until(lambda: camera.captures and camera.captures[0].released, what="the capture to be released")
            stopped = d.service.streams.stopping[0]
            stopped.thread.join(10)
            assert not stopped.thread.is_alive() and stopped.figures.state == "stopped"
            assert http.post("/v1/streams", json=synthetic("next")).status_code == 201
    finally:
        cameras.answer_all()


class HangingCamera(CaptureSource):
    """A camera that delivers (about 50 frames a second) until `hang` is set; then its next read
    blocks until `answer` is set, as a V4L2 or RTSP read can on a camera that stopped answering."""

    def __init__(self):
        super().__init__("rtsp://hanging/x", live=True, max_backoff_s=0.05)
        self.hang, self.hung, self.answer = threading.Event(), threading.Event(), threading.Event()

    def _open_capture(self):
        return object()

    def _grab(self):
        self.answer.wait(0.02)
        if self.hang.is_set() and not self.answer.is_set():
            self.hung.set()
            self.answer.wait()
        return np.full((32, 32, 3), 80, np.uint8)


def test_a_deleted_stream_whose_read_hangs_is_listed_as_stopping_and_holds_its_id(runtime, monkeypatch, quiet):
    """Such a stream holds one of server.max_streams (POST got 503 saying so) but GET /v1/streams,
    GET /v1/streams/{id} and /v1/status did not show it: the operator could not see why."""
    camera = HangingCamera()
    monkeypatch.setattr(edgemm.streams.manager, "open_source", lambda uri, **kw: camera)
    try:
        with running(runtime, max_streams=2, source_hosts=["hanging"]) as d, raw_client(sock_path(d)) as http:
            assert http.post("/v1/streams", json=stream("cam", "rtsp://hanging/x")).status_code == 201
            wait_until(lambda: http.get("/v1/streams/cam").json()["frames"] > 0, what="the camera to deliver")
            camera.hang.set()
            assert camera.hung.wait(10), "the camera's read did not hang"
            assert http.delete("/v1/streams/cam").status_code == 200
            (listed,) = http.get("/v1/streams").json()["data"]
            assert listed["id"] == "cam" and listed["state"] == "stopping" and listed["frames"] > 0
            assert 0 <= listed["stopping_s"] < 10
            assert http.get("/v1/streams/cam").json()["state"] == "stopping"
            assert http.get("/v1/status").json()["streams"] == 0
            assert http.get("/v1/status").json()["streams_stopping"] == 1
            assert "streams 0/0 running, 1 stopping" in d.service.status_line()
            # the same id again: 503 + Retry-After, naming it (its listeners and frame would be the new one's)
            refused = http.post("/v1/streams", json=stream("cam", "rtsp://hanging/x"))
            error = assert_error(refused, 503)
            assert refused.headers["Retry-After"]
            assert error["message"].startswith("server busy: the stream 'cam' deleted ")
            assert "has not ended yet (a camera call under way, or frames in flight); retry shortly" in error["message"]
            assert_error(http.patch("/v1/streams/cam", json={"prompt": "x"}), 404)  # nothing left to change
            again = http.delete("/v1/streams/cam")  # deleted already: the same answer, as GET still lists it
            assert again.status_code == 200 and again.json()["deleted"] is True
            assert http.get("/v1/streams/cam").json()["state"] == "stopping"
            # another id still has the place the deleted stream leaves
            assert http.post("/v1/streams", json=synthetic("yard")).status_code == 201
            assert [s["state"] == "stopping" for s in http.get("/v1/streams").json()["data"]] == [False, True]
            camera.answer.set()  # the read returns: the thread ends, and the stream is gone
            wait_until(lambda: [s["id"] for s in http.get("/v1/streams").json()["data"]] == ["yard"],
                       what="the deleted stream to go once its read returned")
            assert http.get("/v1/status").json()["streams_stopping"] == 0
            assert_error(http.get("/v1/streams/cam"), 404)
            assert http.post("/v1/streams", json=stream("cam", "rtsp://hanging/x")).status_code == 201
    finally:
        camera.answer.set()


def test_shutdown_with_streams_whose_opens_block_stays_within_the_grace_period(runtime, monkeypatch, quiet):
    """SIGTERM with four such streams took 60 s (each close waited for its open), past
    grace_period_s. The daemon now drains without waiting for them (30 s here is only a hang's bound)."""
    cameras = StalledCameras()
    monkeypatch.setattr(edgemm.streams.manager, "open_source", cameras)
    streams = [stream(f"cam{i}", f"rtsp://stalled{i}/x") for i in range(4)]
    try:
        with running(runtime, {"streams": streams}, grace_period_s=1):
            wait_until(lambda: len(cameras.opening()) == 4, what="four streams opening their cameras")
        # running() asked the daemon to stop and found it stopped, while every open still blocks
        assert not any(camera.answer.is_set() for camera in cameras.made)
    finally:
        cameras.answer_all()
    wait_until(lambda: all(c.captures and c.captures[0].released for c in cameras.opening()),
               what="the captures to be released once the opens returned")


@pytest.mark.parametrize("hosts, source, message", [
    ([], "rtsp://169.254.169.254:80/x", "the API may not start network sources: server.source_hosts is empty"),
    ([], "rtsp://127.0.0.1:22/x", "the API may not start network sources: server.source_hosts is empty"),
    (["127.0.0.1:554"], "rtsp://127.0.0.1:22/x", "a source at 127.0.0.1 port 22 is not in server.source_hosts "
                                                 "(127.0.0.1:554)"),
    (["cam.lan"], "rtsps://user:pw@10.0.0.1/x", "a source at 10.0.0.1 port 322 is not in server.source_hosts"),
    (["127.0.0.1"], "rtsp://127.0.0.2/x", "a source at 127.0.0.2 port 554 is not in server.source_hosts"),
])
def test_the_api_starts_network_sources_on_the_hosts_of_source_hosts_only(runtime, hosts, source, message):
    """POST /v1/streams with rtsp://169.254.169.254:80/x or rtsp://127.0.0.1:<any port> got 201, and
    the stream's state then told whether that port answered: a port scanner through the daemon."""
    with running(runtime, source_hosts=hosts) as d, raw_client(sock_path(d)) as http:
        error = assert_error(http.post("/v1/streams", json=stream("probe", source)), 403)
        assert error["message"].startswith(message) and "\n" not in error["message"]
        assert "pw" not in error["message"]
        assert http.get("/v1/streams").json()["data"] == []  # never started


def test_network_sources_on_an_allowed_host_start_and_the_config_file_names_any(runtime, quiet):
    configured = stream("configured", NEVER_OPENS)  # not in source_hosts: the config file's own choice
    with running(runtime, {"streams": [configured]}, source_hosts=["Localhost", "127.0.0.1:1"]) as d, \
            raw_client(sock_path(d)) as http:
        assert http.post("/v1/streams", json=stream("loopback", "rtsp://127.0.0.1:1/x")).status_code == 201
        assert http.post("/v1/streams", json=stream("named", "rtsp://localhost:9/x")).status_code == 201
        wait_until(lambda: http.get("/v1/streams/configured").json()["state"] == "retrying", what="retrying")


def test_an_rtsp_uri_that_could_leave_the_gstreamer_location_is_400(runtime):
    """rtspsrc location="…": a quote in the URI would end it, and what follows would be pipeline
    elements of the client's choosing (on a host source_hosts allows)."""
    with running(runtime, source_hosts=["cam"]) as d, raw_client(sock_path(d)) as http:
        for source in ('rtsp://cam/x" ! filesrc location=/etc/passwd ! fakesink', "rtsp://cam/a b",
                       "rtsp://cam/a\\b", "rtsp://cam/a\tb"):
            error = assert_error(http.post("/v1/streams", json=stream("cam", source)), 400, param="source")
            assert "an rtsp:// URI has no spaces, quotes, backslashes or control characters" in error["message"]
        assert http.get("/v1/streams").json()["data"] == []


def test_an_rtsp_uri_whose_host_gstreamer_reads_differently_is_400(runtime):
    """GStreamer's RTSP parser takes the first @ and reads past a #; Python's (which checks
    source_hosts) the last @ and stops at #: `rtsp://cam:1#@evil/x` was cam to the check and evil
    to rtspsrc. A malformed port behind such a URI was a 500."""
    with running(runtime, source_hosts=["cam"]) as d, raw_client(sock_path(d)) as http:
        for source in ("rtsp://cam:1#@evil/x?backend=gstreamer", "rtsp://u@evil@cam/x", "rtsp://cam:x#@evil/x",
                       "rtsp://cam/x#frag"):
            error = assert_error(http.post("/v1/streams", json=stream("cam", source)), 400, param="source")
            assert "at most one @ (user:password@host) and no #" in error["message"]
        assert http.get("/v1/streams").json()["data"] == []


def test_source_hosts_entries_are_checked_as_webhook_hosts_are():
    with pytest.raises(ConfigError, match=r"server.source_hosts\[0\]' must be a host name or address"):
        load_config({"server": {"source_hosts": ["rtsp://cam/x"]}})


def test_a_sources_credentials_are_never_shown(runtime):
    """rtsp://user:password@… is the camera's secret: the API and the page show ***@ instead (the
    stream still opens the camera with them)."""
    from test_server import raw_client, running, sock_path
    secret = "hunter2"
    spec = {"id": "cam", "source": f"rtsp://admin:{secret}@127.0.0.1:1/s", "prompt": "describe the image"}
    with running(runtime, {"streams": [{**spec, "id": "configured"}]}, source_hosts=["127.0.0.1"]) as d, \
            raw_client(sock_path(d)) as http:
        created = http.post("/v1/streams", json=spec)
        assert created.status_code == 201 and secret not in created.text
        assert created.json()["source"] == "rtsp://***@127.0.0.1:1/s"
        for path in ("/v1/streams", "/v1/streams/cam", "/v1/streams/configured", "/v1/status"):
            assert secret not in http.get(path).text, path
        assert d.service.streams.get("cam").spec.source == spec["source"]  # what the camera is opened with


def test_a_password_in_the_query_or_unescaped_in_the_user_info_is_never_shown(runtime):
    """Cheap cameras take ?user=…&password=…; a password with an unescaped # is refused (400),
    and neither shows the secret."""
    from test_server import raw_client, running, sock_path
    secret = "hunter2"
    spec = {"id": "cam", "source": f"rtsp://127.0.0.1:1/s?user=admin&password={secret}", "prompt": "describe the image"}
    with running(runtime, source_hosts=["127.0.0.1"]) as d, raw_client(sock_path(d)) as http:
        created = http.post("/v1/streams", json=spec)
        assert created.status_code == 201 and secret not in created.text
        assert created.json()["source"] == "rtsp://127.0.0.1:1/s?user=admin&password=***"
        for path in ("/v1/streams", "/v1/streams/cam", "/v1/status"):
            assert secret not in http.get(path).text, path
        refused = http.post("/v1/streams", json={**spec, "id": "hash", "source": f"rtsp://admin:{secret}#1@127.0.0.1:1/s"})
        assert refused.status_code == 400 and secret not in refused.text
        assert refused.json()["error"]["message"].startswith("rtsp://***@127.0.0.1:1/s: ")


def test_stream_states_show_as_their_strings_and_move_only_as_the_table_allows():
    """The API and /metrics show the same strings as ever; a change the table lacks is a bug, raised."""
    import json

    from edgemm.streams.state import StreamState
    assert [s.value for s in StreamState] == ["starting", "running", "retrying", "failed", "ended", "stopped",
                                              "stopping"]
    assert json.dumps({"state": StreamState.RETRYING}) == '{"state": "retrying"}'
    assert f"{StreamState.FAILED}" == "failed" and StreamState.RUNNING == "running"
    assert StreamState.STARTING.to(StreamState.RUNNING) is StreamState.RUNNING
    assert StreamState.FAILED.to(StreamState.STOPPED) is StreamState.STOPPED
    for stuck, new in [(StreamState.STOPPED, StreamState.RUNNING), (StreamState.FAILED, StreamState.RETRYING),
                       (StreamState.ENDED, StreamState.RUNNING), (StreamState.RUNNING, StreamState.STOPPING)]:
        with pytest.raises(ValueError, match=f"from {stuck.value} to {new.value}"):
            stuck.to(new)
