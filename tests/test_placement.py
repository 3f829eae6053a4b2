"""Placement: config keys, fallback order, reasons recorded, the chosen device reported."""
from __future__ import annotations

import importlib.util

import pytest

from edgemm.backends.onnxruntime import OnnxRuntimeBackend
from edgemm.config import PlacementConfig, config_from_dict, load_config
from edgemm.errors import ConfigError, EngineError, ModelError
from edgemm.backends.tensorrt.platform import MISSING
from edgemm.engine.pipeline import Pipeline, Request
from edgemm.engine.route import Route, reachable_devices
from edgemm.engine.placement import place
from edgemm.engine.loading import ModelComponents
from edgemm.engine.runtime import default_engines_dir

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None


# ---- config ------------------------------------------------------------------------------

def test_placement_defaults_to_cpu_everywhere():
    cfg = config_from_dict({})
    assert cfg.placement == PlacementConfig(vision_encoder=["cpu"], embed_tokens=["cpu"], decoder=["cpu"])
    assert cfg.model.engines is None


def test_placement_lists_load():
    cfg = config_from_dict({"placement": {"vision_encoder": ["dla0", "gpu", "cpu"], "decoder": ["gpu", "cpu"]}})
    assert cfg.placement.vision_encoder == ["dla0", "gpu", "cpu"]
    assert cfg.placement.embed_tokens == ["cpu"] and cfg.placement.decoder == ["gpu", "cpu"]


@pytest.mark.parametrize("data, expected", [
    ({"placement": {"decoder": ["tpu"]}}, "config: 'placement.decoder[0]' must be one of gpu, dla0, dla1, cpu, got 'tpu'"),
    ({"placement": {"vision_encoder": ["gpu", "dla2"]}},
     "config: 'placement.vision_encoder[1]' must be one of gpu, dla0, dla1, cpu, got 'dla2'"),
    ({"placement": {"embed_tokens": []}}, "config: 'placement.embed_tokens' must list at least one device, got []"),
    ({"placement": {"decoder": ["gpu", "gpu"]}}, "config: 'placement.decoder[1]' must not repeat an earlier device, got 'gpu'"),
    ({"placement": {"decoder": "gpu"}}, "config: 'placement.decoder' must be a list of strings, got 'gpu' (str)"),
    ({"placement": {"encoder": ["gpu"]}}, "config: unknown key 'placement.encoder' (known: decoder, embed_tokens, keep_alternatives, vision_encoder)"),
    ({"model": {"engines": " "}}, "config: 'model.engines' must be a folder or null, got ' '"),
])
def test_bad_placement_is_refused_with_its_path(data, expected):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert str(info.value) == expected


def test_relative_engine_folder_is_next_to_the_config_file(tmp_path):
    (tmp_path / "edgemm.yaml").write_text("model:\n  engines: built/tiny\n")
    assert load_config(tmp_path / "edgemm.yaml").model.engines == str(tmp_path / "built" / "tiny")


# ---- place(): order and reasons ---------------------------------------------------------

class FakeComponent:
    def __init__(self, device):
        self.device = device


def loader(fails: dict[str, str], calls: list):
    def load(component, device):
        calls.append(device)
        if device in fails:
            raise EngineError(fails[device])
        return FakeComponent(device)
    return load


def test_first_device_that_loads_wins_and_later_ones_are_not_tried():
    calls = []
    component, placement = place("vision_encoder", ["dla0", "gpu", "cpu"],
                                 loader({"dla0": "no dla0 engine"}, calls))
    assert calls == ["dla0", "gpu"]
    assert component.device == "gpu" and placement.device == "gpu" and placement.backend == "tensorrt"
    assert placement.to_dict() == {"device": "gpu", "backend": "tensorrt", "standby": [],
                                   "skipped": [{"device": "dla0", "reason": "no dla0 engine"}]}


def test_reasons_are_kept_in_order_down_to_cpu():
    calls = []
    _, placement = place("decoder", ["dla1", "gpu", "cpu"], loader({"dla1": "a", "gpu": "b"}, calls))
    assert calls == ["dla1", "gpu", "cpu"]
    assert placement.device == "cpu" and placement.backend == "onnxruntime"
    assert placement.skipped == [("dla1", "a"), ("gpu", "b")]


def test_nothing_loads_lists_every_device_and_reason():
    with pytest.raises(EngineError) as info:
        place("decoder", ["gpu", "cpu"], loader({"gpu": "no TensorRT", "cpu": "broken graph"}, []))
    assert str(info.value) == ("decoder: none of placement.decoder ['gpu', 'cpu'] could load it "
                               "(gpu: no TensorRT; cpu: broken graph)")
    assert info.value.exit_code == 2


def test_a_single_device_raises_its_own_error():
    def load(component, device):
        raise ModelError("model tiny-vlm: decoder has no int8 graph")
    with pytest.raises(ModelError, match="^model tiny-vlm: decoder has no int8 graph$"):
        place("decoder", ["cpu"], load)


def test_unexpected_errors_are_not_swallowed():
    def load(component, device):
        raise RuntimeError("bug")
    with pytest.raises(RuntimeError):
        place("decoder", ["gpu", "cpu"], load)


# ---- the runtime -------------------------------------------------------------------------

def test_default_runtime_is_onnxruntime_cpu_with_no_fallbacks(runtime):
    assert runtime.devices == {"vision_encoder": "cpu", "embed_tokens": "cpu", "decoder": "cpu"}
    report = runtime.placement_report()
    assert report["decoder"] == {"device": "cpu", "backend": "onnxruntime", "skipped": [], "standby": [],
                                 "provider": "CPUExecutionProvider", "precision": "q4", "quantization": "4bit",
                                 "precision_choice": "auto: q4 on cpu, the fastest present for onnxruntime "
                                                     "(q4 > fp32; present: q4, fp32)"}


@pytest.mark.skipif(HAVE_TENSORRT, reason="checks the fallback where TensorRT is absent")
def test_without_tensorrt_gpu_and_dla_fall_back_to_cpu(make_runtime, model_dir):
    rt = make_runtime(placement={"vision_encoder": ["dla0", "gpu", "cpu"], "decoder": ["gpu", "cpu"]})
    assert rt.devices["vision_encoder"] == "cpu" and rt.devices["decoder"] == "cpu"
    skipped = rt.placement_report()["vision_encoder"]["skipped"]
    assert skipped == [{"device": "dla0", "reason": MISSING}, {"device": "gpu", "reason": MISSING}]
    result = rt.infer(model_dir / "samples" / "scene_11.png", "how many shapes are there ?", max_new_tokens=4)
    assert result.devices == {"encode": "cpu", "decode": "cpu"}


class FakeTensorRT:
    """Stands in for TensorRTBackend: dla0 has no engine; 'gpu' runs the ONNX graph (so answers are real)."""
    fails = ("dla0",)

    def __init__(self, runtime_model):
        self.ort = OnnxRuntimeBackend(["cpu"], 1)
        self.manifest = runtime_model
        self.calls = []

    def load_component(self, name, device, precision, split_feeds=None):
        self.calls.append((name, device))
        if device in self.fails:
            raise EngineError(f"no int8 engine for {name} on {device}")
        component = self.ort.load(name, self.manifest.graph_path(name, precision), precision)
        component.device = device
        return component


def fake_runtime(monkeypatch, make_runtime, fake_class=None, **placement):
    fakes = []

    def fake(self):
        if not fakes:
            fakes.append((fake_class or FakeTensorRT)(self.manifest))
        return fakes[0]
    monkeypatch.setattr(ModelComponents, "_tensorrt", fake)
    return make_runtime(placement=placement), fakes


def test_fallback_order_with_a_backend_that_fails_to_load(monkeypatch, make_runtime, model_dir, runtime):
    rt, fakes = fake_runtime(monkeypatch, make_runtime, vision_encoder=["dla0", "gpu", "cpu"],
                             decoder=["gpu", "cpu"])
    # precision auto: a device without an int8 engine is asked for an fp16 one before the next device
    assert fakes[0].calls == [("vision_encoder", "dla0"), ("vision_encoder", "dla0"), ("vision_encoder", "gpu"),
                              ("decoder", "gpu")]
    assert rt.devices == {"vision_encoder": "gpu", "embed_tokens": "cpu", "decoder": "gpu"}
    report = rt.placement_report()
    assert report["vision_encoder"]["skipped"] == [{"device": "dla0",
                                                    "reason": "no int8 engine for vision_encoder on dla0"}]
    assert report["decoder"]["device"] == "gpu" and report["decoder"]["skipped"] == []
    assert rt.components.extra["placement"]["vision_encoder"]["device"] == "gpu"
    image = model_dir / "samples" / "scene_11.png"
    result = rt.infer(image, "how many shapes are there ?")
    assert result.devices == {"encode": "gpu", "decode": "gpu"}
    assert result.text == runtime.infer(image, "how many shapes are there ?").text


def test_all_devices_failing_stops_the_load(monkeypatch, make_runtime):
    with pytest.raises(EngineError) as info:
        fake_runtime(monkeypatch, make_runtime, vision_encoder=["dla0"])
    assert str(info.value) == "no int8 engine for vision_encoder on dla0"


def test_engine_folder_default_and_override(make_runtime, tmp_path, runtime):
    assert runtime.engines_dir == default_engines_dir("tiny-vlm")
    assert runtime.engines_dir.parts[-2:] == ("engines", "tiny-vlm")
    assert make_runtime(model={"engines": str(tmp_path)}).engines_dir == tmp_path


# ---- standby components: the power policy moves a stage between devices -------------------

def test_reachable_devices_are_what_the_policy_can_pick():
    assert reachable_devices(["dla0", "gpu", "cpu"]) == ["dla0", "gpu"]  # cpu: a fallback only
    assert reachable_devices(["gpu", "dla0", "cpu"]) == ["gpu", "dla0"]
    assert reachable_devices(["gpu", "cpu"]) == ["gpu"]
    assert reachable_devices(["cpu", "gpu"]) == ["cpu", "gpu"]
    assert reachable_devices(["dla1", "gpu"]) == ["dla1", "gpu"]  # dla1 on a 2-core module
    assert reachable_devices(["cpu"]) == ["cpu"]


class AllLoadTensorRT(FakeTensorRT):
    """Every engine loads (the ONNX graph relabelled), as on an Orin NX with engines for both."""
    fails = ()


def standby_runtime(monkeypatch, make_runtime, keep=True):
    rt, fakes = fake_runtime(monkeypatch, make_runtime, AllLoadTensorRT, vision_encoder=["gpu", "dla0", "cpu"],
                             decoder=["gpu", "cpu"], keep_alternatives=keep)
    return rt, fakes[0]


def test_the_policy_devices_are_loaded_and_followed(monkeypatch, make_runtime, model_dir, runtime):
    rt, fake = standby_runtime(monkeypatch, make_runtime)
    assert fake.calls == [("vision_encoder", "gpu"), ("vision_encoder", "dla0"), ("decoder", "gpu")]
    assert rt.placement_report()["vision_encoder"]["standby"] == ["dla0"]
    assert rt.devices == {"vision_encoder": "gpu", "embed_tokens": "cpu", "decoder": "gpu"}
    image = model_dir / "samples" / "scene_11.png"
    expected = runtime.infer(image, "how many shapes are there ?").text

    hot = Route({"vision_encoder": "dla0", "embed_tokens": "cpu", "decoder": "gpu"}, "hot → DLA first")
    result = rt.infer(image, "how many shapes are there ?", route=hot)
    assert result.devices == {"encode": "dla0", "decode": "gpu"} and result.text == expected
    assert result.schedule["placement"] == "hot → DLA first"
    dla = rt.standby["vision_encoder"]["dla0"]
    calls = dla.stats.calls
    rt.infer(image, "what colour is the circle ?", route=hot, tier="low")
    assert dla.stats.calls == calls + 1  # the encoder really ran on the standby component

    # a device the component is not loaded on: its first device runs it, nothing fails
    lost = Route({"vision_encoder": "dla1", "embed_tokens": "cpu", "decoder": "dla0"}, "x")
    assert rt.infer(image, "how many shapes are there ?", route=lost).devices == {"encode": "gpu", "decode": "gpu"}
    assert rt.infer(image, "how many shapes are there ?").devices == {"encode": "gpu", "decode": "gpu"}


def test_keep_alternatives_off_loads_only_the_first(monkeypatch, make_runtime):
    rt, fake = standby_runtime(monkeypatch, make_runtime, keep=False)
    assert fake.calls == [("vision_encoder", "gpu"), ("decoder", "gpu")]
    hot = Route({"vision_encoder": "dla0", "embed_tokens": "cpu", "decoder": "gpu"}, "hot")
    assert rt.resolve(hot) == ("gpu", "cpu", "gpu")


def test_a_standby_that_fails_to_load_is_reported_not_fatal(monkeypatch, make_runtime):
    rt, _ = fake_runtime(monkeypatch, make_runtime, vision_encoder=["gpu", "dla0", "cpu"])
    report = rt.placement_report()["vision_encoder"]
    assert report["device"] == "gpu" and report["standby"] == []
    assert report["skipped"] == [{"device": "dla0", "reason": "no int8 engine for vision_encoder on dla0"}]


def test_pipeline_batches_only_requests_bound_for_the_same_devices(monkeypatch, make_runtime, model_dir):
    rt, _ = standby_runtime(monkeypatch, make_runtime)
    image = model_dir / "samples" / "scene_11.png"
    routes = [Route({"vision_encoder": d, "embed_tokens": "cpu", "decoder": "gpu"}, d)
              for d in ("gpu", "dla0", "dla0", "gpu")]
    with Pipeline(rt, queue_size=8, max_batch=4, batch_timeout_ms=50) as pipeline:
        futures = [pipeline.submit(Request(image, "how many shapes are there ?", {"route": r, "tier": "low"}))
                   for r in routes]
        results = [f.result(60) for f in futures]
    assert [r.devices["encode"] for r in results] == ["gpu", "dla0", "dla0", "gpu"]
    assert len({r.text for r in results}) == 1
