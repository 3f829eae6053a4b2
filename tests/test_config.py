"""edgemm.config: defaults, YAML loading, round trip, and one-line errors naming the key path."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from edgemm.config import (
    MAX_CONFIG_BYTES, BackendConfig, CacheConfig, Config, GenerationConfig, LimitsConfig, ModelConfig,
    OffloadConfig, PlacementConfig, PowerConfig as PowerSection, SchedulerConfig, ServerConfig, StreamConfig,
    AlertConfig, WebhookConfig,
    config_from_dict, config_to_dict, load_config,
)
from edgemm.errors import ConfigError
from edgemm.util.typed_yaml import build

FULL_YAML = """\
model:
  path: /opt/models/my-vlm
  precision: int8
  engines: /opt/engines/my-vlm
backend:
  name: onnxruntime
  providers: [tensorrt, cuda, cpu]
  intra_op_threads: 2
  warmup: [global, 2x2]
limits:
  max_pixels: 12_000_000
  max_image_bytes: 1048576
  max_decoded_bytes: 50000000
  decode_budget_bytes: 60000000
  max_synthetic_pixels: 1000000
  max_prompt_chars: 500
  unknown_words: refuse
generation:
  max_new_tokens: 64
  temperature: 0.7
  top_p: 0.9
  seed: 1234
  tier: low
  num_beams: 1
  beam_gate: 0.9
scheduler:
  policy: thresholds
  statistic: high_freq
  thresholds: [0.1, 0.25]
  detail_words: [read, plate]
  detail_tier: mid
cache:
  max_bytes: 1048576
placement:
  vision_encoder: [dla0, gpu, cpu]
  embed_tokens: [gpu, cpu]
  decoder: [gpu]
  keep_alternatives: false
server:
  socket: /tmp/edgemm.sock
  socket_mode: "0600"
  socket_group: robots
  tcp_port: 8080
  tcp_host: 127.0.0.2
  queue_size: 3
  max_batch: 2
  max_decoder_rows: 8
  batch_timeout_ms: 2.5
  encoder_batching: "off"
  continuous_batching: "off"
  request_timeout_s: 5.0
  body_timeout_s: 4.0
  stall_s: 30.0
  retry_after_s: 3
  grace_period_s: 1.0
  max_body_bytes: 1000
  max_connections: 7
  header_timeout_s: 3.0
  idle_timeout_s: 2.0
  max_header_bytes: 8192
  send_timeout_s: 12.0
  image_dirs: [/srv/edgemm/images]
  remote_images: true
  remote_timeout_s: 2.0
  max_streams: 2
  max_stream_listeners: 5
  webhook_hosts: [hooks.example, "10.0.0.9:8080"]
  source_hosts: [10.0.0.5, "cam.lan:8554"]
streams:
- id: door
  source: rtsp://10.0.0.5/stream
  prompt: is the door open ?
  fps: 0.5
  every: 2
  change_threshold: 4.0
  tier: low
  max_new_tokens: 8
  alerts:
    open:
      prompt: is the door open ?
      every: 2
      max_every: 6
      on_after: 3
      off_after: 4
      match: null
      above: null
      below: null
      max_new_tokens: 4
      webhook:
        url: https://hooks.example/door
        token_env: null
        token_file: /etc/edgemm/hook-token
        timeout_s: 2.0
        retries: 1
        backoff_s: 0.1
  webhook:
    url: http://10.0.0.9/alerts
    token_env: EDGEMM_HOOK
    token_file: null
    timeout_s: 5.0
    retries: 3
    backoff_s: 0.5
power:
  root: /srv/recording
  sample_period_s: 0.5
  history: 10
  budget_w: 15.0
  throttle_c: 80.0
  critical_c: 90.0
  slo_ms: 250.0
  hysteresis_c: 3.0
  hysteresis_pct: 5.0
  nvpmodel_query: true
offload:
  enabled: true
  url: https://llm.example/v1
  model: big-vlm
  api_key_env: EDGEMM_KEY
  api_key_file: /etc/edgemm/key
  timeout_s: 5.0
  retries: 1
  backoff_s: 0.2
  breaker_threshold: 2
  breaker_cooldown_s: 10.0
  allow: [critical]
  fallback_local: false
  max_concurrent: 2
"""


def write(tmp_path: Path, text: str, name: str = "edgemm.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error(data) -> str:
    """The message of the ConfigError that config_from_dict raises for `data` (asserted one line)."""
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    message = str(info.value)
    assert "\n" not in message and message.startswith("config: ")
    return message


# ---- defaults ------------------------------------------------------------------------

def test_defaults_match_the_documented_schema():
    cfg = Config()
    assert cfg.model == ModelConfig(path=None, precision="auto")
    assert cfg.backend == BackendConfig(name="onnxruntime", providers=["cpu"], intra_op_threads=0, warmup="all")
    assert cfg.limits == LimitsConfig(max_pixels=25_000_000, max_image_bytes=50 * 1024 * 1024, max_prompt_chars=4000,
                                      max_decoded_bytes=144 << 20, decode_budget_bytes=160 << 20)
    assert cfg.generation == GenerationConfig(max_new_tokens=32, temperature=0.0, top_p=1.0, seed=None, tier=None,
                                              num_beams=1, beam_gate=0.85)
    assert cfg.scheduler.policy == "auto" and cfg.scheduler.detail_tier is None
    assert cfg.cache == CacheConfig(max_bytes=64 * 1024 * 1024)


def test_default_list_is_not_shared_between_instances():
    a, b = Config(), Config()
    a.backend.providers.append("cuda")
    assert b.backend.providers == ["cpu"]


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_empty_file_gives_defaults(tmp_path, text):
    assert load_config(write(tmp_path, text)) == Config()


@pytest.mark.parametrize("source", [None, {}])
def test_none_and_empty_mapping_give_defaults(source):
    assert load_config(source) == Config()
    assert config_from_dict({}) == Config()


def test_empty_section_gives_that_sections_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "model:\ngeneration:\n  max_new_tokens: 8\n"))
    assert cfg.model == ModelConfig()
    assert cfg.generation == GenerationConfig(max_new_tokens=8)


def test_partial_section_keeps_other_defaults():
    cfg = config_from_dict({"backend": {"providers": ["cuda", "cpu"]}})
    assert cfg.backend == BackendConfig(providers=["cuda", "cpu"])
    assert cfg.model == ModelConfig() and cfg.generation == GenerationConfig()


# ---- full file and round trip ---------------------------------------------------------

def test_full_yaml_file_loads_every_field(tmp_path):
    cfg = load_config(write(tmp_path, FULL_YAML))
    assert cfg == Config(
        model=ModelConfig(path="/opt/models/my-vlm", precision="int8", engines="/opt/engines/my-vlm"),
        backend=BackendConfig(name="onnxruntime", providers=["tensorrt", "cuda", "cpu"],
                              intra_op_threads=2, warmup=["global", "2x2"]),
        limits=LimitsConfig(max_pixels=12_000_000, max_image_bytes=1048576, max_prompt_chars=500, unknown_words="refuse",
                            max_decoded_bytes=50_000_000, decode_budget_bytes=60_000_000,
                            max_synthetic_pixels=1_000_000),
        generation=GenerationConfig(max_new_tokens=64, temperature=0.7, top_p=0.9, seed=1234, tier="low",
                                    num_beams=1, beam_gate=0.9),
        scheduler=SchedulerConfig(policy="thresholds", statistic="high_freq", thresholds=[0.1, 0.25],
                                  detail_words=["read", "plate"], detail_tier="mid"),
        cache=CacheConfig(max_bytes=1048576),
        placement=PlacementConfig(vision_encoder=["dla0", "gpu", "cpu"], embed_tokens=["gpu", "cpu"], decoder=["gpu"],
                                  keep_alternatives=False),
        server=ServerConfig(socket="/tmp/edgemm.sock", socket_mode="0600", socket_group="robots", tcp_port=8080,
                            tcp_host="127.0.0.2", queue_size=3, max_batch=2, max_decoder_rows=8, batch_timeout_ms=2.5,
                            encoder_batching="off",
                            continuous_batching="off",
                            request_timeout_s=5.0, body_timeout_s=4.0, stall_s=30.0, retry_after_s=3, grace_period_s=1.0, max_body_bytes=1000,
                            max_connections=7, header_timeout_s=3.0, idle_timeout_s=2.0, max_header_bytes=8192,
                            send_timeout_s=12.0,
                            image_dirs=["/srv/edgemm/images"], remote_images=True,
                            remote_timeout_s=2.0, max_streams=2, max_stream_listeners=5,
                            webhook_hosts=["hooks.example", "10.0.0.9:8080"], source_hosts=["10.0.0.5", "cam.lan:8554"]),
        streams=[StreamConfig(id="door", source="rtsp://10.0.0.5/stream", prompt="is the door open ?", fps=0.5,
                              every=2, change_threshold=4.0, tier="low", max_new_tokens=8,
                              alerts={"open": AlertConfig(prompt="is the door open ?", every=2, max_every=6, on_after=3, off_after=4,
                                                          max_new_tokens=4, webhook=WebhookConfig(
                                                              url="https://hooks.example/door",
                                                              token_file="/etc/edgemm/hook-token", timeout_s=2.0,
                                                              retries=1, backoff_s=0.1))},
                              webhook=WebhookConfig(url="http://10.0.0.9/alerts", token_env="EDGEMM_HOOK"))],
        power=PowerSection(root="/srv/recording", sample_period_s=0.5, history=10, budget_w=15.0, throttle_c=80.0,
                          critical_c=90.0, slo_ms=250.0, hysteresis_c=3.0, hysteresis_pct=5.0, nvpmodel_query=True),
        offload=OffloadConfig(enabled=True, url="https://llm.example/v1", model="big-vlm", api_key_env="EDGEMM_KEY",
                              api_key_file="/etc/edgemm/key", timeout_s=5.0, retries=1, backoff_s=0.2,
                              breaker_threshold=2, breaker_cooldown_s=10.0, allow=["critical"],
                              fallback_local=False, max_concurrent=2),
    )


def test_full_yaml_round_trips_through_dict_and_yaml(tmp_path):
    cfg = load_config(write(tmp_path, FULL_YAML))
    as_dict = config_to_dict(cfg)
    assert as_dict == yaml.safe_load(FULL_YAML)
    assert config_from_dict(as_dict) == cfg
    again = write(tmp_path, yaml.safe_dump(as_dict, sort_keys=False), "again.yaml")
    assert load_config(again) == cfg


def test_to_dict_is_plain_and_detached():
    cfg = Config()
    as_dict = config_to_dict(cfg)
    assert type(as_dict) is dict and all(type(v) is (list if k == "streams" else dict) for k, v in as_dict.items())
    assert set(as_dict) == {f.name for f in dataclasses.fields(Config)}
    as_dict["backend"]["providers"].append("cuda")
    assert cfg.backend.providers == ["cpu"]
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_path_like_and_str_sources(tmp_path):
    path = write(tmp_path, "generation: {seed: 7}\n")
    assert load_config(path).generation.seed == 7
    assert load_config(str(path)).generation.seed == 7


def test_dict_source_is_used_as_is():
    assert load_config({"model": {"precision": "fp16"}}).model.precision == "fp16"


def test_non_path_source_is_a_type_error():
    with pytest.raises(TypeError):
        load_config(42)


# ---- unknown keys ---------------------------------------------------------------------

def test_unknown_top_level_key_names_it_and_the_known_sections():
    message = error({"modle": {}})
    known = ", ".join(sorted(f.name for f in dataclasses.fields(Config)))
    assert message == f"config: unknown key 'modle' (known: {known})"
    assert known.startswith("backend, cache, generation, limits, model, offload, placement, power, scheduler")


def test_unknown_nested_key_names_full_path_and_known_keys():
    message = error({"backend": {"thread": 4}})
    assert message == ("config: unknown key 'backend.thread' "
                       "(known: intra_op_threads, name, providers, warmup)")


def test_non_string_key_is_unknown():
    assert "unknown key 'generation.1'" in error({"generation": {1: 2}})


# ---- wrong types ----------------------------------------------------------------------

@pytest.mark.parametrize("data, expected", [
    ({"generation": {"max_new_tokens": "ten"}},
     "config: 'generation.max_new_tokens' must be an integer, got 'ten' (str)"),
    ({"generation": {"max_new_tokens": True}},  # bool for int
     "config: 'generation.max_new_tokens' must be an integer, got True (bool)"),
    ({"generation": {"max_new_tokens": 10.0}},  # float for int
     "config: 'generation.max_new_tokens' must be an integer, got 10.0 (float)"),
    ({"backend": {"warmup": 1}},  # int for bool
     "config: 'backend.warmup' must be all, none, a list of tier names or true/false, got 1 (int)"),
    ({"backend": {"warmup": "yes"}},
     "config: 'backend.warmup' must be all, none, a list of tier names or true/false, got 'yes' (str)"),
    ({"backend": {"warmup": None}},
     "config: 'backend.warmup' must be all, none, a list of tier names or true/false, got None (NoneType)"),
    ({"backend": {"warmup": []}},
     "config: 'backend.warmup' must list at least one tier (or be none), got []"),
    ({"backend": {"warmup": ["low", 2]}},
     "config: 'backend.warmup[1]' must be a tier name, got 2 (int)"),
    ({"backend": {"warmup": ["low", "low"]}},
     "config: 'backend.warmup[1]' must not repeat an earlier tier, got 'low'"),
    ({"model": {"precision": ["fp16"]}},  # list for str
     "config: 'model.precision' must be a string, got ['fp16'] (list)"),
    ({"server": {"encoder_batching": False}},  # `encoder_batching: off` unquoted
     "config: 'server.encoder_batching' must be a string (YAML read an unquoted on/off/yes/no as false: "
     "quote it), got False (bool)"),
    ({"model": {"path": 5}},  # optional str
     "config: 'model.path' must be a string or null, got 5 (int)"),
    ({"generation": {"seed": "abc"}},  # optional int
     "config: 'generation.seed' must be an integer or null, got 'abc' (str)"),
    ({"generation": {"seed": False}},
     "config: 'generation.seed' must be an integer or null, got False (bool)"),
    ({"backend": {"providers": {"cpu": 1}}},  # mapping for list
     "config: 'backend.providers' must be a list of strings, got {'cpu': 1} (dict)"),
    ({"backend": {"providers": "cpu"}},  # a bare string is not a list
     "config: 'backend.providers' must be a list of strings, got 'cpu' (str)"),
    ({"backend": {"providers": ["cpu", 3]}},  # bad list item
     "config: 'backend.providers[1]' must be a string, got 3 (int)"),
    ({"generation": {"temperature": "hot"}},
     "config: 'generation.temperature' must be a finite number, got 'hot' (str)"),
    ({"generation": {"temperature": True}},  # bool for float
     "config: 'generation.temperature' must be a finite number, got True (bool)"),
    ({"generation": {"temperature": float("nan")}},
     "config: 'generation.temperature' must be a finite number, got nan (float)"),
    ({"model": "fp16"},  # non-mapping section
     "config: 'model' must be a mapping, got 'fp16' (str)"),
    ({"limits": [1, 2]},
     "config: 'limits' must be a mapping, got [1, 2] (list)"),
])
def test_wrong_types_name_the_path_expected_type_and_value(data, expected):
    assert error(data) == expected


def test_long_values_are_shortened_in_messages():
    message = error({"model": {"precision": ["x" * 200]}})
    assert len(message) < 160 and "..." in message and "(list)" in message


def test_yaml_true_is_not_an_int_and_1_is_not_a_bool(tmp_path):
    with pytest.raises(ConfigError, match=r"'limits\.max_prompt_chars' must be an integer, got True \(bool\)"):
        load_config(write(tmp_path, "limits:\n  max_prompt_chars: true\n"))
    with pytest.raises(ConfigError, match=r"'offload\.enabled' must be a boolean \(true/false\), got 1 \(int\)"):
        load_config(write(tmp_path, "offload:\n  enabled: 1\n"))


@pytest.mark.parametrize("text, value", [("true", "all"), ("false", "none"), ("off", "none"), ("all", "all"),
                                         ("none", "none"), ("[high, low]", ["high", "low"])])
def test_backend_warmup_takes_all_none_a_tier_list_and_the_older_booleans(tmp_path, text, value):
    assert load_config(write(tmp_path, f"backend:\n  warmup: {text}\n")).backend.warmup == value
    assert BackendConfig(warmup=True).warmup == "all" and BackendConfig(warmup=False).warmup == "none"


@pytest.mark.parametrize("text, value", [("0", 0.0), ("1", 1.0), ("0.25", 0.25)])
def test_int_is_accepted_where_float_is_expected(tmp_path, text, value):
    cfg = load_config(write(tmp_path, f"generation:\n  temperature: {text}\n  top_p: 1\n"))
    assert cfg.generation.temperature == value and type(cfg.generation.temperature) is float
    assert cfg.generation.top_p == 1.0 and type(cfg.generation.top_p) is float


def test_null_allowed_only_for_optional_fields():
    cfg = config_from_dict({"model": {"path": None}, "generation": {"seed": None, "tier": None}})
    assert cfg.model.path is None and cfg.generation.seed is None and cfg.generation.tier is None
    assert error({"model": {"precision": None}}) == "config: 'model.precision' must be a string, got None (NoneType)"


# ---- ranges and choices ---------------------------------------------------------------

@pytest.mark.parametrize("data, expected", [
    ({"model": {"precision": "int4"}}, "config: 'model.precision' must be one of auto, fp32, fp16, int8, q4, q4f16, quantized, uint8, bnb4, got 'int4'"),
    ({"model": {"path": ""}}, "config: 'model.path' must be a folder or null, got ''"),
    ({"backend": {"name": "tflite"}}, "config: 'backend.name' must be one of onnxruntime, got 'tflite'"),
    ({"server": {"encoder_batching": "sometimes"}},
     "config: 'server.encoder_batching' must be one of auto, on, off, got 'sometimes'"),
    ({"server": {"continuous_batching": "always"}},
     "config: 'server.continuous_batching' must be one of auto, on, off, got 'always'"),
    ({"backend": {"providers": []}}, "config: 'backend.providers' must list at least one provider, got []"),
    ({"backend": {"providers": ["cpu", "rocm"]}},
     "config: 'backend.providers[1]' must be one of cpu, cuda, tensorrt, got 'rocm'"),
    ({"backend": {"providers": ["cuda", "cuda"]}},
     "config: 'backend.providers[1]' must not repeat an earlier provider, got 'cuda'"),
    ({"backend": {"intra_op_threads": -1}}, "config: 'backend.intra_op_threads' must be >= 0, got -1"),
    ({"limits": {"max_pixels": 0}}, "config: 'limits.max_pixels' must be > 0, got 0"),
    ({"limits": {"max_decoded_bytes": 0}}, "config: 'limits.max_decoded_bytes' must be > 0, got 0"),
    ({"limits": {"decode_budget_bytes": 1000}},
     "config: 'limits.decode_budget_bytes' must be >= limits.max_decoded_bytes (150994944), got 1000"),
    ({"limits": {"max_image_bytes": -5}}, "config: 'limits.max_image_bytes' must be > 0, got -5"),
    ({"limits": {"max_prompt_chars": 0}}, "config: 'limits.max_prompt_chars' must be > 0, got 0"),
    ({"generation": {"max_new_tokens": 0}}, "config: 'generation.max_new_tokens' must be in 1..4096, got 0"),
    ({"generation": {"max_new_tokens": 4097}}, "config: 'generation.max_new_tokens' must be in 1..4096, got 4097"),
    ({"generation": {"temperature": -0.1}}, "config: 'generation.temperature' must be >= 0, got -0.1"),
    ({"generation": {"top_p": 0}}, "config: 'generation.top_p' must be in (0, 1], got 0.0"),
    ({"generation": {"top_p": 1.5}}, "config: 'generation.top_p' must be in (0, 1], got 1.5"),
    ({"generation": {"seed": -1}}, "config: 'generation.seed' must be >= 0 or null, got -1"),
    ({"generation": {"tier": " "}}, "config: 'generation.tier' must be a tier name or null, got ' '"),
    ({"generation": {"num_beams": 0}}, "config: 'generation.num_beams' must be in 1..16, got 0"),
    ({"generation": {"beam_gate": 1.5}}, "config: 'generation.beam_gate' must be in [0, 1], got 1.5"),
    ({"generation": {"num_beams": 2, "temperature": 0.5}},
     "config: 'generation.num_beams' must be 1 when sampling (beam search is greedy: temperature 0), got 2"),
    ({"scheduler": {"policy": "fast"}},
     "config: 'scheduler.policy' must be one of auto, top, thresholds, calibrated, got 'fast'"),
    ({"scheduler": {"statistic": "blur"}}, "config: 'scheduler.statistic' must be one of mean_saliency, "
                                            "salient_fraction, high_freq, edge_density, fine_strokes, got 'blur'"),
    ({"scheduler": {"thresholds": [0.2, 0.1]}}, "config: 'scheduler.thresholds' must not decrease, got [0.2, 0.1]"),
    ({"cache": {"max_bytes": -1}}, "config: 'cache.max_bytes' must be >= 0, got -1"),
    ({"server": {"socket_mode": "rw-rw----"}},
     "config: 'server.socket_mode' must be octal permissions like '0660', got 'rw-rw----'"),
    ({"server": {"socket_mode": "1777"}}, "config: 'server.socket_mode' must be octal permissions like '0660', got '1777'"),
    ({"server": {"socket": " "}}, "config: 'server.socket' must be a path or null, got ' '"),
    ({"backend": {"name": "tensorrt"}}, "config: 'backend.name: tensorrt' is not a switch any more: TensorRT "
     "engines are chosen per component by placement (e.g. placement.vision_encoder: [dla0, gpu, cpu], "
     "decoder: [gpu, cpu]); remove backend.name"),
    ({"limits": {"unknown_words": "ignore"}}, "config: 'limits.unknown_words' must be one of warn, refuse, got 'ignore'"),
    ({"server": {"tcp_port": 70000}}, "config: 'server.tcp_port' must be in 0..65535 or null, got 70000"),
    ({"server": {"queue_size": 0}}, "config: 'server.queue_size' must be >= 1, got 0"),
    ({"server": {"request_timeout_s": 0}}, "config: 'server.request_timeout_s' must be > 0, got 0.0"),
    ({"server": {"body_timeout_s": 0}}, "config: 'server.body_timeout_s' must be > 0, got 0.0"),
    ({"server": {"max_stream_listeners": 0}}, "config: 'server.max_stream_listeners' must be >= 1, got 0"),
    ({"streams": [{"id": "a", "source": "synthetic://", "fps": 1e-320}]}, "config: 'streams[0].fps' must be between 0.001 and 1000 or null, got 1e-320"),
    ({"server": {"stall_s": 0}}, "config: 'server.stall_s' must be > 0, got 0.0"),
    ({"server": {"grace_period_s": -1}}, "config: 'server.grace_period_s' must be >= 0, got -1.0"),
    ({"streams": [{"id": "a b", "source": "csi://0"}]},
     "config: 'streams[0].id' must be a name of letters, digits, '_', '.', '-' (at most 64), got 'a b'"),
    ({"streams": [{"id": "cam"}]}, "config: 'streams[0].source' must be a source URI, got ''"),
    ({"streams": [{"id": "cam", "source": "csi://0", "fps": 0}]}, "config: 'streams[0].fps' must be between 0.001 and 1000 or null, got 0.0"),
    ({"streams": [{"id": "cam", "source": "csi://0", "change_threshold": 256}]},
     "config: 'streams[0].change_threshold' must be in 0..255 or null, got 256.0"),
    ({"streams": [{"id": "a", "source": "csi://0"}, {"id": "a", "source": "csi://1"}]},
     "config: 'streams[1].id' must not repeat an earlier stream's id, got 'a'"),
    ({"streams": {"id": "a"}}, "config: 'streams' must be a list of mappings, got {'id': 'a'} (dict)"),
])
def test_range_and_choice_errors_name_the_path(data, expected):
    assert error(data) == expected


@pytest.mark.parametrize("data", [
    {"generation": {"max_new_tokens": 1}}, {"generation": {"max_new_tokens": 4096}},
    {"generation": {"top_p": 1}}, {"generation": {"temperature": 0}},
    {"backend": {"intra_op_threads": 0}}, {"generation": {"seed": 0}},
    {"model": {"precision": "fp16"}}, {"backend": {"providers": ["tensorrt", "cuda", "cpu"]}},
])
def test_boundary_values_are_accepted(data):
    config_from_dict(data)


# ---- file problems ----------------------------------------------------------------------

def test_a_fifo_a_device_or_a_huge_file_is_refused_before_it_is_read(tmp_path):
    """open() on a FIFO waits for a writer for ever; /dev/zero never ends (the CLI was
    OOM-killed at 20 GB): a config is stat-ed first and must be a regular file <= 1 MiB."""
    fifo = tmp_path / "cfg.fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.yaml"
    big.write_text("#" * (MAX_CONFIG_BYTES + 1))
    for path, detail in ((fifo, "path is a FIFO, not a regular file"),
                         ("/dev/zero", "path is a character device, not a regular file"),
                         (big, f"is {MAX_CONFIG_BYTES + 1} bytes, above the {MAX_CONFIG_BYTES} byte limit "
                               "(for a config file)")):
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value) == f"config: {path}: {detail}"
    big.write_text("#" * MAX_CONFIG_BYTES)
    assert load_config(big) == Config()  # at the cap: read


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config: {path}: file not found"
    assert info.value.file == str(path)


def test_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"config: {tmp_path}: path is a directory, not a file")):
        load_config(tmp_path)


def test_non_utf8_file_is_refused(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"model:\n  path: /caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


@pytest.mark.parametrize("text, line", [
    ("model:\n  precision: fp16\n   path: x\n", 3),  # bad indentation
    ("backend:\n  providers: [cpu, cuda\n", 3),  # unclosed flow sequence
    ("generation:\n  tier: 'low\n", 3),  # unclosed quote
    ("model: !!python/object:os.system {}\n", 1),  # unsafe tag
])
def test_malformed_yaml_names_file_and_line(tmp_path, text, line):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"config: {path}:{line}:") and "invalid YAML: " in message


@pytest.mark.parametrize("text, shown", [
    ("- model\n- backend\n", "['model', 'backend'] (list)"),
    ("just a string\n", "'just a string' (str)"),
    ("42\n", "42 (int)"),
])
def test_top_level_must_be_a_mapping(tmp_path, text, shown):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config: {path}: top level must be a mapping of sections, got {shown}"


def test_schema_errors_from_a_file_name_the_file(tmp_path):
    path = write(tmp_path, "generation:\n  max_new_tokens: ten\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config: {path}: 'generation.max_new_tokens' must be an integer, got 'ten' (str)"
    assert info.value.detail == "'generation.max_new_tokens' must be an integer, got 'ten' (str)"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---- extensibility: a new section is just a new dataclass field ------------------------

@dataclasses.dataclass
class PowerConfig:  # a stand-in for a future section
    mode: str = "maxn"
    fan: bool | None = None
    budgets_w: list[float] = dataclasses.field(default_factory=lambda: [10.0])

    def validate(self, path):
        if self.mode not in ("maxn", "15w"):
            raise ConfigError(f"{path + '.mode'!r} must be one of maxn, 15w, got {self.mode!r}")


@dataclasses.dataclass
class BiggerConfig(Config):
    power: PowerConfig = dataclasses.field(default_factory=PowerConfig)


def test_new_section_needs_only_a_dataclass_field():
    cfg = build(BiggerConfig, {"power": {"budgets_w": [7, 12.5], "fan": True}}, "")
    assert cfg.power == PowerConfig(mode="maxn", fan=True, budgets_w=[7.0, 12.5])
    assert cfg.model == ModelConfig()
    with pytest.raises(ConfigError, match=r"^config: 'power\.budgets_w\[0\]' must be a finite number, got 'x' \(str\)$"):
        build(BiggerConfig, {"power": {"budgets_w": ["x"]}}, "")
    with pytest.raises(ConfigError, match=r"^config: 'power\.mode' must be one of maxn, 15w, got 'eco'$"):
        build(BiggerConfig, {"power": {"mode": "eco"}}, "")
    with pytest.raises(ConfigError, match=r"unknown key 'power\.fans' \(known: budgets_w, fan, mode\)"):
        build(BiggerConfig, {"power": {"fans": 1}}, "")


# ---- YAML nested too deep or with huge integers: exit 2 and one line, not an internal error ----

DEEP_FLOW = "backend: " + "[" * 500 + "]" * 500 + "\n"  # PyYAML's composer recursed into a RecursionError
DEEP_BLOCK = "backend:\n" + "".join("  " * i + f"a{i}:\n" for i in range(1, 300))
HUGE_INT = "backend:\n  intra_op_threads: " + "9" * 4301 + "\n"  # int() refused it: a ValueError


def _edgemm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgemm.cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def _one_line_exit_2(done: subprocess.CompletedProcess, expected: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgemm: error: "), done.stderr
    assert expected in lines[0] and "internal error" not in lines[0]


@pytest.mark.parametrize("text, expected", [(DEEP_FLOW, "nests more than 64 levels deep"),
                                            (DEEP_BLOCK, "nests more than 64 levels deep"),
                                            (HUGE_INT, "an integer longer than 100 characters")])
@pytest.mark.parametrize("command", ["infer", "serve", "stream"])
def test_deep_or_huge_yaml_config_exits_2_in_every_command(command, text, expected, tmp_path, model_dir):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    target = {"infer": [model_dir / "samples" / "scene_12.png"], "serve": [],
              "stream": ["synthetic://?fps=10"]}[command]
    done = _edgemm(command, *target, "--config", config)
    _one_line_exit_2(done, expected)
    assert f"config: {config}:" in done.stderr  # names the file and the line:column


@pytest.mark.parametrize("name", ["model.yaml", "scheduler.yaml"])
def test_deep_or_huge_model_yaml_exits_2(name, tmp_model, model_dir):
    for text, expected in [(DEEP_FLOW, "nests more than 64 levels deep"),
                           (HUGE_INT, "an integer longer than 100 characters")]:
        (tmp_model / name).write_text(text)
        _one_line_exit_2(_edgemm("infer", model_dir / "samples" / "scene_12.png", "--model", tmp_model), expected)
