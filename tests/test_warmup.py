"""Warm-up: a one-shot `infer` runs only its answer; `serve` and `stream` warm what
backend.warmup names (all, none, a list of tiers), largest first, and print what it cost."""
from __future__ import annotations

import json
import logging
import re
import shutil
import signal
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgemm.backends.onnxruntime import OnnxRuntimeBackend, OrtComponent
from edgemm.cli.main import main
from edgemm.config import load_config
from edgemm.errors import ConfigError
from edgemm.server.daemon import Daemon
from edgemm.model.manifest import load_manifest
from edgemm.engine.runtime import Runtime

from conftest import MODEL_DIR
from test_server import short_dir


@pytest.fixture
def runs(monkeypatch) -> list[tuple[str, tuple, bool]]:
    """Every onnxruntime run, in order: (component, the shape of its first input, whether it
    was asked to hand back the arena's free memory)."""
    seen: list[tuple[str, tuple, bool]] = []
    run = OrtComponent.run

    def recording(self, feeds):
        seen.append((self.name, next(iter(feeds.values())).shape, self.shrink_next))
        return run(self, feeds)
    monkeypatch.setattr(OrtComponent, "run", recording)
    return seen


def encoder_sizes(runs, checked: bool = True) -> list[tuple[int, int]]:
    """The encoder's image sizes after the load check's, asserted: a blank image per tier first
    (check_image_tokens: the built-in encoder's token count is not fixed in its graph), and
    none for a one-shot infer (`checked=False`)."""
    sizes = [shape[-2:] for name, shape, _ in runs if name == "vision_encoder"]
    checked_sizes = [(t.height, t.width) for t in load_manifest(MODEL_DIR).tiers.values()] if checked else []
    assert sizes[:len(checked_sizes)] == checked_sizes, sizes
    return sizes[len(checked_sizes):]


@pytest.fixture(scope="module")
def tiers(model_dir) -> dict[str, tuple[int, int]]:
    return {name: (t.height, t.width) for name, t in load_manifest(model_dir).tiers.items()}


@pytest.fixture(scope="module")
def sample(model_dir) -> Path:
    return model_dir / "samples" / "scene_12.png"


def write_config(tmp_path: Path, warmup) -> Path:
    path = tmp_path / "edgemm.yaml"
    path.write_text(json.dumps({"backend": {"intra_op_threads": 1, "warmup": warmup}}))  # JSON is YAML
    return path


# ---- edgemm infer: the answer is the warm-up ----------------------------------------------------

@pytest.mark.parametrize("warmup", ["all", ["low", "mid", "high"], True])
def test_a_one_shot_infer_runs_the_graphs_for_its_answer_only(sample, runs, tiers, tmp_path, warmup):
    result = CliRunner().invoke(main, ["infer", str(sample), "--tier", "mid", "--max-new-tokens", "3", "--json",
                                       "--config", str(write_config(tmp_path, warmup))])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert encoder_sizes(runs, checked=False) == [tiers["mid"]]  # one encoder call: the answer's
    decoder_calls = sum(name == "decoder" for name, _, _ in runs)
    assert decoder_calls == 1 + out["decoder_steps"] and out["decoder_steps"] >= 1  # its prefill and steps
    assert "warming" not in result.stderr


# ---- the knob: what a Runtime made from the config warms ------------------------------------

@pytest.mark.parametrize("warmup, warmed", [
    ("all", ["high", "mid", "low"]), (True, ["high", "mid", "low"]), ("none", []), (False, []),
    (["mid"], ["mid"]), (["low", "high"], ["high", "low"]),  # largest first, whatever the order given
])
def test_a_runtime_warms_the_tiers_backend_warmup_names_largest_first(model_dir, runs, tiers, warmup, warmed):
    runtime = Runtime(load_config({"model": {"path": str(model_dir)},
                                   "backend": {"intra_op_threads": 1, "warmup": warmup}}))
    assert encoder_sizes(runs) == [tiers[name] for name in warmed]
    assert runtime.warmup_tiers == (list(tiers) if warmup in ("all", True) else [] if warmup in ("none", False)
                                    else warmup)


def test_the_arenas_hand_back_the_largest_tiers_memory_at_the_next_run(make_runtime, runs):
    runtime = make_runtime()
    runs.clear()  # the load check's encoder runs
    runtime.warmup(["low", "mid", "high"])
    for component in ("vision_encoder", "decoder"):
        shrinks = [shrink for name, _, shrink in runs if name == component]
        assert shrinks == [False, True, False], (component, shrinks)  # high, then mid shrinks, low
    runs.clear()
    runtime.warmup(["low"])  # one tier: nothing larger to hand back
    assert not any(shrink for _, _, shrink in runs)


def test_a_tier_the_model_lacks_is_a_config_error_before_any_graph_loads(model_dir, monkeypatch):
    loaded: list[str] = []
    load = OnnxRuntimeBackend.load
    monkeypatch.setattr(OnnxRuntimeBackend, "load", lambda self, name, *a: loaded.append(name) or load(self, name, *a))
    with pytest.raises(ConfigError) as info:
        Runtime(load_config({"model": {"path": str(model_dir)}, "backend": {"warmup": ["low", "huge"]}}))
    assert str(info.value) == ("config: 'backend.warmup[1]' is 'huge', a tier tiny-vlm does not have "
                               "(its tiers: low, mid, high)")
    assert loaded == []


def test_the_report_names_each_tier_and_the_total(make_runtime):
    lines: list[str] = []
    seconds = make_runtime().warmup(["low", "high"], report=lines.append)
    assert lines[0] == "warming 2 tiers (high, low), largest first …"
    assert re.fullmatch(r"warmed high \(256×256, 64 image tokens\) in \d+\.\d s", lines[1]), lines
    assert re.fullmatch(r"warmed low \(96×96, 9 image tokens\) in \d+\.\d s", lines[2]), lines
    assert lines[3] == f"warming 2 tiers … {seconds:.1f} s" and len(lines) == 4
    assert make_runtime().warmup([], report=lines.append) == 0.0 and len(lines) == 4  # nothing to say


# ---- serve and stream: every tier they may use, the cost on stderr --------------------------

@pytest.mark.parametrize("warmup, warmed", [("all", ["high", "mid", "low"]), ("none", []), (["low", "mid"], ["mid", "low"])])
def test_serve_warms_what_backend_warmup_says_and_logs_its_cost(model_dir, runs, tiers, warmup, warmed):
    folder = short_dir()
    cfg = load_config({"model": {"path": str(model_dir)}, "backend": {"intra_op_threads": 1, "warmup": warmup},
                       "server": {"socket": str(folder / "edgemm.sock"), "encoder_batching": "off"}})
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("edgemm")
    level = log.level
    log.setLevel(logging.INFO)  # setLevel, not .level =: it also clears the logger's isEnabledFor cache
    log.addHandler(handler)
    daemon = Daemon(cfg)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        assert daemon.ready.wait(60), "the daemon did not become ready"
        assert encoder_sizes(runs) == [tiers[name] for name in warmed]  # before READY=1, not after
    finally:
        daemon.stop()
        thread.join(30)
        log.removeHandler(handler)
        log.setLevel(level)
        shutil.rmtree(folder, ignore_errors=True)
    warming = [line for line in lines if line.startswith("warm")]
    if warmed:
        assert warming[0] == f"warming {len(warmed)} tiers ({', '.join(warmed)}), largest first …"
        assert [line.split()[1] for line in warming[1:-1]] == warmed  # a line per tier, as it ends
        assert re.fullmatch(rf"warming {len(warmed)} tiers … \d+\.\d s", warming[-1]), warming
    else:
        assert warming == []


@pytest.fixture
def stream_cli(tmp_path):
    """`edgemm stream …` in-process; restores the signal handlers the command installs."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def invoke(warmup, *args: str):
        return CliRunner().invoke(main, ["stream", "synthetic://?count=2", "--max-frames", "1", "--max-new-tokens",
                                         "1", "--config", str(write_config(tmp_path, warmup)), *args])
    yield invoke
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_stream_with_a_pinned_tier_warms_that_tier_alone_and_says_so(stream_cli, runs, tiers):
    result = stream_cli("all", "--tier", "low")
    assert result.exit_code == 0, result.output
    assert encoder_sizes(runs) == [tiers["low"]] * 2  # the warm-up, then the one frame
    lines = [line for line in result.stderr.splitlines() if "warm" in line]
    assert lines[0] == "edgemm: warming 1 tier (low), largest first …"
    assert re.fullmatch(r"edgemm: warmed low \(96×96, 9 image tokens\) in \d+\.\d s", lines[1]), lines
    assert re.fullmatch(r"edgemm: warming 1 tier … \d+\.\d s", lines[2]) and len(lines) == 3


def test_stream_warms_the_configured_tiers_and_none_when_told(stream_cli, runs, tiers):
    assert stream_cli(["mid", "high"]).exit_code == 0
    assert encoder_sizes(runs)[:2] == [tiers["high"], tiers["mid"]] and len(encoder_sizes(runs)) == 3
    runs.clear()
    result = stream_cli("none", "--tier", "low")
    assert result.exit_code == 0 and "warm" not in result.stderr
    assert encoder_sizes(runs) == [tiers["low"]]  # the frame alone


def test_stream_with_a_tier_the_model_lacks_is_exit_2_in_one_line(stream_cli):
    result = stream_cli("all", "--tier", "huge")
    assert result.exit_code == 2
    assert result.stderr.strip() == "edgemm: error: unknown tier 'huge' for model tiny-vlm (tiers: low, mid, high)"
