"""The daemon with telemetry, the placement policy and cloud offload: /v1/status, /metrics, routing."""
from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
from tests.support.fake_jetson import orin_nx
from test_offload import FakeEndpoint
from test_server import metric, raw_client, running, sock_path, user_message

PROMPT = "how many shapes are there ?"


@pytest.fixture(scope="module")
def image_url(model_dir) -> str:
    return "data:image/png;base64," + base64.b64encode((model_dir / "samples" / "scene_11.png").read_bytes()).decode()


@pytest.fixture
def endpoint():
    server = FakeEndpoint()
    yield server
    server.close()


def ask(client, image_url: str, **more):
    return client.post("/v1/chat/completions", json={"messages": user_message(image_url, PROMPT),
                                                     "max_tokens": 2, **more})


def offload_sections(root: Path, endpoint: FakeEndpoint, **offload) -> dict:
    return {"power": {"root": str(root), "sample_period_s": 0.05},
            "placement": {"vision_encoder": ["dla0", "cpu"]},
            "offload": {"enabled": True, "url": endpoint.url, "model": "remote-vlm", "retries": 0,
                        "timeout_s": 2.0, **offload}}


def test_status_and_metrics_with_default_config(runtime, tmp_path, image_url):
    orin_nx(tmp_path)
    with running(runtime, {"power": {"root": str(tmp_path)}}) as daemon, raw_client(sock_path(daemon)) as http:
        assert ask(http, image_url).status_code == 200
        status = http.get("/v1/status").json()
        assert status["telemetry"]["total_w"] == 5.0 and status["telemetry"]["dla_cores"] == 2
        assert status["telemetry"]["hottest"] == {"zone": "tj-thermal", "c": 46.0}
        assert status["placement"]["stages"] == {"vision_encoder": "cpu", "embed_tokens": "cpu", "decoder": "cpu"}
        assert "cool and idle" in status["placement"]["reason"]
        assert status["offload"] == {"enabled": False, "breaker": "off"}
        assert status["components"]["vision_encoder"]["device"] == "cpu"
        assert status["queue"]["limit"] == 8 and status["queue"]["in_flight"] == 0
        assert status["cache"]["max_bytes"] > 0
        assert status["power"]["decisions"] == {"local": 1}
        assert status["power"]["energy_j"]["requests"] == 1 and status["power"]["energy_j"]["last"] > 0
        text = http.get("/metrics").text
        assert metric(text, "edgemm_board_power_watts") == 5.0
        assert metric(text, 'edgemm_power_rail_watts{rail="VDD_SOC"}') == 1.25
        assert metric(text, 'edgemm_temperature_celsius{zone="tj-thermal"}') == 46.0
        assert 'zone="cv0-thermal"' not in text  # offline: no sample rather than a fake value
        assert metric(text, 'edgemm_placement_device{stage="vision_encoder",device="cpu"}') == 1
        assert metric(text, 'edgemm_placement_decisions_total{target="local"}') == 1
        assert metric(text, "edgemm_request_energy_joules_count") == 1
        assert metric(text, 'edgemm_offload_breaker_state{state="off"}') == 1


def test_without_sensors_telemetry_is_absent(runtime, tmp_path, image_url):
    with running(runtime, {"power": {"root": str(tmp_path)}}) as daemon, raw_client(sock_path(daemon)) as http:
        assert ask(http, image_url).status_code == 200
        status = http.get("/v1/status").json()
        assert status["telemetry"]["total_w"] is None and status["power"]["energy_j"]["requests"] == 0
        samples = [line for line in http.get("/metrics").text.splitlines() if not line.startswith("#")]
        assert not any(line.startswith(("edgemm_board_power_watts", "edgemm_temperature_celsius",
                                        "edgemm_request_energy_joules_count")) for line in samples)


def wait_hot(http, condition: str) -> None:
    deadline = time.monotonic() + 5
    while condition not in http.get("/v1/status").json()["placement"]["conditions"]:
        assert time.monotonic() < deadline, "the sampler did not see the temperature"
        time.sleep(0.05)


def test_critical_goes_to_the_cloud(runtime, tmp_path, endpoint, image_url):
    jetson = orin_nx(tmp_path)
    with running(runtime, offload_sections(tmp_path, endpoint)) as daemon, raw_client(sock_path(daemon)) as http:
        answer = ask(http, image_url)
        assert answer.json()["edgemm"]["devices"]["encode"] == "cpu" and not endpoint.requests  # cool: local
        jetson.set_temp("tj-thermal", 97)
        wait_hot(http, "critical")
        answer = ask(http, image_url)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["message"]["content"] == "three shapes"
        assert body["edgemm"]["devices"] == {"encode": "cloud", "decode": "cloud"}
        assert body["usage"]["completion_tokens"] == 2
        sent = endpoint.requests[-1]["body"]
        assert sent["messages"][0]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
        with http.stream("POST", "/v1/chat/completions", json={"messages": user_message(image_url), "stream": True,
                                                               "max_tokens": 2}) as streamed:
            events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]
                       if json.loads(e)["choices"]) == "three shapes"
        status = http.get("/v1/status").json()
        assert status["offload"]["succeeded"] == 2 and status["offload"]["breaker"] == "closed"
        assert status["power"]["decisions"]["cloud"] == 2
        assert "critical: tj-thermal at 97.0" in status["last_placement"]["reason"]


def test_offload_off_keeps_critical_requests_local(runtime, tmp_path, image_url):
    jetson = orin_nx(tmp_path)
    jetson.set_temp("tj-thermal", 97)
    sections = {"power": {"root": str(tmp_path)}, "placement": {"vision_encoder": ["gpu", "dla0"]}}
    with running(runtime, sections) as daemon, raw_client(sock_path(daemon)) as http:
        answer = ask(http, image_url)
        assert answer.status_code == 200 and answer.json()["edgemm"]["devices"]["encode"] == "cpu"
        placement = http.get("/v1/status").json()["placement"]
        assert placement["stages"]["vision_encoder"] == "dla0" and "offload is off" in placement["reason"]


def test_failed_offload_is_answered_locally(runtime, tmp_path, endpoint, image_url):
    jetson = orin_nx(tmp_path)
    jetson.set_temp("tj-thermal", 97)
    endpoint.script = ["500"]
    with running(runtime, offload_sections(tmp_path, endpoint, breaker_threshold=1)) as daemon, \
            raw_client(sock_path(daemon)) as http:
        wait_hot(http, "critical")
        answer = ask(http, image_url)
        assert answer.status_code == 200 and answer.json()["edgemm"]["devices"]["encode"] == "cpu"
        status = http.get("/v1/status").json()["offload"]
        assert status["fallbacks_to_local"] == 1 and status["breaker"] == "open"
        assert "HTTP 500" in status["last_error"]
        assert ask(http, image_url).status_code == 200  # breaker open: the policy keeps it local
        assert len(endpoint.requests) == 1
        assert "breaker open" in http.get("/v1/status").json()["placement"]["reason"]


def test_failed_offload_without_fallback_is_a_clear_502(runtime, tmp_path, endpoint, image_url):
    jetson = orin_nx(tmp_path)
    jetson.set_temp("tj-thermal", 97)
    endpoint.script = ["500"]
    with running(runtime, offload_sections(tmp_path, endpoint, fallback_local=False)) as daemon, \
            raw_client(sock_path(daemon)) as http:
        wait_hot(http, "critical")
        answer = ask(http, image_url)
        assert answer.status_code == 502
        error = answer.json()["error"]
        assert error["type"] == "offload_error" and "answered HTTP 500" in error["message"]


def test_hot_moves_the_encoder_from_gpu_to_dla(monkeypatch, make_runtime, tmp_path, image_url):
    from test_placement import standby_runtime
    rt, _ = standby_runtime(monkeypatch, make_runtime)  # encoder on gpu, dla0 on standby; decoder gpu
    jetson = orin_nx(tmp_path)
    sections = {"power": {"root": str(tmp_path), "sample_period_s": 0.05},
                "placement": {"vision_encoder": ["gpu", "dla0", "cpu"], "decoder": ["gpu", "cpu"]}}
    with running(rt, sections) as daemon, raw_client(sock_path(daemon)) as http:
        cool = ask(http, image_url).json()["edgemm"]
        assert cool["devices"] == {"encode": "gpu", "decode": "gpu"}
        jetson.set_temp("tj-thermal", 88)
        wait_hot(http, "hot")
        hot = ask(http, image_url).json()["edgemm"]
        assert hot["devices"] == {"encode": "dla0", "decode": "gpu"}
        assert "DLA first" in hot["schedule"]["placement"]
        assert http.get("/v1/status").json()["last_placement"]["stages"]["vision_encoder"] == "dla0"
