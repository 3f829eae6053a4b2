"""Typed runtime configuration, read from one YAML file.

Every key is optional; anything left out takes the default documented next to
its field below. Unknown keys, wrong types and out-of-range values are refused
with a one-line `ConfigError` naming the full key path, e.g.

    config: unknown key 'backend.thread' (known: intra_op_threads, name, providers, warmup)
    config: 'generation.max_new_tokens' must be an integer, got 'ten' (str)

The dict → dataclass conversion is generic (edgemm/util/typed_yaml.py, which says
what field types it takes), so a new section is added by writing its dataclass, with
an optional `validate(self, path)` for ranges and choices, and adding it as a field
of `Config`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from edgemm.errors import ConfigError
from edgemm.model.manifest_types import AUTO, PRECISIONS as VARIANTS
from edgemm.net.allowlist import url_host, webhook_host
from edgemm.util.files import load_yaml, read_regular_file
from edgemm.util.errors import LimitError
from edgemm.util.generation_limits import FIELDS as GENERATION_FIELDS, check_generation, check_text
from edgemm.util.typed_yaml import build, choice, require, show

# The tier scheduler's vocabulary (edgemm/engine/tiers.py computes these statistics and reads
# these words): named here, where the config checks them, so the config imports no engine module.
STATISTICS = ("mean_saliency", "salient_fraction", "high_freq", "edge_density", "fine_strokes")
DETAIL_WORDS = ("read", "text", "written", "say", "says", "sign", "label", "number", "digits")

__all__ = [
    "ModelConfig", "BackendConfig", "LimitsConfig", "GenerationConfig",
    "SchedulerConfig", "CacheConfig", "PlacementConfig", "PowerConfig", "OffloadConfig",
    "ServerConfig", "StreamConfig", "AlertConfig", "WebhookConfig", "Config", "load_config", "config_from_dict", "config_to_dict",
]

PRECISIONS = (AUTO, *VARIANTS)  # model.precision: auto, or a variant's file suffix (edgemm/model/manifest_types.py)
BACKENDS = ("onnxruntime",)  # backend.name: only kept so older configs load; TensorRT is chosen by placement
PROVIDERS = ("cpu", "cuda", "tensorrt")
SCHEDULER_POLICIES = ("auto", "top", "thresholds", "calibrated")
PLACEMENT_DEVICES = ("gpu", "dla0", "dla1", "cpu")
DEVICES = PLACEMENT_DEVICES
OFFLOAD_CONDITIONS = ("critical", "slo", "hot", "budget")
UNKNOWN_WORDS = ("warn", "refuse")  # limits.unknown_words


# A config file is a few KB: --config /dev/zero or a 20 GB file is refused before it is read
MAX_CONFIG_BYTES = 1024 * 1024


# ---- the generation options' limits, as config errors ----------------------------

def _generation_limits(path: str, nullable: tuple[str, ...] = (), **values: Any) -> None:
    """edgemm.util.generation_limits' checks, as a ConfigError naming `path`.<option>."""
    try:
        check_generation(**values, names={k: f"{path}.{k}" for k in values}, nullable=nullable)
    except LimitError as e:
        raise ConfigError(str(e)) from None


# ---- sections ------------------------------------------------------------------------

@dataclass
class ModelConfig:
    path: str | None = None  # model folder; null = the built-in tiny-vlm shipped inside the package (edgemm/builtin/tiny-vlm)
    # auto | fp32 | fp16 | int8 | q4 | q4f16 | quantized | uint8 | bnb4: the graphs' variant, by file suffix
    # (decoder_model_merged_q4.onnx …), or the TensorRT engines' (int8 | fp16). auto = the fastest one present
    # for each component's device: on the CPU q4, else fp32 (never the QDQ int8, slower than fp32 there, nor
    # dynamic int8, whose rows depend on their batch mates), on TensorRT int8 > fp16 (docs/models.md, "Precisions")
    precision: str = "auto"
    engines: str | None = None  # TensorRT engine folder (with manifest.yaml); null = <engines root>/<model name>: $EDGEMM_ENGINES, /var/lib/edgemm/engines for root, else ~/.cache/edgemm/engines

    def validate(self, path: str) -> None:
        if self.path is not None:
            require(self.path.strip() != "", f"{path}.path", "be a folder or null", self.path)
        if self.engines is not None:
            require(self.engines.strip() != "", f"{path}.engines", "be a folder or null", self.engines)
        choice(self.precision, PRECISIONS, f"{path}.precision")


@dataclass
class BackendConfig:
    # no longer a switch: cpu placements run on onnxruntime, gpu/dla0/dla1 placements on TensorRT
    # engines. Only `onnxruntime` is accepted, so that configs written before still load.
    name: str = "onnxruntime"
    providers: list[str] = field(default_factory=lambda: ["cpu"])  # onnxruntime execution providers, most preferred first: cpu | cuda | tensorrt
    # threads per onnxruntime session; 0 = edgemm decides: onnxruntime's default for one request
    # at a time (edgemm infer), half the usable cores each where the encoder and the decoder run
    # at once (serve, stream), which also turns off spin-waiting so the two don't steal cores
    intra_op_threads: int = 0
    # which tiers `serve` and `stream` (and a Runtime made from this config) run once at load, so
    # that no request pays for first-run allocation: all | none | a list of tier names (true = all,
    # false = none). A one-shot `edgemm infer` never warms up: its answer is its own first run.
    warmup: Any = "all"

    def __post_init__(self) -> None:
        if isinstance(self.warmup, bool):  # the older spelling, still accepted
            self.warmup = "all" if self.warmup else "none"

    def validate(self, path: str) -> None:
        if self.name == "tensorrt":
            raise ConfigError(f"'{path}.name: tensorrt' is not a switch any more: TensorRT engines are chosen per "
                              "component by placement (e.g. placement.vision_encoder: [dla0, gpu, cpu], "
                              f"decoder: [gpu, cpu]); remove {path}.name")
        choice(self.name, BACKENDS, f"{path}.name")
        require(len(self.providers) > 0, f"{path}.providers", "list at least one provider", self.providers)
        for i, provider in enumerate(self.providers):
            choice(provider, PROVIDERS, f"{path}.providers[{i}]")
            require(provider not in self.providers[:i], f"{path}.providers[{i}]", "not repeat an earlier provider", provider)
        require(self.intra_op_threads >= 0, f"{path}.intra_op_threads", "be >= 0", self.intra_op_threads)
        _check_warmup(self.warmup, f"{path}.warmup")


WARMUP_CHOICES = ("all", "none")  # backend.warmup, besides a list of tier names


def _check_warmup(value: Any, path: str) -> None:
    """all, none, or a list of distinct tier names (checked against the model when it loads)."""
    if isinstance(value, list):
        require(len(value) > 0, path, "list at least one tier (or be none)", value)
        for i, name in enumerate(value):
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{f'{path}[{i}]'!r} must be a tier name, got {show(name)}")
            require(name not in value[:i], f"{path}[{i}]", "not repeat an earlier tier", name)
    elif value not in WARMUP_CHOICES or not isinstance(value, str):
        raise ConfigError(f"{path!r} must be all, none, a list of tier names or true/false, got {show(value)}")


@dataclass
class LimitsConfig:
    max_pixels: int = 25_000_000  # images with more pixels (width x height) are refused before decoding
    max_image_bytes: int = 50 * 1024 * 1024  # larger encoded images are refused unread
    # memory decoding one image may take, from its header (size x channels x bit depth,
    # plus the decoder's own buffers): above it, 400 / exit 2 before decoding
    max_decoded_bytes: int = 144 * 1024 * 1024
    # memory all images being decoded at once may take (the daemon's prepare threads):
    # an image that does not fit beside those in progress gets 503 + Retry-After; 16 MiB
    # more than one image's limit, so a 1080p frame (12 MB) still decodes beside the largest
    decode_budget_bytes: int = 160 * 1024 * 1024
    # synthetic:// frames are generated, not decoded, so decode_budget_bytes does not cover
    # them: a stream whose ?size= makes more pixels per frame (size²) is refused (400 / exit 2)
    # before it starts. 4 MP = 2000²; a 25 MP scene took a daemon to ~900 MB per stream
    max_synthetic_pixels: int = 4_000_000
    max_prompt_chars: int = 4000  # longer prompts are refused
    # a prompt with words the model's vocabulary lacks (the built-in model's closed world):
    # warn = answer, with a warning and the questions the model knows; refuse = 400 / exit 2
    unknown_words: str = "warn"

    def validate(self, path: str) -> None:
        for name in ("max_pixels", "max_image_bytes", "max_decoded_bytes", "decode_budget_bytes", "max_synthetic_pixels",
                     "max_prompt_chars"):
            require(getattr(self, name) > 0, f"{path}.{name}", "be > 0", getattr(self, name))
        # else an image within max_decoded_bytes could never be decoded by the daemon
        require(self.decode_budget_bytes >= self.max_decoded_bytes, f"{path}.decode_budget_bytes",
                 f"be >= limits.max_decoded_bytes ({self.max_decoded_bytes})", self.decode_budget_bytes)
        choice(self.unknown_words, UNKNOWN_WORDS, f"{path}.unknown_words")


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32  # most tokens generated per answer, 1..4096 (limits: edgemm/util/generation_limits.py)
    temperature: float = 0.0  # sampling temperature; 0 = greedy, else at least 0.001
    top_p: float = 1.0  # nucleus sampling mass, in (0, 1]; 1 = off
    seed: int | None = None  # sampling seed (0..2**64-1) for reproducible answers; null = random
    tier: str | None = None  # resolution tier name (see the model's tiers); null = the scheduler picks (scheduler.policy)
    num_beams: int = 1  # beam search width, 1..16; 1 = greedy / sampling
    beam_gate: float = 0.85  # beams collapse to the best once its next token is this likely, in [0, 1]; 1 = plain beam search

    def validate(self, path: str) -> None:
        _generation_limits(path, nullable=("seed",), **{k: getattr(self, k) for k in GENERATION_FIELDS})
        if self.tier is not None:
            require(self.tier.strip() != "", f"{path}.tier", "be a tier name or null", self.tier)


@dataclass
class SchedulerConfig:
    """Which resolution tier each request is encoded at, when no tier is pinned (edgemm/engine/tiers.py)."""
    # auto | top | thresholds | calibrated. auto = calibrated when the model folder ships its
    # calibration (scheduler.yaml, as models/tiny-vlm does), else top (the model's default
    # tier, its top tier unless model.yaml says otherwise)
    policy: str = "auto"
    statistic: str = "edge_density"  # what `thresholds` compare: mean_saliency | salient_fraction | high_freq | edge_density | fine_strokes
    thresholds: list[float] = field(default_factory=lambda: [0.008, 0.014])  # rising, one per tier above the cheapest: reaching the i-th lifts a frame to tier i+1
    detail_words: list[str] = field(default_factory=lambda: list(DETAIL_WORDS))  # prompts with one of these words ask for detail ...
    detail_tier: str | None = None  # ... and never go below this tier; null = the model's top tier

    def validate(self, path: str) -> None:
        choice(self.policy, SCHEDULER_POLICIES, f"{path}.policy")
        choice(self.statistic, STATISTICS, f"{path}.statistic")
        require(all(b >= a for a, b in zip(self.thresholds, self.thresholds[1:])), f"{path}.thresholds",
                 "not decrease", self.thresholds)


@dataclass
class CacheConfig:
    """Visual-feature cache: a second question about the same image skips the encoder."""
    max_bytes: int = 64 * 1024 * 1024  # memory for cached encoder outputs; 0 = no cache

    def validate(self, path: str) -> None:
        require(self.max_bytes >= 0, f"{path}.max_bytes", "be >= 0", self.max_bytes)


@dataclass
class PlacementConfig:
    """Where each component runs: devices tried in order, the first that loads wins.

    gpu / dla0 / dla1 load a TensorRT engine listed in the engine manifest (model.engines);
    cpu loads the ONNX graph with onnxruntime (backend.providers). Why an earlier device
    failed is logged and reported with the placement.
    """
    vision_encoder: list[str] = field(default_factory=lambda: ["cpu"])  # e.g. [dla0, gpu, cpu]
    embed_tokens: list[str] = field(default_factory=lambda: ["cpu"])  # a table lookup: cpu is fine
    decoder: list[str] = field(default_factory=lambda: ["cpu"])  # e.g. [gpu, cpu] (no DLA: dynamic shapes)
    # also load each component on the other devices the power policy may move it to (its
    # first DLA when hot or over budget, the GPU when latency is at risk), so it can; false:
    # only the first device that loads (less memory, and the policy's choice is only reported)
    keep_alternatives: bool = True

    def validate(self, path: str) -> None:
        for name in ("vision_encoder", "embed_tokens", "decoder"):
            devices = getattr(self, name)
            require(len(devices) > 0, f"{path}.{name}", "list at least one device", devices)
            for i, device in enumerate(devices):
                choice(device, PLACEMENT_DEVICES, f"{path}.{name}[{i}]")
                require(device not in devices[:i], f"{path}.{name}[{i}]", "not repeat an earlier device", device)


# a frame rate: at least one frame in 1000 s, at most 1000 a second (stream fps, and a source URI's fps=)
MIN_FPS, MAX_FPS = 0.001, 1000.0
MAX_CHANGE_THRESHOLD = 255.0  # a stream's change_threshold: a mean absolute pixel change, on the 0-255 scale
BATCHING_MODES = ("auto", "on", "off")  # server.encoder_batching, server.continuous_batching


@dataclass
class ServerConfig:
    """`edgemm serve`: where it listens, how much it admits, what image URLs it follows."""
    # UNIX socket path; null = /run/edgemm/edgemm.sock where that folder exists (systemd makes it),
    # else $XDG_RUNTIME_DIR/edgemm.sock, and none when TCP is on (tcp_port); unused under
    # socket activation (systemd passes the socket)
    socket: str | None = None
    socket_mode: str = "0660"  # permissions of the socket file, octal: owner and group may connect
    socket_group: str | None = None  # group owning the socket file (clients in it may connect); null = the daemon's group
    tcp_port: int | None = None  # also listen on TCP at this port; null = no TCP (the default: the API stays off the network)
    tcp_host: str = "127.0.0.1"  # TCP address; loopback unless you really mean to expose the API
    queue_size: int = 8  # requests admitted at once (queued or running); more get 503 + Retry-After
    max_batch: int = 4  # up to this many images per encoder call, and requests stepped together by the decoder
    max_decoder_rows: int = 16  # most decoder rows stepped together (a beam search takes num_beams): a TensorRT decoder's profile bound (edgemm engines build --max-beams)
    batch_timeout_ms: float = 5.0  # how long the encoder waits for more images to fill a batch
    encoder_batching: str = "auto"  # auto: batch the encoder only at tiers where one call on max_batch images is timed >= 20 % faster per image than single calls (at start-up); on; off
    continuous_batching: str = "auto"  # requests reaching the decoder while a batch runs: on = join it between tokens; off = wait until it ends; auto = join when the rest of the batch is expected to take longer than their prefills delay it (timed as it runs)
    request_timeout_s: float = 60.0  # a request not answered within this (from admission, once its body is in) gets 504
    body_timeout_s: float = 10.0  # a request body not complete this long after its headers: 408 (read before admission, so a trickled body holds no slot)
    stall_s: float = 120.0  # a pipeline stage that makes no progress on its work this long is unhealthy: no WATCHDOG=1, /readyz and /healthz 503
    retry_after_s: int = 1  # the Retry-After header sent with 503
    grace_period_s: float = 10.0  # on SIGTERM: how long requests in flight may take to finish
    max_body_bytes: int = 16 * 1024 * 1024  # larger request bodies get 413 (base64 images are 4/3 of the file)
    max_connections: int = 64  # open connections at once (SSE stream listeners aside); one more closes the longest idle (or still sending its headers), else the slowest body arriving for 1 s (408), else its request gets 503
    header_timeout_s: float = 10.0  # a request line and headers not complete this long after their first byte: 408, connection closed
    idle_timeout_s: float = 5.0  # a connection without a request in progress (new, or kept alive) is closed after this long
    max_header_bytes: int = 65536  # a request line and headers larger than this: 431, connection closed
    send_timeout_s: float = 30.0  # a client that takes none of what the daemon sends it this long (its buffers full) is cut off: an SSE listener that never reads, a response nobody reads
    image_dirs: list[str] = field(default_factory=list)  # folders that file:// image URLs may name (relative: to this file)
    remote_images: bool = False  # fetch http(s) image URLs; off = refused with 400
    remote_timeout_s: float = 10.0  # time allowed to fetch one http(s) image
    max_streams: int = 4  # camera streams run by the daemon at once (config and POST /v1/streams)
    max_stream_listeners: int = 16  # GET /v1/streams/{id}/events and /v1/events open at once (all streams); more get 503. Not counted in max_connections
    # hosts ('host' = any port, or 'host:port') POST /v1/streams may give webhook URLs for; empty = none
    # may (403). The config file's streams' webhooks may go anywhere
    webhook_hosts: list[str] = field(default_factory=list)
    # hosts ('host' = any port, or 'host:port') POST /v1/streams may give network sources (rtsp://) for;
    # empty = none may (403), so a client cannot have the daemon probe its own ports or the LAN.
    # The config file's streams may name any host
    source_hosts: list[str] = field(default_factory=list)

    def validate(self, path: str) -> None:
        if self.socket is not None:
            require(self.socket.strip() != "", f"{path}.socket", "be a path or null", self.socket)
        require(_octal_mode(self.socket_mode) is not None, f"{path}.socket_mode",
                 "be octal permissions like '0660'", self.socket_mode)
        if self.tcp_port is not None:
            require(0 <= self.tcp_port <= 65535, f"{path}.tcp_port", "be in 0..65535 or null", self.tcp_port)
        for name in ("queue_size", "max_batch", "max_decoder_rows", "max_body_bytes", "max_connections", "retry_after_s",
                     "max_streams", "max_stream_listeners"):
            require(getattr(self, name) >= 1, f"{path}.{name}", "be >= 1", getattr(self, name))
        for name in ("request_timeout_s", "remote_timeout_s", "stall_s", "header_timeout_s", "idle_timeout_s",
                     "body_timeout_s", "send_timeout_s"):
            require(getattr(self, name) > 0, f"{path}.{name}", "be > 0", getattr(self, name))
        for name in ("batch_timeout_ms", "grace_period_s"):
            require(getattr(self, name) >= 0, f"{path}.{name}", "be >= 0", getattr(self, name))
        require(self.max_header_bytes >= 1024, f"{path}.max_header_bytes", "be >= 1024 (a request's line and "
                 "headers need room)", self.max_header_bytes)
        for name in ("webhook_hosts", "source_hosts"):
            for i, entry in enumerate(getattr(self, name)):
                require(webhook_host(entry) is not None, f"{path}.{name}[{i}]",
                         "be a host name or address, or host:port ('[::1]:8080' for IPv6)", entry)
        choice(self.encoder_batching, BATCHING_MODES, f"{path}.encoder_batching")
        choice(self.continuous_batching, BATCHING_MODES, f"{path}.continuous_batching")

    @property
    def mode(self) -> int:
        """socket_mode as a number (validated, so never None here)."""
        return _octal_mode(self.socket_mode) or 0


def _octal_mode(text: str) -> int | None:
    """'0660' → 0o660; None unless it is octal permission bits (YAML would read a bare 0660 as 432)."""
    try:
        mode = int(text, 8)
    except ValueError:
        return None
    return mode if 0 <= mode <= 0o777 else None


STREAM_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_ALERTS = 8  # alerts per stream (edgemm/streams/alerts/ bounds what they may hold in the pipeline)
MAX_ALERT_RUN = 1000  # most consecutive frames an alert's debounce may ask for


@dataclass
class WebhookConfig:
    """Where an alert's state changes are POSTed as JSON (edgemm/streams/alerts/webhook.py), with retries.

    The token, if any, is sent as `Authorization: Bearer`; it is never in this file: name an
    environment variable or an owner-only file, as offload.api_key_env / api_key_file do."""
    url: str = ""  # http:// or https:// URL the events are POSTed to
    token_env: str | None = None  # environment variable holding the bearer token; null = none
    token_file: str | None = None  # or: a file holding it, readable by its owner only (0600/0400); relative: to this file
    timeout_s: float = 5.0  # per attempt, as a whole: connecting, sending and the reply (however slowly it comes)
    retries: int = 3  # further attempts after a timeout, a connection error, 429 or 5xx
    backoff_s: float = 0.5  # wait before retry n: backoff_s * 2**(n-1)

    def validate(self, path: str) -> None:
        require(url_host(self.url) is not None, f"{path}.url",
                 "be an http:// or https:// URL with a host name and no spaces", self.url)
        if self.token_env is not None:
            require(ENV_NAME.fullmatch(self.token_env) is not None, f"{path}.token_env",
                     "be an environment variable name", self.token_env)
        if self.token_file is not None:
            require(self.token_file.strip() != "", f"{path}.token_file", "be a path or null", self.token_file)
            require(self.token_env is None, f"{path}.token_file", "not be given with token_env (one token)",
                     self.token_file)
        # at most a minute: a closed stream's webhook may drain for one timeout_s, and an endpoint
        # that needs longer than that to take an event is down for an alert's purposes
        require(math.isfinite(self.timeout_s) and 0 < self.timeout_s <= 60, f"{path}.timeout_s",
                 "be in (0, 60]", self.timeout_s)
        require(0 <= self.retries <= 10, f"{path}.retries", "be in 0..10", self.retries)
        require(0 <= self.backoff_s <= 60, f"{path}.backoff_s", "be in [0, 60]", self.backoff_s)


@dataclass
class AlertConfig:
    """A named question a stream asks about its frames, read as true / false / unknown.

    The rule: yes/no by default (the answer's first word: yes is true, no is false); `match`:
    true when the answer has these words; `above` / `below`: true when the answer's first
    number (digits or a word, 'two') is above / below them (both: between). Anything the
    rule cannot read is unknown. A plain string is the prompt, with every default."""
    SHORTHAND: ClassVar[str] = "prompt"  # `person: is there a person ?` = {prompt: …}
    prompt: str = ""  # the question asked about the stream's frames
    every: int = 1  # ask on every Nth frame the stream processes
    # on a stream that is behind, the alert is deferred, but asked at least on every max_every-th
    # frame (or every `every`-th, if larger): a floor, so it is never starved (docs/streams.md, "Alerts")
    max_every: int = 30
    on_after: int = 2  # the state becomes true after this many true readings in a row
    off_after: int = 3  # ... false after this many false ones (unknown: after the larger of the two)
    match: str | None = None  # true when the answer has these words (case-insensitive), else false
    above: float | None = None  # true when the answer's number is above this
    below: float | None = None  # true when the answer's number is below this
    max_new_tokens: int = 8  # the answer's length: the rules read its first word or number
    webhook: WebhookConfig | None = None  # this alert's own webhook; null = the stream's, if any

    def validate(self, path: str) -> None:
        try:
            check_text(self.prompt, f"{path}.prompt")
        except LimitError as e:
            raise ConfigError(str(e)) from None
        require(self.prompt.strip() != "", f"{path}.prompt", "be a question", self.prompt)
        for name in ("every", "max_every", "on_after", "off_after"):
            require(1 <= getattr(self, name) <= MAX_ALERT_RUN, f"{path}.{name}", f"be in 1..{MAX_ALERT_RUN}",
                     getattr(self, name))
        if self.match is not None:
            require(self.match.split() != [], f"{path}.match", "be one or more words", self.match)
            require(self.above is None and self.below is None, f"{path}.match",
                     "not be given with above/below (one rule per alert)", self.match)
        if self.above is not None and self.below is not None:
            require(self.above < self.below, f"{path}.below", f"be above 'above' ({self.above:g})", self.below)
        _generation_limits(path, max_new_tokens=self.max_new_tokens)


@dataclass
class StreamConfig:
    """A camera (or any source) the daemon runs by itself; results at /v1/streams/{id}/events."""
    id: str = ""  # the stream's name in the API: letters, digits, '_', '.', '-'
    source: str = ""  # source URI: csi://0, v4l2:///dev/video0, rtsp://…, a file or folder, synthetic://
    prompt: str = "describe the image"  # asked about every processed frame
    fps: float | None = None  # process at most this many frames per second; null = as fast as the pipeline goes
    every: int = 1  # process every Nth frame of the source
    change_threshold: float | None = None  # reuse the last answer when a frame changed less than this (0-255)
    tier: str | None = None  # pin the resolution tier; null = the scheduler picks
    max_new_tokens: int | None = None  # null = generation.max_new_tokens
    alerts: dict[str, AlertConfig] = field(default_factory=dict)  # name → question (edgemm/streams/alerts/)
    webhook: WebhookConfig | None = None  # where the alerts' state changes are POSTed; null = nowhere

    def validate(self, path: str) -> None:
        require(len(self.alerts) <= MAX_ALERTS, f"{path}.alerts", f"have at most {MAX_ALERTS} alerts",
                 len(self.alerts))
        for name in self.alerts:
            require(STREAM_ID.fullmatch(name) is not None, f"{path}.alerts",
                     "have names of letters, digits, '_', '.', '-' (at most 64)", name)
        require(STREAM_ID.fullmatch(self.id) is not None, f"{path}.id",
                 "be a name of letters, digits, '_', '.', '-' (at most 64)", self.id)
        require(self.source.strip() != "", f"{path}.source", "be a source URI", self.source)
        for name in ("source", "prompt"):  # a NUL or a lone surrogate: no path, no prompt the tokenizer takes
            try:
                check_text(getattr(self, name), f"{path}.{name}")
            except LimitError as e:
                raise ConfigError(str(e)) from None
        # bounded as an alert's every: a stream that skips more frames than that asks nothing in practice
        require(1 <= self.every <= MAX_ALERT_RUN, f"{path}.every", f"be in 1..{MAX_ALERT_RUN}", self.every)
        if self.fps is not None:  # bounded: 1e-320 would be an interval of inf between frames
            require(math.isfinite(self.fps) and MIN_FPS <= self.fps <= MAX_FPS, f"{path}.fps",
                     f"be between {MIN_FPS:g} and {MAX_FPS:g} or null", self.fps)
        if self.change_threshold is not None:
            require(0 <= self.change_threshold <= MAX_CHANGE_THRESHOLD,
                     f"{path}.change_threshold", f"be in 0..{MAX_CHANGE_THRESHOLD:g} or null", self.change_threshold)
        _generation_limits(path, nullable=("max_new_tokens",), max_new_tokens=self.max_new_tokens)


@dataclass
class PowerConfig:
    """Jetson telemetry (sysfs) and the placement policy's rules (edgemm/power/telemetry.py, edgemm/power/policy.py)."""
    root: str = "/"  # where sysfs, /var/lib/nvpmodel and /etc live; another folder only for tests and recordings
    sample_period_s: float = 1.0  # telemetry is read in the background this often
    history: int = 60  # samples kept (for energy per request and /v1/status); 60 at 1 s = the last minute
    budget_w: float | None = None  # board power budget in watts (VDD_IN, else the sum of rails); null = none
    throttle_c: float = 85.0  # hottest thermal zone at or above this: prefer the DLA for the encoder
    critical_c: float = 95.0  # hottest zone at or above this: offload if allowed, else keep to the coolest placement
    slo_ms: float | None = None  # latency target per request; null = no latency rule
    hysteresis_c: float = 5.0  # a thermal condition ends only this far below its threshold
    hysteresis_pct: float = 10.0  # budget and SLO conditions end only this many percent below their threshold
    nvpmodel_query: bool = False  # run `nvpmodel -q` when /var/lib/nvpmodel/status is unreadable

    def validate(self, path: str) -> None:
        require(self.root.strip() != "", f"{path}.root", "be a folder", self.root)
        require(self.sample_period_s >= 0.05, f"{path}.sample_period_s", "be >= 0.05", self.sample_period_s)
        require(self.history >= 2, f"{path}.history", "be >= 2", self.history)
        if self.budget_w is not None:
            require(self.budget_w > 0, f"{path}.budget_w", "be > 0 or null", self.budget_w)
        if self.slo_ms is not None:
            require(self.slo_ms > 0, f"{path}.slo_ms", "be > 0 or null", self.slo_ms)
        require(self.critical_c > self.throttle_c, f"{path}.critical_c", f"be above throttle_c ({self.throttle_c})",
                 self.critical_c)
        require(self.hysteresis_c >= 0, f"{path}.hysteresis_c", "be >= 0", self.hysteresis_c)
        require(0 <= self.hysteresis_pct < 100, f"{path}.hysteresis_pct", "be in [0, 100)", self.hysteresis_pct)


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class OffloadConfig:
    """Cloud offload to an OpenAI-compatible chat-completions endpoint (edgemm/power/offload.py).

    Off by default: images leave the device only when the owner turns this on. The API
    key is never in this file: name an environment variable or an owner-only file.
    """
    enabled: bool = False  # send requests to `url` when the policy says cloud
    url: str = ""  # the endpoint's base URL, e.g. https://host/v1 (POST {url}/chat/completions)
    model: str = ""  # model name sent to the endpoint
    api_key_env: str | None = None  # environment variable holding the API key; null = none
    api_key_file: str | None = None  # file holding the API key, readable by its owner only (mode 0600/0400); relative: to this file
    timeout_s: float = 30.0  # per attempt, as a whole: the name lookup, connecting, TLS, sending and the reply
    retries: int = 2  # further attempts after a timeout, a connection error, 429 or 5xx
    backoff_s: float = 0.5  # wait before retry n: backoff_s * 2**(n-1)
    breaker_threshold: int = 3  # consecutive failed requests that open the circuit breaker
    breaker_cooldown_s: float = 30.0  # an open breaker lets one trial request through after this
    allow: list[str] = field(default_factory=lambda: ["critical", "slo"])  # when to offload: critical | slo | hot | budget
    fallback_local: bool = True  # a failed offload is answered locally; false = the error (502, or 504 on timeout)
    max_concurrent: int = 4  # requests to the endpoint at once

    def validate(self, path: str) -> None:
        if self.enabled:
            require(self.url.startswith(("http://", "https://")), f"{path}.url",
                     "be an http:// or https:// URL when offload is enabled", self.url)
            require(self.model.strip() != "", f"{path}.model", "name the endpoint's model when offload is enabled",
                     self.model)
        if self.api_key_env is not None:
            require(ENV_NAME.fullmatch(self.api_key_env) is not None, f"{path}.api_key_env",
                     "be an environment variable name", self.api_key_env)
        if self.api_key_file is not None:
            require(self.api_key_file.strip() != "", f"{path}.api_key_file", "be a path or null", self.api_key_file)
        require(self.timeout_s > 0, f"{path}.timeout_s", "be > 0", self.timeout_s)
        require(0 <= self.retries <= 10, f"{path}.retries", "be in 0..10", self.retries)
        require(self.backoff_s >= 0, f"{path}.backoff_s", "be >= 0", self.backoff_s)
        require(self.breaker_threshold >= 1, f"{path}.breaker_threshold", "be >= 1", self.breaker_threshold)
        require(self.breaker_cooldown_s >= 0, f"{path}.breaker_cooldown_s", "be >= 0", self.breaker_cooldown_s)
        require(self.max_concurrent >= 1, f"{path}.max_concurrent", "be >= 1", self.max_concurrent)
        for i, condition in enumerate(self.allow):
            choice(condition, OFFLOAD_CONDITIONS, f"{path}.allow[{i}]")


@dataclass
class Config:
    # which model folder, at which precision, and its TensorRT engines
    model: ModelConfig = field(default_factory=ModelConfig)
    # how onnxruntime runs what is placed on the CPU, and the warm-up
    backend: BackendConfig = field(default_factory=BackendConfig)
    # what an image or a prompt may cost before it is refused (docs/limits.md)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    # how answers are decoded, unless a request says otherwise
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    streams: list[StreamConfig] = field(default_factory=list)
    power: PowerConfig = field(default_factory=PowerConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def validate(self, path: str) -> None:
        ids = [stream.id for stream in self.streams]
        for i, name in enumerate(ids):
            require(name not in ids[:i], f"streams[{i}].id", "not repeat an earlier stream's id", name)


# ---- public API ----------------------------------------------------------------------

def config_from_dict(data: Mapping[str, Any] | None) -> Config:
    """Check a plain mapping (as parsed from YAML) and turn it into a `Config`."""
    return build(Config, data, "")


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """`Config` → plain nested dict of YAML-safe values; `config_from_dict` reverses it."""
    return dataclasses.asdict(cfg)


def load_config(source: str | os.PathLike | Mapping[str, Any] | None = None) -> Config:
    """Defaults (None), a mapping taken as is, or a YAML file path.

    File problems (missing, unreadable, bad YAML, top level not a mapping) and
    every schema error are raised as `ConfigError` with the file's path in the
    message (and line:column for YAML syntax errors).
    """
    if source is None or isinstance(source, Mapping):
        return config_from_dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_config: expected a path, a mapping or None, got {type(source).__name__}")
    file = os.fspath(source)
    raw = read_regular_file(file, MAX_CONFIG_BYTES, lambda detail: ConfigError(
        "file not found" if detail == "not found" else detail, file), "for a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text (byte {e.start})", file) from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        detail = f"invalid YAML: {problem}" + (f" ({context})" if context else "")
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark is not None else file
        raise ConfigError(" ".join(detail.split()), where) from None
    try:
        cfg = config_from_dict(data)
    except ConfigError as e:
        raise ConfigError(e.detail, file) from None
    # a relative model folder means "next to this config file", not "wherever systemd started us"
    here = Path(file).resolve().parent
    if cfg.model.path is not None and not Path(cfg.model.path).is_absolute():
        cfg.model.path = str(here / cfg.model.path)
    if cfg.model.engines is not None and not Path(cfg.model.engines).is_absolute():
        cfg.model.engines = str(here / cfg.model.engines)
    cfg.server.image_dirs = [str(here / d) for d in cfg.server.image_dirs]  # absolute ones stay as they are
    if cfg.offload.api_key_file is not None:
        cfg.offload.api_key_file = str(here / cfg.offload.api_key_file)
    for stream in cfg.streams:  # webhook token files, likewise
        for hook in [stream.webhook, *(alert.webhook for alert in stream.alerts.values())]:
            if hook is not None and hook.token_file is not None:
                hook.token_file = str(here / hook.token_file)
    return cfg
