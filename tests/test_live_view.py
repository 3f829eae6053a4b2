"""The live view (issue 23): the page at GET / in a real headless chromium against a real
daemon on TCP, the endpoints it uses (GET /v1/events, frame.jpg, PATCH a stream) over the
UNIX socket, their bounds, and `edgemm stream --view OUT`.

The browser is Debian's chromium driven over its DevTools protocol (tests/support/headless_browser.py);
CI installs it (.ci/run). The browser tests skip, saying so, only where no chromium is on PATH.
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from test_server import assert_error, raw_client, running, sock_path, wait_until
from test_stream_state import HangingCamera

import edgemm.engine.runtime
import edgemm.streams.manager
import edgemm.streams.view
from edgemm.cli.main import main
from edgemm.server.daemon import run_loop  # the daemon's loop (uvloop where installed): what the listener runs on
from edgemm.util.opencv import cv2
from edgemm.model.scenes import make_scene
from edgemm.streams.manager import EVENTS_BUFFER
from edgemm.streams.view import JPEG_MAX_SIDE, LatestFrame, annotate

from tests.support.headless_browser import HeadlessBrowser, find_chromium

COLOUR = "what color is the circle ?"
COUNT = "how many shapes are there ?"
needs_browser = pytest.mark.skipif(find_chromium() is None,
                                   reason="no chromium on PATH (apt-get install chromium; CI installs it)")


def tcp_url(daemon) -> str:
    tcp = [listener for listener in daemon.listeners if listener.sock.family == socket.AF_INET]
    host, port = tcp[0].sock.getsockname()
    return f"http://{host}:{port}/"


def page_cards(browser: HeadlessBrowser) -> dict:
    """What the page shows for each stream: its answer, whether its frame image has loaded, state."""
    return browser.evaluate("""JSON.stringify(Object.fromEntries([...document.querySelectorAll('.card')].map(c => [
        c.dataset.stream, {answer: c.querySelector('.answer').textContent,
                           frame_width: c.querySelector('img.frame').naturalWidth,
                           state: c.querySelector('.state').textContent,
                           age: c.querySelector('.age').textContent,
                           tier: c.querySelector('.tier').textContent}])))""")


def shown(browser: HeadlessBrowser) -> dict:
    return json.loads(page_cards(browser))


@needs_browser
def test_the_page_shows_a_running_streams_frame_and_answer_and_follows_it(runtime):
    """The issue's "within 3 s" is a figure bench/bench_view.py measures (docs/BENCHMARKS.md),
    not asserted here: on a loaded 2-core box only generous bounds are."""
    stream = {"id": "yard", "source": "synthetic://?fps=10", "prompt": COLOUR, "tier": "low", "max_new_tokens": 2}
    with running(runtime, {"streams": [stream]}, tcp_port=0) as d, raw_client(sock_path(d)) as http:
        wait_until(lambda: http.get("/v1/streams/yard").json()["frames"] >= 1, 30, "the stream's first answer")
        with HeadlessBrowser(tcp_url(d)) as browser:
            def frame_and_answer():
                card = shown(browser).get("yard")
                return card and card["answer"] and card["frame_width"] > 0
            wait_until(frame_and_answer, 30, "the page to show the stream's frame and answer")
            # its state is polled (/v1/streams, every second) and written with the next draw
            wait_until(lambda: shown(browser)["yard"]["state"], 30, "the stream's state")
            card = shown(browser)["yard"]
            assert card["state"] == "running" and card["tier"] == "low"
            wait_until(lambda: shown(browser)["yard"]["age"].endswith(" s"), 30, "the frame's age")
            assert float(shown(browser)["yard"]["age"][:-2]) >= 0  # capture to answer, plus since then
            # the scenes change every frame, so do the colours: the page follows the answers
            answers = {card["answer"]}
            wait_until(lambda: answers.add(shown(browser)["yard"]["answer"]) or len(answers) >= 3, 15,
                       "the page's answer to change")
            # the daemon's answers are what the page showed (one listener: the page's /v1/events)
            assert http.get("/v1/streams/yard").json()["listeners"] == 1
            assert d.service.streams.listener_count() == 1
            # an alert's change (edgemm.streams.alerts posts them to the stream's listeners) is a badge on its card
            alert = {"stream": "yard", "alert": "person", "state": "true", "frame": 7, "time": time.time()}
            d.service.streams.get("yard")._post_alert(alert)
            badge = "document.querySelector('[data-stream=yard] .alert')?.textContent"
            wait_until(lambda: browser.evaluate(badge) == "person: true", 5, "the alert's badge")
            d.service.streams.get("yard")._post_alert({**alert, "state": "false"})
            wait_until(lambda: browser.evaluate(badge) == "person: false", 5, "the alert's new state")


@needs_browser
def test_the_page_starts_a_stream_changes_its_prompt_and_stops_it(runtime):
    with running(runtime, tcp_port=0) as d, raw_client(sock_path(d)) as http, \
            HeadlessBrowser(tcp_url(d)) as browser:
        wait_until(lambda: browser.evaluate("document.getElementById('connection').textContent") == "live", 10,
                   "the page's event stream")
        browser.evaluate(f"""(() => {{ const f = document.getElementById('start');
            f.id.value = 'door'; f.source.value = 'synthetic://?fps=20'; f.prompt.value = {json.dumps(COLOUR)};
            f.fps.value = '5'; f.requestSubmit(); }})()""")
        wait_until(lambda: "door" in {s["id"] for s in http.get("/v1/streams").json()["data"]}, 10, "the new stream")
        created = http.get("/v1/streams/door").json()
        assert (created["source"], created["prompt"], created["fps"]) == ("synthetic://?fps=20", COLOUR, 5.0)
        wait_until(lambda: shown(browser).get("door", {}).get("answer"), 15, "the new stream's answer")
        browser.evaluate(f"""(() => {{ const f = document.querySelector('[data-stream=door] form.prompt');
            f.prompt.value = {json.dumps(COUNT)}; f.requestSubmit(); }})()""")
        wait_until(lambda: http.get("/v1/streams/door").json()["prompt"] == COUNT, 10, "the prompt to change")
        counts = {"one", "two", "three", "four", "five", "six"}
        wait_until(lambda: shown(browser)["door"]["answer"] in counts, 15, "a count as the answer")
        # a refused start is one line on the page, not a broken page
        browser.evaluate("""(() => { const f = document.getElementById('start');
            f.id.value = 'files'; f.source.value = '/etc'; f.requestSubmit(); })()""")
        wait_until(lambda: "config file" in browser.evaluate("document.getElementById('message').textContent"), 10,
                   "the 403's message")
        browser.evaluate("document.querySelector('[data-stream=door] button.stop').click()")
        wait_until(lambda: http.get("/v1/streams").json()["data"] == [], 10, "the stream to stop")
        wait_until(lambda: "door" not in shown(browser), 10, "the card to go")


@needs_browser
def test_a_deleted_stream_whose_camera_call_hangs_shows_as_stopping_with_nothing_to_change(runtime, monkeypatch):
    camera = HangingCamera()
    monkeypatch.setattr(edgemm.streams.manager, "open_source", lambda uri, **kw: camera)
    stream = {"id": "gate", "source": "rtsp://hanging/x", "prompt": COLOUR, "tier": "low", "max_new_tokens": 2}
    form = "getComputedStyle(document.querySelector('[data-stream=gate] form.prompt')).display"
    try:
        with running(runtime, {"streams": [stream]}, tcp_port=0) as d, raw_client(sock_path(d)) as http, \
                HeadlessBrowser(tcp_url(d)) as browser:
            wait_until(lambda: shown(browser).get("gate", {}).get("state") == "running", 30, "the running card")
            assert browser.evaluate(form) == "flex"
            camera.hang.set()
            assert camera.hung.wait(10), "the camera's read did not hang"
            browser.evaluate("document.querySelector('[data-stream=gate] button.stop').click()")
            wait_until(lambda: shown(browser).get("gate", {}).get("state") == "stopping", 10, "the stopping card")
            assert browser.evaluate(form) == "none"  # no prompt to change, no stop button
            said = browser.evaluate("document.querySelector('[data-stream=gate] .error').textContent")
            assert said.startswith("deleted ") and "waiting for its camera call to return" in said
            camera.answer.set()
            wait_until(lambda: "gate" not in shown(browser), 10, "the card to go once the stream ended")
            assert http.get("/v1/streams").json()["data"] == []
    finally:
        camera.answer.set()


@needs_browser
def test_an_error_is_not_wiped_by_an_older_answer_drawn_after_it(runtime, monkeypatch):
    """The daemon sends a stream's waiting result, then its error: the result is drawn once its
    frame has loaded, after the error, and must not blank it; a newer answer does. (The stream is
    real, so the page keeps its card, and its camera hangs from the start, so the daemon sends
    nothing of its own; the results are handed to the page's own showResult.)"""
    camera = HangingCamera()
    camera.hang.set()
    monkeypatch.setattr(edgemm.streams.manager, "open_source", lambda uri, **kw: camera)
    stream = {"id": "ghost", "source": "rtsp://hanging/x", "prompt": COLOUR, "tier": "low", "max_new_tokens": 2}
    try:
        with running(runtime, {"streams": [stream]}, tcp_port=0) as d, HeadlessBrowser(tcp_url(d)) as browser:
            error = "document.querySelector('[data-stream=ghost] .error').textContent"
            answer = "document.querySelector('[data-stream=ghost] .answer').textContent"
            wait_until(lambda: "ghost" in shown(browser), 30, "the stream's card")
            browser.evaluate("showResult(arrived({stream: 'ghost', frame: 1, answer: 'red', tier: 'low', latency_ms: 5,"
                             " e2e_ms: 5, dropped: 0})); showResult(arrived({stream: 'ghost', frame: 2,"
                             " error: 'internal error: boom'})); 1")
            wait_until(lambda: browser.evaluate(answer) == "red", 10, "the older answer drawn (no frame: 404)")
            assert browser.evaluate(error) == "internal error: boom"
            browser.evaluate("showResult(arrived({stream: 'ghost', frame: 3, answer: 'blue', tier: 'low', latency_ms: 5,"
                             " e2e_ms: 5, dropped: 0})); 1")
            wait_until(lambda: browser.evaluate(answer) == "blue", 10, "the newer answer drawn")
            assert browser.evaluate(error) == ""
            camera.answer.set()  # the daemon stops without waiting for it
    finally:
        camera.answer.set()


@needs_browser
def test_a_page_refused_by_max_stream_listeners_goes_live_once_there_is_room(runtime):
    """EventSource gives up for good on a 503: the page opens a new one after a backoff."""
    stream = {"id": "cam", "source": "synthetic://?fps=10", "prompt": COLOUR, "tier": "low", "max_new_tokens": 2}
    connection = "document.getElementById('connection').textContent"
    with running(runtime, {"streams": [stream]}, tcp_port=0, max_stream_listeners=1) as d:
        with HeadlessBrowser(tcp_url(d)) as first:
            wait_until(lambda: first.evaluate(connection) == "live", 30, "the first page's event stream")
            with HeadlessBrowser(tcp_url(d)) as second:
                wait_until(lambda: second.evaluate(connection).startswith("refused"), 30, "the second page's 503")
                first.close()  # its listener goes: room for the second
                wait_until(lambda: second.evaluate(connection) == "live", 60, "the second page to retry")
                results = "window.__results = window.__results || (() => { const seen = [];" \
                          " new MutationObserver(() => seen.push(1)).observe(document.querySelector(" \
                          "'[data-stream=cam] .answer'), {childList: true, characterData: true, subtree: true});" \
                          " return seen; })(), window.__results.length"
                second.evaluate(results)
                wait_until(lambda: second.evaluate(results) >= 3, 30, "live answers on the second page")
                assert d.service.streams.listener_count() == 1


@needs_browser
def test_alert_polling_survives_an_error_and_a_404(runtime):
    """A failed /v1/alerts is asked again (after a backoff); a 404 (a daemon without alerts) rarely."""
    with running(runtime, tcp_port=0) as d, HeadlessBrowser(tcp_url(d)) as browser:
        wait_until(lambda: browser.evaluate("typeof alertsWait") == "number", 30, "the page's script")
        # the next two /v1/alerts answer 503, then the daemon's own answers come through again
        browser.evaluate("""(() => { window.__alerts = []; const real = window.fetch;
            window.fetch = (url, ...rest) => {
                if (String(url).startsWith('/v1/alerts')) {
                    window.__alerts.push(1);
                    if (window.__alerts.length <= 2) return Promise.resolve(new Response('{}', {status: 503}));
                }
                return real(url, ...rest); }; })()""")
        wait_until(lambda: browser.evaluate("window.__alerts.length") >= 3, 60, "alerts asked again after errors")
        wait_until(lambda: browser.evaluate("alertsWait") == 2, 30, "the backoff reset by a good answer")
        browser.evaluate("""(() => { const real = window.fetch; window.fetch = (url, ...rest) =>
            String(url).startsWith('/v1/alerts') ? Promise.resolve(new Response('{}', {status: 404})) : real(url, ...rest);
            })()""")
        browser.evaluate("refreshAlerts()")
        assert browser.evaluate("alertsWait") == 30  # still asked, every 30 s


@needs_browser
def test_a_streams_text_is_shown_as_text_not_markup(runtime):
    """A prompt, an answer (a model's text), an alert's name and prompt holding markup: the page
    shows them as text and makes no element of them. A stream's id cannot hold markup (400)."""
    markup = "<img src=x onerror=alert(1)>"
    # a camera that never opens: no real answer replaces the one delivered here
    stream = {"id": "cam", "source": "rtsp://127.0.0.1:1/x", "prompt": markup}
    with running(runtime, {"streams": [stream]}, tcp_port=0) as d, raw_client(sock_path(d)) as http, \
            HeadlessBrowser(tcp_url(d)) as browser:
        assert_error(http.post("/v1/streams", json={**stream, "id": markup}), 400, param="id")
        wait_until(lambda: "cam" in shown(browser), 30, "the stream's card")
        cam = d.service.streams.get("cam")
        d._loop.call_soon_threadsafe(cam._deliver, {"stream": "cam", "answer": markup, "tier": markup,
                                                    "latency_ms": 1, "e2e_ms": 1, "dropped": 0, "frame": 0})
        cam._post_alert({"stream": "cam", "alert": markup, "state": "true", "prompt": markup, "frame": 0,
                         "time": time.time()})
        wait_until(lambda: shown(browser)["cam"]["answer"] == markup, 30, "the answer, as text")
        assert shown(browser)["cam"]["tier"] == markup
        wait_until(lambda: browser.evaluate("document.querySelector('[data-stream=cam] .alert')?.textContent")
                   == f"{markup}: true", 30, "the alert, as text")
        assert browser.evaluate("document.querySelector('[data-stream=cam] input[name=prompt]').value") == markup
        assert browser.evaluate("document.querySelectorAll('img').length") == \
            browser.evaluate("document.querySelectorAll('img.frame').length")  # no <img> but the frames
        assert browser.evaluate("document.querySelectorAll('[src=x], [onerror]').length") == 0


def test_the_page_and_its_endpoints_on_the_unix_socket(runtime):
    stream = {"id": "cam", "source": "synthetic://?fps=10", "prompt": COLOUR, "tier": "low", "max_new_tokens": 2}
    with running(runtime, {"streams": [stream]}, max_streams=3, source_hosts=["127.0.0.1"]) as d, \
            raw_client(sock_path(d)) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<script>" in page.text and "https://" not in page.text and "http://" not in page.text  # offline
        assert "new EventSource(`/v1/events?rate=${FRAMES_PER_S}&frames=jpeg`)" in page.text  # thinned to what it draws
        # before its first answer a stream has no frame (this camera never opens); after it, a bounded
        # JPEG of the latest
        http.post("/v1/streams", json={**stream, "id": "down", "source": "rtsp://127.0.0.1:1/x"})
        assert_error(http.get("/v1/streams/down/frame.jpg"), 404, "no_frame")
        http.post("/v1/streams", json={**stream, "id": "later", "source": "synthetic://?fps=1000&size=64"})
        assert_error(http.get("/v1/streams/nope/frame.jpg"), 404)
        wait_until(lambda: http.get("/v1/streams/cam").json()["frames"] >= 1, 30, "an answer")
        frame = http.get("/v1/streams/cam/frame.jpg")
        assert frame.status_code == 200 and frame.headers["content-type"] == "image/jpeg"
        image = cv2.imdecode(np.frombuffer(frame.content, np.uint8), cv2.IMREAD_COLOR)
        assert image.shape == (256, 256, 3)  # synthetic's size, under the 640 px bound
        # one listener for all streams: results of both, stream by stream
        seen: set[str] = set()
        with http.stream("GET", "/v1/events") as events:
            assert events.headers["content-type"].startswith("text/event-stream")
            for line in events.iter_lines():
                if line.startswith("data: "):
                    seen.add(json.loads(line[6:])["stream"])
                    if seen == {"cam", "later"}:
                        break
        # a prompt changes as POST validates it
        assert http.patch("/v1/streams/cam", json={"prompt": COUNT}).json()["prompt"] == COUNT
        assert_error(http.patch("/v1/streams/cam", json={"prompt": 5}), 400, param="prompt")
        assert_error(http.patch("/v1/streams/cam", json={"prompt": "x" * 4001}), 400, param="prompt")
        assert_error(http.patch("/v1/streams/cam", json={"prompt": "x" * 100_000}), 413, "request_too_large")
        assert_error(http.patch("/v1/streams/cam", json={"source": "csi://0"}), 400, param="source")
        assert_error(http.patch("/v1/streams/cam", content=b"[1]"), 400)
        assert_error(http.patch("/v1/streams/nope", json={"prompt": COUNT}), 404)
        wait_until(lambda: http.get("/v1/streams/cam").json()["last_result"]["answer"]
                   in {"one", "two", "three", "four", "five", "six"}, 15, "answers to the new prompt")


def test_the_all_streams_listener_is_one_of_max_stream_listeners(runtime):
    stream = {"id": "cam", "source": "synthetic://?fps=10", "prompt": COLOUR, "tier": "low", "max_new_tokens": 1}
    with running(runtime, {"streams": [stream]}, max_stream_listeners=1) as d, raw_client(sock_path(d)) as http:
        with raw_client(sock_path(d)) as other, other.stream("GET", "/v1/events") as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # the comment that opens it: registered by now
            assert_error(http.get("/v1/events"), 503)
            assert_error(http.get("/v1/streams/cam/events"), 503)
            assert d.service.streams.listener_count() == 1
        wait_until(lambda: d.service.streams.listener_count() == 0, 10, "the listener to go")


@pytest.mark.parametrize("path", ["/v1/streams/cam/events", "/v1/events"])
def test_both_listener_endpoints_send_keepalives_while_quiet(runtime, monkeypatch, path):
    """A listener that got no event for sse.KEEPALIVE_S gets a comment, so idle proxies keep it
    open; the events still come between them."""
    monkeypatch.setattr("edgemm.server.sse.KEEPALIVE_S", 0.02)  # a stream at 1 fps is quiet for most of each second
    stream = {"id": "cam", "source": "synthetic://?fps=1", "prompt": COLOUR, "tier": "low", "max_new_tokens": 1}
    lines: list[str] = []
    with running(runtime, {"streams": [stream]}) as d, raw_client(sock_path(d)) as http, \
            http.stream("GET", path) as events:
        for line in events.iter_lines():
            lines.append(line)
            results = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
            if results and lines.count(": keepalive") >= 2 or len(results) >= 5:  # 5: about 5 s without any
                break
    assert lines.count(": keepalive") >= 2
    assert results and all(result["stream"] == "cam" for result in results)


def test_stopping_the_daemon_ends_the_all_streams_listener_even_with_no_stream(runtime, monkeypatch):
    from edgemm.streams.manager import AllStreamsListener
    from test_server import in_background

    def read_all(path: str) -> int:
        with raw_client(path) as http, http.stream("GET", "/v1/events") as response:
            return sum(1 for _ in response.iter_lines())

    with running(runtime) as d:
        thread, read = in_background(read_all, sock_path(d))
        wait_until(lambda: d.service.streams.all_listeners, 30, "the listener")
        ends = []  # how the reader ended: its listener closed, not its connection cut at the deadline
        real_close = AllStreamsListener.close
        monkeypatch.setattr(AllStreamsListener, "close", lambda self: ends.append(1) or real_close(self))
        d.stop()
        thread.join(30)
        # ended by its END, the response whole (a connection cut at the grace period raises in read_all)
        assert not thread.is_alive() and ends == [1] and read == [2]  # its opening comment, a blank line


def test_a_browser_that_does_not_read_loses_the_oldest_events_counted(runtime):
    """A page that stops reading /v1/events: the stream goes on, the listener's buffer stays at
    EVENTS_BUFFER, and what it lost is counted in the stream's `lagged`."""
    stream = {"id": "cam", "source": "synthetic://?fps=1000&size=64", "prompt": COLOUR, "tier": "low",
              "max_new_tokens": 1}
    with running(runtime, {"streams": [stream]}) as d, raw_client(sock_path(d)) as http:
        manager = d.service.streams
        listener = None

        def subscribe():
            nonlocal listener
            listener = manager.listen_all()  # as GET /v1/events does; never read here

        d._loop.call_soon_threadsafe(subscribe)
        wait_until(lambda: listener is not None, 5, "the listener")
        start = http.get("/v1/streams/cam").json()["frames"]
        wait_until(lambda: http.get("/v1/streams/cam").json()["frames"] >= start + 3 * EVENTS_BUFFER, 60,
                   "the stream to answer on")
        assert listener.qsize() <= EVENTS_BUFFER
        assert http.get("/v1/streams/cam").json()["lagged"] >= EVENTS_BUFFER
        d._loop.call_soon_threadsafe(manager.unlisten_all, listener)


def test_a_new_prompt_is_asked_even_of_a_scene_the_change_gate_would_answer_again(runtime):
    """PATCH on a static camera with change_threshold: the reused answer was to the old prompt."""
    from test_stream import FAST, StaticLiveSource, run_in_thread

    from edgemm.streams.run import StreamOptions
    source = StaticLiveSource(count=8)
    options = StreamOptions(COLOUR, change_threshold=1.0, generation=FAST)
    records = []

    def emit(record):
        records.append(record)
        if len(records) == 3:
            options.prompt = COUNT  # what ManagedStream.change_prompt does
        source.emitted.release()

    run_in_thread(runtime, source, options, emit)
    asked = [r["reused"] for r in records]
    assert asked[:3] == [False, True, True]
    first_after = next(i for i in range(3, 8) if not asked[i])  # the next frame taken is asked anew
    assert first_after <= 4 and all(asked[first_after + 1:])
    assert records[first_after]["answer"] != records[0]["answer"]  # a count, not a colour


def test_latest_frame_is_encoded_once_per_answer_and_bounded():
    latest = LatestFrame()
    assert latest.jpeg() is None
    big = make_scene(3, size=1000).image
    frame = type("F", (), {"image": big})()
    latest.answer(frame, {"answer": "red"})
    assert latest.cached() is None  # not encoded until someone asks
    number, data = latest.jpeg()
    assert latest.jpeg()[1] is data  # the same bytes: not encoded again for a second viewer
    assert latest.cached() == (number, data)
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert max(image.shape[:2]) == JPEG_MAX_SIDE
    latest.answer(frame, {"error": "x"})  # an error has no frame to show: the last one stays
    assert latest.jpeg()[0] == number
    latest.answer(frame, {"answer": "blue"})
    assert latest.cached() is None  # a new answer: the old JPEG is not served for it
    assert latest.jpeg()[0] == number + 1


def test_latest_frame_keeps_the_last_answers_frames_by_number_each_encoded_once(monkeypatch):
    """/v1/events?frames=jpeg: a result's own frame, found by its `frame` number while it is one of
    the last KEPT_ANSWERED_FRAMES answered; encoded once however many ask; an error keeps none."""
    from edgemm.streams.view import KEPT_ANSWERED_FRAMES
    encodes = []
    real = edgemm.streams.view.jpeg
    monkeypatch.setattr(edgemm.streams.view, "jpeg", lambda image: encodes.append(1) or real(image))
    latest = LatestFrame()
    scenes = [make_scene(seed) for seed in range(KEPT_ANSWERED_FRAMES + 2)]
    for number, scene in enumerate(scenes):
        latest.answer(type("F", (), {"image": scene.image})(), {"frame": number, "answer": "x"})
    latest.answer(type("F", (), {"image": scenes[0].image})(), {"frame": 99, "error": "boom"})
    assert latest.jpeg_of(0) is None and latest.jpeg_of(1) is None  # older than the kept ones
    assert latest.jpeg_of(99) is None  # an error has no frame
    kept = range(len(scenes) - KEPT_ANSWERED_FRAMES, len(scenes))
    for number in kept:
        image = cv2.imdecode(np.frombuffer(latest.jpeg_of(number), np.uint8), cv2.IMREAD_COLOR)
        errors = [np.abs(image.astype(int) - scene.image.astype(int)).mean() for scene in scenes]
        assert int(np.argmin(errors)) == number  # its own frame, not the latest
    encodes.clear()
    last = kept[-1]
    assert latest.jpeg_of(last) is latest.jpeg_of(last) and encodes == []  # the last encode is kept
    # a source that numbers its frames anew (a restarted camera): the newer frame of that number
    latest.answer(type("F", (), {"image": scenes[0].image})(), {"frame": last, "answer": "y"})
    image = cv2.imdecode(np.frombuffer(latest.jpeg_of(last), np.uint8), cv2.IMREAD_COLOR)
    assert int(np.argmin([np.abs(image.astype(int) - scene.image.astype(int)).mean() for scene in scenes])) == 0


def test_viewers_asking_at_once_share_one_encode_per_answer(monkeypatch):
    """8 viewers at once, from threads (LatestFrame.jpeg) and from the event loop (frame.jpg's
    shared_encode): one encode per answer, on the live view's own threads."""
    import asyncio
    import threading

    import edgemm.server.liveview
    encodes, threads, release = [], set(), threading.Event()
    real = edgemm.streams.view.jpeg

    def counted(image):
        encodes.append(1)
        threads.add(threading.current_thread().name)
        release.wait(30)  # every viewer asks while this encode is under way
        return real(image)

    monkeypatch.setattr(edgemm.streams.view, "jpeg", counted)
    latest = LatestFrame()
    frame = type("F", (), {"image": make_scene(1).image})()
    latest.answer(frame, {"answer": "red"})
    results = []
    viewers = [threading.Thread(target=lambda: results.append(latest.jpeg())) for _ in range(8)]
    for viewer in viewers:
        viewer.start()
    wait_until(lambda: encodes, 30, "the first encode")
    release.set()
    for viewer in viewers:
        viewer.join(30)
    assert len(results) == 8 and len({id(data) for _, data in results}) == 1
    assert len(encodes) == 1

    async def eight_at_once():
        return await asyncio.gather(*(edgemm.server.liveview.shared_encode(latest) for _ in range(8)))

    latest.answer(frame, {"answer": "blue"})
    threads.clear()
    results = asyncio.run(eight_at_once())  # all 8 ask before the loop can see an encode finish
    assert len(encodes) == 2 and {number for number, _ in results} == {2}
    assert len({id(data) for _, data in results}) == 1
    assert all(name.startswith("edgemm-jpeg") for name in threads)  # not asyncio's default executor
    assert edgemm.server.liveview.encoding == {}  # nothing kept once it is done


# ---- edgemm stream --view OUT --------------------------------------------------------------

def run_cli(args: list[str]):
    from click.testing import CliRunner
    return CliRunner().invoke(main, args)


def video_frames(path: Path) -> list[np.ndarray]:
    capture = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, image = capture.read()
        if not ok:
            return frames
        frames.append(cv2.cvtColor(image, cv2.COLOR_BGR2RGB))


@pytest.mark.parametrize("source", ["synthetic://?count=12", "synthetic://?fps=30&count=12"])  # a file; a camera
def test_view_to_a_video_keeps_every_source_frame_with_the_answer_drawn(tmp_path, source):
    out = tmp_path / "view.avi"
    # --every 3: two frames in three are not answered, and still written, with the latest answer (a
    # live source's frames dropped while the model was busy too)
    result = run_cli(["stream", source, "--prompt", COLOUR, "--every", "3",
                      "--max-new-tokens", "2", "--view", str(out), "--out", str(tmp_path / "answers.jsonl")])
    assert result.exit_code == 0, result.output
    frames = video_frames(out)
    assert len(frames) == 12  # the source's frame count
    for index, image in enumerate(frames):
        source = make_scene(index).image  # synthetic frame i is make_scene(seed + i)
        difference = np.abs(image.astype(int) - source.astype(int)).mean(axis=2)
        band = difference[:30]  # where the answer is drawn (its band is 32 rows on a 256 px frame)
        below = difference[60:]
        assert band.mean() > 4 * below.mean() + 20, f"frame {index}: no text where it should be"
        assert below.mean() < 12, f"frame {index}: the scene under the band changed"


def test_view_to_a_folder_draws_each_answer_on_its_frames(tmp_path):
    out = tmp_path / "frames"
    result = run_cli(["stream", "synthetic://?count=6", "--prompt", COLOUR, "--every", "2",
                      "--max-new-tokens", "2", "--view", f"{out}/", "--out", str(tmp_path / "a.jsonl")])
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [a["frame"] for a in answers] == [0, 2, 4]
    files = sorted(out.iterdir())
    assert [f.name for f in files] == [f"frame_{i:06d}.jpg" for i in range(6)]
    for index, path in enumerate(files):
        image = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)
        record = answers[index // 2]  # a frame between answers carries the latest one
        expected = annotate(make_scene(index).image, {**record, "stream": None})
        # what was drawn is this frame with that answer (JPEG's loss aside), not another answer
        wrong = annotate(make_scene(index).image, {**record, "answer": "x" * 12})
        near = np.abs(image.astype(int) - expected.astype(int))[:30].mean()
        assert near < 0.7 * np.abs(image.astype(int) - wrong.astype(int))[:30].mean()


@pytest.mark.parametrize("out, message", [
    ("x.mkv", "a video file must end in .mp4 or .avi"),
    ("{tmp}/absent/x.avi", "no folder {tmp}/absent"),
    ("gopher://x", "unknown scheme"),
    ("rtp://host", "an RTP output is rtp://host:port"),
    ("display://zero", "a display is display://N"),
    ("display://0", "no display here (DISPLAY is not set)"),
    ("rtp://127.0.0.1:5000", "rtp:// needs OpenCV built with GStreamer"),
])
def test_a_view_that_cannot_work_is_one_line_and_exit_2(out, message, tmp_path, monkeypatch):
    out, message = out.format(tmp=tmp_path), message.format(tmp=tmp_path)
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setattr(edgemm.streams.view, "gstreamer_available", lambda: False)  # as PyPI's OpenCV
    result = run_cli(["stream", "synthetic://?count=1", "--view", out])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


class ModelLoaded(Exception):
    """Raised by a Runtime stand-in: the command got as far as loading the model."""


@pytest.mark.parametrize("out, message", [
    ("", "--view needs an OUT"),
    ("{tmp}/" + "a" * 300 + "/", "cannot write there (File name too long)"),
    ("{tmp}/" + "a" * 300 + ".mp4", "cannot write there (File name too long)"),
    ("/sys/edgemm-view/", "cannot write there ("),  # root too: sysfs takes no new folder
    ("/proc/edgemm-view.mp4", "cannot write there ("),
    ("/dev/null/frames/", "cannot write there (Not a directory)"),
    ("/dev/null", "a video file must end in .mp4 or .avi"),
])
def test_a_view_the_os_refuses_is_one_line_and_exit_2_before_the_model_loads(out, message, tmp_path, monkeypatch):
    def runtime(*args, **kwargs):
        raise ModelLoaded
    monkeypatch.setattr(edgemm.engine.runtime, "Runtime", runtime)
    result = run_cli(["stream", "synthetic://?count=1", "--view", out.format(tmp=tmp_path)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("edgemm: error: --view")


def test_a_view_folder_is_created_with_its_parents_before_the_model_loads(tmp_path, monkeypatch):
    out = tmp_path / "a" / "b" / "c"
    loaded = []
    def runtime(*args, **kwargs):
        loaded.append(out.is_dir())
        raise ModelLoaded
    monkeypatch.setattr(edgemm.engine.runtime, "Runtime", runtime)
    run_cli(["stream", "synthetic://?count=1", "--view", f"{out}/"])
    assert loaded == [True]  # it got past the --view check, to the model, with the folder there
    assert list(out.iterdir()) == []  # the file written to try the folder was removed


def test_rtp_without_an_h264_encoder_is_refused(monkeypatch):
    monkeypatch.setattr(edgemm.streams.view, "gstreamer_available", lambda: True)
    monkeypatch.setattr(edgemm.streams.view, "gstreamer_element_exists", lambda name: False)
    result = run_cli(["stream", "synthetic://?count=1", "--view", "rtp://127.0.0.1:5000"])
    assert result.exit_code == 2 and "GStreamer has no H.264 encoder (nvv4l2h264enc or x264enc)" in result.output


def test_the_rtp_pipeline_uses_the_jetsons_encoder_where_there_is_one(monkeypatch):
    monkeypatch.setattr(edgemm.streams.view, "gstreamer_element_exists", lambda name: name == "nvv4l2h264enc")
    assert "nvv4l2h264enc" in edgemm.streams.view._h264_encoder()
    monkeypatch.setattr(edgemm.streams.view, "gstreamer_element_exists", lambda name: name == "x264enc")
    assert edgemm.streams.view._h264_encoder().startswith("x264enc")


def test_view_to_rtp_sends_h264_over_rtp(tmp_path):
    """The real GStreamer pipeline: runs where OpenCV has GStreamer and x264enc (CI's Jetson
    stand-in: Debian's python3-opencv and GStreamer's good and ugly plugins; on a Jetson,
    nvv4l2h264enc)."""
    from edgemm.streams.sources.gstreamer import gstreamer_available, gstreamer_element_exists
    needed = ("appsrc", "videoconvert", "rtph264pay", "udpsink")
    if not gstreamer_available() or not all(map(gstreamer_element_exists, needed)) \
            or edgemm.streams.view._h264_encoder() is None:
        pytest.skip("needs OpenCV with GStreamer, an H.264 encoder, rtph264pay and udpsink (.ci/run's Jetson install)")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver:
        receiver.bind(("127.0.0.1", 0))
        receiver.settimeout(30)
        port = receiver.getsockname()[1]
        result = run_cli(["stream", "synthetic://?count=10", "--prompt", COLOUR, "--max-new-tokens", "2",
                          "--view", f"rtp://127.0.0.1:{port}", "--out", str(tmp_path / "a.jsonl")])
        assert result.exit_code == 0, result.output
        packet = receiver.recv(65536)  # the datagrams sent meanwhile wait in the socket's buffer
    assert packet[0] >> 6 == 2 and packet[1] & 0x7F == 96  # RTP version 2, the payload type rtph264pay was given


@needs_browser
def test_the_page_shows_a_real_streams_alert_states(runtime):
    """edgemm.streams.alerts on a running stream: the page's badge for it is its state (from /v1/alerts and
    the alert events on /v1/events), true or false, never stuck at nothing."""
    stream = {"id": "yard", "source": "synthetic://?fps=10", "prompt": COLOUR, "tier": "low", "max_new_tokens": 2,
              "alerts": {"many": {"prompt": COUNT, "above": 2, "on_after": 1, "off_after": 1}}}
    with running(runtime, {"streams": [stream]}, tcp_port=0) as d, raw_client(sock_path(d)) as http:
        wait_until(lambda: http.get("/v1/alerts").json()["data"][0]["state"] != "unknown", 30, "the alert's first state")
        with HeadlessBrowser(tcp_url(d)) as browser:
            badge = "document.querySelector('[data-stream=yard] .alert')?.textContent || ''"
            wait_until(lambda: browser.evaluate(badge) in ("many: true", "many: false"), 10, "the alert's badge")
            states = {browser.evaluate(badge)}
            # scenes of 1 to 6 shapes: the state goes both ways, and the badge with it
            wait_until(lambda: states.add(browser.evaluate(badge)) or len(states) == 2, 30, "the badge to change")


def test_delivery_after_the_daemon_drains_keeps_end_and_the_other_listeners():
    """A page that stopped reading when the daemon drains: its full queue gets END, and the
    stream's results in flight still go out: no error, its END is kept (and ends it), the
    stream's other listeners get every event."""
    import asyncio

    from edgemm.streams.manager import END, AllStreamsListener, ManagedStream, stream_spec

    async def scenario():
        spec = stream_spec({"id": "cam", "source": "synthetic://", "prompt": COLOUR})
        stream = ManagedStream(spec, None, asyncio.get_running_loop())  # not started: delivered to by hand
        stuck, reader = AllStreamsListener(), AllStreamsListener()
        own = stream.listen()  # a listener of this stream only (GET /v1/streams/cam/events)
        stream.listeners.update({stuck, reader})
        for n in range(EVENTS_BUFFER):
            stream._deliver({"stream": "cam", "answer": str(n)})
        assert stuck.full() is False and stuck.qsize() == EVENTS_BUFFER
        stuck.close()  # the daemon drains (StreamManager._close_all_listeners)
        got = [reader.get_nowait() for _ in range(reader.qsize())]
        for n in range(EVENTS_BUFFER, 3 * EVENTS_BUFFER):  # results in flight, then the stream's end
            stream._deliver({"stream": "cam", "answer": str(n)})
            got.append(reader.get_nowait())
        stream._deliver(END)
        items = [stuck.get_nowait() for _ in range(stuck.qsize())]
        assert items[-1] is END and items.count(END) == 1  # its END survived, last
        assert [record["answer"] for _, record, _ in items[:-1]] == [str(n) for n in range(EVENTS_BUFFER)]
        assert [record["answer"] for _, record, _ in got] == [str(n) for n in range(3 * EVENTS_BUFFER)]
        assert reader.empty()  # one stream's END does not end a listener on all streams
        own_items = [own.get_nowait() for _ in range(own.qsize())]
        assert own_items[-1] is END and len(own_items) == EVENTS_BUFFER + 1  # the newest, then END
        assert own_items[-2][1]["answer"] == str(3 * EVENTS_BUFFER - 1)
        stream._deliver({"stream": "cam", "answer": "late"})  # after END (an alert's last event, say)
        assert own.empty() and stuck.empty()  # nothing past END
        late = stream.listen()  # a listener that comes after the end gets END alone
        assert late.get_nowait() is END and late.empty()

    asyncio.run(scenario())


# ---- /v1/events?rate=R: a page gets no more results than it can draw ---------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def frames_of(sent) -> list:
    return [(record["stream"], record.get("frame"), event) for _, record, event in sent]


def result(stream: str, frame: int) -> tuple:
    return (frame, {"stream": stream, "frame": frame}, None)


def test_thinning_sends_at_most_rate_results_per_stream_the_newest_waiting():
    from edgemm.server.liveview import Thinning
    clock = FakeClock()
    thin = Thinning(4.0, clock)  # one result per 0.25 s per stream (steps exact in binary)
    assert frames_of(thin.offer(result("a", 1))) == [("a", 1, None)]
    assert thin.wait_s() is None
    clock.now += 0.0625
    assert thin.offer(result("a", 2)) == []  # too soon: waits
    assert frames_of(thin.offer(result("b", 1))) == [("b", 1, None)]  # streams apart
    clock.now += 0.0625
    assert thin.offer(result("a", 3)) == []  # newest wins: 2 is never sent
    assert thin.wait_s() == pytest.approx(0.125)
    assert thin.due() == []
    clock.now += 0.125
    assert frames_of(thin.due()) == [("a", 3, None)]
    assert thin.due() == [] and thin.wait_s() is None
    clock.now += 0.0625  # 0.0625 s after a's last one went: the next waits its 0.25 s again
    assert thin.offer(result("a", 4)) == []
    assert thin.wait_s() == pytest.approx(0.1875)


def test_thinning_never_holds_back_alert_events_and_keeps_a_streams_order():
    from edgemm.server.liveview import Thinning
    clock = FakeClock()
    thin = Thinning(2.0, clock)
    thin.offer(result("a", 1))
    clock.now += 0.125
    assert thin.offer(result("a", 2)) == []
    alert = (3, {"stream": "a", "alert": "red", "state": "true", "frame": 2}, "alert")
    # the waiting result goes first, then the alert event: the page sees them in the stream's order
    assert frames_of(thin.offer(alert)) == [("a", 2, None), ("a", 2, "alert")]
    assert thin.wait_s() is None
    assert frames_of(thin.offer((1, {"stream": "b", "alert": "x", "state": "false"}, "alert"))) == [("b", None, "alert")]
    thin.offer(result("c", 1))
    clock.now += 0.125
    thin.offer(result("c", 2))
    assert frames_of(thin.due_all()) == [("c", 2, None)]  # the listener ends: what waited goes


def error(stream: str, frame: int) -> tuple:
    return (frame, {"stream": stream, "frame": frame, "error": f"frame {frame} failed"}, None)


def test_thinning_sends_a_failing_streams_newest_error_or_answer_at_the_rate():
    """A stream whose every frame fails is thinned as one that answers: within 1 / rate, the
    newest of its errors and answers goes, so the page never gets an older answer after a newer
    error (nor the reverse), and an alert event still takes what waited before it."""
    from edgemm.server.liveview import Thinning
    clock = FakeClock()
    thin = Thinning(4.0, clock)
    sent = thin.offer(error("a", 1))
    for frame in range(2, 101):  # 99 more failures within the 0.25 s: none goes now
        clock.now += 0.0025
        sent += thin.offer(error("a", frame))
    assert [record["error"] for _, record, _ in sent] == ["frame 1 failed"]
    clock.now = 100.25
    sent = thin.due()
    assert [(record["frame"], record["error"]) for _, record, _ in sent] == [(100, "frame 100 failed")]
    clock.now += 0.0625
    assert thin.offer(error("a", 101)) == [] and thin.offer(result("a", 102)) == []  # the answer is newer: it waits
    assert thin.offer(error("a", 103)) == []  # the newer error takes the answer's place
    alert = (104, {"stream": "a", "alert": "red", "state": "unknown"}, "alert")
    assert [(frame, "error" in record) for frame, record, _ in thin.offer(alert)] == [(103, True), (104, False)]
    assert frames_of(thin.offer(error("b", 1))) == [("b", 1, None)]  # streams apart


def test_thinning_forgets_streams_that_are_free_to_send_again():
    from edgemm.server.liveview import FORGET_ABOVE, Thinning
    clock = FakeClock()
    thin = Thinning(4.0, clock)
    for n in range(10 * FORGET_ABOVE):  # streams come and go, each sending once
        thin.offer(result(f"s{n}", 1))
        clock.now += 0.0625
    assert len(thin.next_at) <= FORGET_ABOVE + 1


def test_a_thinned_listener_queues_only_what_goes_and_the_rest_when_due():
    """The reader is woken for the results that are sent, each stream's newest, and at END for
    what still waited. (The loop's timer is not waited for: _flush is what it calls.)"""
    import asyncio

    from edgemm.server.liveview import ThinnedListener
    from edgemm.streams.manager import END

    async def run() -> tuple[list, list, list, list]:
        clock = FakeClock()
        listener = ThinnedListener(4.0, clock)  # one per 0.25 s
        for frame in range(1, 6):  # five at once: the first goes, the newest waits
            listener.offer(result("a", frame))
        first = [listener.get_nowait() for _ in range(listener.qsize())]
        armed = listener._timer_due - asyncio.get_running_loop().time()
        clock.now += 0.25  # its time comes
        listener._flush()
        second = [listener.get_nowait() for _ in range(listener.qsize())]
        clock.now += 0.25
        listener.offer(result("a", 6))  # 0.25 s after 5 went: at once
        listener.offer(result("a", 7))  # waits
        listener.close()  # the daemon drains: what waited, then END
        third = [listener.get_nowait() for _ in range(listener.qsize())]
        return first, [armed], second, third

    first, (armed,), second, third = run_loop(run())
    assert frames_of(first) == [("a", 1, None)] and 0 < armed <= 0.25
    assert frames_of(second) == [("a", 5, None)]
    assert [item[0] for item in third[:-1]] == [6, 7] and third[-1] is END


def test_a_thinned_listeners_timer_is_armed_for_the_first_result_due():
    """Stream b's result due in 0.0625 s after a's due in 0.1875 s: the timer moves to b's."""
    import asyncio

    from edgemm.server.liveview import ThinnedListener

    async def run() -> list[float]:
        clock, loop = FakeClock(), asyncio.get_running_loop()
        listener = ThinnedListener(4.0, clock)
        listener.offer(result("b", 1))
        clock.now += 0.0625
        listener.offer(result("a", 1))
        listener.offer(result("a", 2))  # waits 0.25 s: a timer for it
        first = listener._timer_due - loop.time()
        clock.now += 0.125
        listener.offer(result("b", 2))  # due 0.0625 s from now: sooner
        second = listener._timer_due - loop.time()
        listener.close()
        return [first, second]

    first, second = run_loop(run())
    assert first == pytest.approx(0.25, abs=0.02) and second == pytest.approx(0.0625, abs=0.02)


def test_events_a_thinned_listener_loses_are_counted_in_their_stream():
    """A full queue loses its oldest event to make room, on every path a newer one takes in
    (offer, the timer, the end): each lost one is counted once, in the stream it came from."""
    from edgemm.server.liveview import ThinnedListener
    from edgemm.streams.manager import EVENTS_BUFFER

    async def run() -> list[tuple]:
        clock, lost = FakeClock(), []
        listener = ThinnedListener(4.0, clock)
        listener.on_lost = lost.append
        for n in range(EVENTS_BUFFER):  # a full queue: one result each of many streams
            listener.offer(result(f"s{n}", 1))
        listener.offer(result("s0", 2))  # waits
        alert = (99, {"stream": "s0", "alert": "red", "state": "true"}, "alert")
        listener.offer(alert)  # the waiting result, then the alert: two in, two lost
        listener.offer(result("s1", 2))  # waits
        clock.now += 0.25
        listener._flush()  # in by the timer: one more lost
        return lost

    lost = run_loop(run())
    assert [item[1]["stream"] for item in lost] == ["s0", "s1", "s2"]


@pytest.mark.parametrize("query, message", [
    ("rate=0", "from 0.01"), ("rate=-1", "from 0.01"), ("rate=abc", "a number"), ("rate=nan", "a number"),
    ("rate=inf", "a number"), ("rate=1e9", "to 1000"), ("rate=2000", "to 1000"), ("rate=0.001", "from 0.01"),
    ("rate=", "a number"), ("rate=1&rate=2", "more than once")])
def test_a_bad_events_rate_is_a_400_before_a_listener_place_is_taken(runtime, query, message):
    with running(runtime, max_stream_listeners=1) as d, raw_client(sock_path(d)) as http:
        response = http.get(f"/v1/events?{query}")
        assert_error(response, 400, param="rate")
        assert message in response.json()["error"]["message"] and "\n" not in response.json()["error"]["message"]
        assert d.service.streams.listener_count() == 0


def test_events_at_a_rate_thin_a_fast_stream_and_keep_its_latest(runtime):
    """A stream answering as fast as it can, read at rate=4: about 4 results a second reach the
    listener (not the stream's ~tens), and each is newer than the last."""
    stream = {"id": "fast", "source": "synthetic://?size=64", "prompt": COLOUR, "tier": "low", "max_new_tokens": 1}
    with running(runtime, {"streams": [stream]}) as d, raw_client(sock_path(d)) as http:
        wait_until(lambda: http.get("/v1/streams/fast").json()["frames"] >= 3, 30, "answers")
        frames, began = [], time.monotonic()
        answered0 = http.get("/v1/streams/fast").json()["frames"]
        with http.stream("GET", "/v1/events?rate=4") as events:
            for line in events.iter_lines():
                if line.startswith("data: "):
                    frames.append(json.loads(line[6:])["frame"])
                if time.monotonic() - began > 2.0:
                    break
        elapsed = time.monotonic() - began
        answered = http.get("/v1/streams/fast").json()["frames"] - answered0
    assert frames == sorted(frames) and len(set(frames)) == len(frames)
    assert len(frames) <= 4 * elapsed + 2  # at most rate per second (the first goes at once)
    assert answered > 2 * len(frames)  # the stream answered more than were sent: they were thinned


@pytest.mark.parametrize("query, param, message", [
    ("frames=jpeg", "rate", "needs a 'rate'"), ("rate=31&frames=jpeg", "rate", "at most 30"),
    ("rate=5&frames=png", "frames", "'jpeg'"), ("rate=5&frames=jpeg&frames=jpeg", "frames", "given once"),
    ("rate=5&frames=", "frames", "'jpeg'")])
def test_a_bad_events_frames_is_a_400_before_a_listener_place_is_taken(runtime, query, param, message):
    with running(runtime, max_stream_listeners=1) as d, raw_client(sock_path(d)) as http:
        response = http.get(f"/v1/events?{query}")
        assert_error(response, 400, param=param)
        assert message in response.json()["error"]["message"]
        assert d.service.streams.listener_count() == 0


def test_events_with_frames_carry_each_results_own_frame(runtime):
    """?rate=R&frames=jpeg: each result of a fast stream comes with a JPEG of its own frame
    (synthetic frame i is make_scene(seed + i): the decoded JPEG is nearest that scene of those
    around it), not the stream's latest; alert events carry none."""
    stream = {"id": "fast", "source": "synthetic://?size=64", "prompt": COLOUR, "tier": "low", "max_new_tokens": 1}
    with running(runtime, {"streams": [stream]}) as d, raw_client(sock_path(d)) as http:
        wait_until(lambda: http.get("/v1/streams/fast").json()["frames"] >= 3, 30, "answers")
        records = []
        with http.stream("GET", "/v1/events?rate=10&frames=jpeg") as events:
            for line in events.iter_lines():
                if line.startswith("data: "):
                    records.append(json.loads(line[6:]))
                    if len(records) == 2:
                        d.service.streams.get("fast")._post_alert({"stream": "fast", "alert": "a", "state": "true"})
                if len(records) >= 12:
                    break
    results = [r for r in records if "answer" in r]
    assert len(results) >= 10 and any("alert" in r for r in records)
    assert all("jpeg" not in r for r in records if "alert" in r)
    with_jpeg = [r for r in results if "jpeg" in r]
    # the frame of a result sent at once is still kept (the last 3 answered frames); a writer that
    # the machine's load holds back while the unpaced stream answers on loses a few (9 of 11 seen
    # with three suites at once): most carry theirs, and every one carried is its own (below)
    assert len(with_jpeg) >= len(results) // 2
    import base64
    for record in with_jpeg:
        image = cv2.cvtColor(cv2.imdecode(np.frombuffer(base64.b64decode(record["jpeg"]), np.uint8), cv2.IMREAD_COLOR),
                             cv2.COLOR_BGR2RGB)  # OpenCV decodes to BGR; the scenes are RGB
        near = range(max(0, record["frame"] - 3), record["frame"] + 4)
        errors = {n: np.abs(image.astype(int) - make_scene(n, size=64).image.astype(int)).mean() for n in near}
        assert min(errors, key=errors.get) == record["frame"]


@needs_browser
def test_a_hidden_page_closes_its_event_stream_and_stops_polling_until_shown(runtime):
    """Headless chromium keeps every page visible (the DevTools protocol's focus emulation and
    lifecycle states leave document.visibilityState as it is): the page is hidden here as a
    browser hides a background tab, by its visibilityState and a visibilitychange event. Hidden,
    it holds no listener on the daemon and asks nothing; shown, it is live again."""
    stream = {"id": "cam", "source": "synthetic://?fps=10", "prompt": COLOUR, "tier": "low", "max_new_tokens": 2}
    answers = "document.querySelector('[data-stream=cam] .answer')?.textContent || ''"
    with running(runtime, {"streams": [stream]}, tcp_port=0) as d, HeadlessBrowser(tcp_url(d)) as browser:
        wait_until(lambda: shown(browser).get("cam", {}).get("frame_width"), 30, "the stream's frame")
        assert d.service.streams.listener_count() == 1
        browser.evaluate("""(() => { window.__asked = []; const real = window.fetch;
            window.fetch = (url, ...rest) => { window.__asked.push(String(url)); return real(url, ...rest); };
            window.__visibility = 'hidden';
            Object.defineProperty(document, 'visibilityState', {configurable: true, get: () => window.__visibility});
            Object.defineProperty(document, 'hidden', {configurable: true, get: () => window.__visibility === 'hidden'});
            document.dispatchEvent(new Event('visibilitychange')); })()""")
        wait_until(lambda: d.service.streams.listener_count() == 0, 10, "the hidden page's listener to go")
        time.sleep(0.5)  # a draw under way as it was hidden ends (FRAME_INTERVAL_MS)
        browser.evaluate("window.__asked = []; performance.clearResourceTimings(); 1")
        answer = browser.evaluate(answers)
        time.sleep(3.5)  # more than every poll's interval (1, 2 and 2 s)
        assert browser.evaluate("window.__asked") == []
        assert browser.evaluate("performance.getEntriesByType('resource').map(entry => entry.name)") == []  # nor a frame
        assert browser.evaluate(answers) == answer  # nothing drawn
        assert d.service.streams.listener_count() == 0
        assert browser.evaluate("document.getElementById('connection').textContent").startswith("paused")
        browser.evaluate("window.__visibility = 'visible'; document.dispatchEvent(new Event('visibilitychange')); 1")
        wait_until(lambda: browser.evaluate("document.getElementById('connection').textContent") == "live", 10,
                   "the page live again")
        assert d.service.streams.listener_count() == 1
        wait_until(lambda: {"/v1/streams", "/v1/status"} <= set(browser.evaluate("window.__asked")), 10,
                   "the polls asked again")
        wait_until(lambda: browser.evaluate(answers) != answer, 15, "a new answer drawn")
        # hidden and shown again quickly: still one listener, the polls not doubled
        browser.evaluate("""(() => { for (const state of ['hidden', 'visible', 'hidden', 'visible']) {
            window.__visibility = state; document.dispatchEvent(new Event('visibilitychange')); } })()""")
        wait_until(lambda: browser.evaluate("document.getElementById('connection').textContent") == "live", 10,
                   "live after flickering")
        browser.evaluate("window.__asked = []; 1")
        time.sleep(4.2)
        streams_asked = browser.evaluate("window.__asked.filter(url => url === '/v1/streams').length")
        assert 3 <= streams_asked <= 5  # once a second: one poll, not two
        assert d.service.streams.listener_count() == 1


def test_page_traffic_asks_what_the_page_asks():
    """tests/support/page_traffic.py (bench_alerts' page on another computer) reads the page's rate, and
    the page asks the daemon for that rate."""
    from tests.support.page_traffic import page_rate

    from edgemm.server.liveview import page
    text = page().decode()
    assert page_rate(text) == 5.0
    assert "new EventSource(`/v1/events?rate=${FRAMES_PER_S}&frames=jpeg`)" in text
    with pytest.raises(SystemExit, match="FRAMES_PER_S"):
        page_rate("<html></html>")


def test_a_thinned_listener_gets_a_streams_last_result_when_its_time_comes(runtime):
    """The stream ends right after a result that had to wait: the loop's timer sends it (the
    page shows the stream's last answer, not one up to 1/rate older)."""
    stream = {"id": "short", "source": "synthetic://?count=40&size=64", "prompt": COLOUR, "tier": "low",
              "max_new_tokens": 1}
    with running(runtime) as d, raw_client(sock_path(d)) as http:
        frames = []
        with http.stream("GET", "/v1/events?rate=1") as events:
            lines = events.iter_lines()
            next(lines)  # the opening comment: listening by now
            assert http.post("/v1/streams", json=stream).status_code == 201
            for line in lines:
                if line.startswith("data: "):
                    frames.append(json.loads(line[6:])["frame"])
                    if frames[-1] == 39:
                        break
        assert frames[-1] == 39 and len(frames) < 40  # thinned, and the last one came
