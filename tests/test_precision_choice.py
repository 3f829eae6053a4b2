"""`precision: auto` by speed measured on this machine (edgemm.engine.precision_choice,
edgemm.engine.precision_timing, tools/choose_precisions.py): the fastest measured variant per
graph, never a batch-dependent kind where another is measured, today's order without a
measurement. No test here times anything: the clock is a fake, or the timings are injected."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgemm.config import load_config
from edgemm.engine.precision_choice import (Measurement, cache_file, cpu_identity, load_measurement,
                                            precisions_dir, save_measurement)
from edgemm.engine.precision_timing import measure, median_ms
from edgemm.engine.runtime import Runtime
from edgemm.model.manifest import load_manifest

ROOT = Path(__file__).resolve().parent.parent


def cpu_runtime(folder: Path, threads: int = 1) -> Runtime:
    return Runtime(load_config({"model": {"path": str(folder)},
                                "backend": {"intra_op_threads": threads, "warmup": False},
                                "placement": {"vision_encoder": ["cpu"], "embed_tokens": ["cpu"],
                                              "decoder": ["cpu"]}}))


def measured(timings: dict[str, dict[str, float]], threads: int = 1, kinds: dict | None = None) -> Measurement:
    kinds = kinds or {}
    return Measurement(cpu_identity(), threads,
                       {c: {p: {"ms": ms, "kind": kinds.get((c, p), p)} for p, ms in by_p.items()}
                        for c, by_p in timings.items()}, "2026-12-02")


# ---- the choice --------------------------------------------------------------------------------

def test_the_fastest_measured_present_precision_wins_and_says_why():
    m = measured({"vision_encoder": {"fp32": 981.0, "q4": 1069.0}, "decoder": {"fp32": 90.0, "q4": 31.0}})
    precision, why = m.choose("vision_encoder", ["fp32", "q4"])
    assert precision == "fp32"
    assert why == "measured 981 ms against q4 1069 ms (1 thread; tools/choose_precisions.py, 2026-12-02)"
    assert m.choose("decoder", ["fp32", "q4"])[0] == "q4"
    assert m.choose("decoder", ["fp32"])[0] == "fp32"  # a measured variant no longer present is not taken
    assert m.choose("embed_tokens", ["fp32", "q4"]) is None  # not measured: the fixed order decides


def test_the_fixed_order_stays_where_the_fastest_saves_little():
    """q4 first (AUTO_ORDER): an fp32 embedding 0.16 ms faster a call saves nothing a user
    sees, and q4's table is an eighth the size; an fp32 encoder 88 ms faster a call is taken."""
    m = measured({"embed_tokens": {"fp32": 0.109, "q4": 0.266}, "vision_encoder": {"fp32": 981.0, "q4": 1069.0},
                  "decoder": {"fp32": 100.0, "q4": 96.0, "int8": 94.0}})
    precision, why = m.choose("embed_tokens", ["fp32", "q4"], ("q4", "fp32"))
    assert precision == "q4"
    assert why.startswith("measured 0.266 ms against fp32 0.109 ms, fp32 saving no more than 1 ms or 5% a call: "
                          "the order q4 > fp32 kept (")
    assert m.choose("vision_encoder", ["fp32", "q4"], ("q4", "fp32"))[0] == "fp32"
    assert m.choose("decoder", ["fp32", "q4", "int8"], ("q4", "fp32"))[0] == "q4"  # 2 ms but 2 %
    # int8 (6 ms, 6 % faster than fp32) is not among the CPU's order: a measurement changes speed,
    # never accuracy; where a graph has none of the order's precisions, the fastest it has
    assert m.choose("decoder", ["fp32", "int8"], ("q4", "fp32"))[0] == "fp32"
    assert m.choose("decoder", ["int8"], ("q4", "fp32"))[0] == "int8"


def test_a_batch_dependent_kind_is_taken_only_where_nothing_else_is_measured():
    kinds = {("decoder", "quantized"): "dynamic-int8", ("decoder", "int8"): "dynamic-int8"}
    m = measured({"decoder": {"fp32": 90.0, "quantized": 20.0, "int8": 25.0}}, kinds=kinds)
    assert m.choose("decoder", ["fp32", "quantized", "int8"])[0] == "fp32"
    assert m.choose("decoder", ["quantized", "int8"])[0] == "quantized"


def test_a_measurement_of_no_finite_time_is_no_measurement(tmp_model, monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEMM_PRECISIONS", str(tmp_path / "p"))
    manifest = load_manifest(tmp_model)
    save_measurement(manifest, measured({"vision_encoder": {"fp32": float("nan"), "q4": 1069.0}}))
    assert load_measurement(manifest, cpu_identity(), 1) is None


def test_a_user_without_a_home_has_no_measurement_and_auto_still_loads(tmp_model, monkeypatch):
    """A container's uid with no passwd entry and no HOME: Path.home() raises RuntimeError."""
    monkeypatch.delenv("EDGEMM_PRECISIONS")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert load_measurement(load_manifest(tmp_model), cpu_identity(), 1) is None
    assert cpu_runtime(tmp_model).precision == "q4"


# ---- the cache file ----------------------------------------------------------------------------

def test_the_cache_folder_is_the_suites_own_not_the_developers(monkeypatch, tmp_path_factory):
    """conftest points EDGEMM_PRECISIONS at a folder of the session's: a developer's own
    measurement of the built-in model cannot change the suite's expectations."""
    assert precisions_dir().parent == tmp_path_factory.getbasetemp()
    monkeypatch.delenv("EDGEMM_PRECISIONS")
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert precisions_dir() == Path("/somewhere/edgemm/precisions")


def test_a_measurement_is_kept_per_graph_files_device_and_threads(tmp_model, monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEMM_PRECISIONS", str(tmp_path / "p"))
    manifest = load_manifest(tmp_model)
    m = measured({"decoder": {"fp32": 2.0, "q4": 1.0}})
    path = save_measurement(manifest, m)
    assert path.parent == tmp_path / "p" and [p.name for p in path.parent.iterdir()] == [path.name]  # no temp left
    assert load_measurement(manifest, cpu_identity(), 1) == m
    assert load_measurement(manifest, cpu_identity(), 2) is None  # another thread count
    assert load_measurement(manifest, "cpu another (aarch64)", 1) is None  # another CPU
    graph = tmp_model / "decoder_model_merged_q4.onnx"
    os.utime(graph, ns=(graph.stat().st_atime_ns, graph.stat().st_mtime_ns + 10**9))  # a graph rewritten
    assert load_measurement(manifest, cpu_identity(), 1) is None


@pytest.mark.parametrize("content", ["", "{not json", "[]", '{"device": 1}',
                                     '{"device": "x", "threads": 1, "measured_at": "", "timings": {"decoder": {"q4": {}}}}'])
def test_an_unreadable_measurement_counts_as_none(tmp_model, monkeypatch, tmp_path, content):
    monkeypatch.setenv("EDGEMM_PRECISIONS", str(tmp_path / "p"))
    manifest = load_manifest(tmp_model)
    path = cache_file(manifest, cpu_identity(), 1)
    path.parent.mkdir(parents=True)
    path.write_text(content.replace('"x"', json.dumps(cpu_identity())))
    assert load_measurement(manifest, cpu_identity(), 1) is None
    assert cpu_runtime(tmp_model).precision == "q4"  # today's order


# ---- auto reads it -----------------------------------------------------------------------------

def test_auto_takes_each_graphs_measured_fastest(tmp_model, monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEMM_PRECISIONS", str(tmp_path / "p"))
    assert cpu_runtime(tmp_model).precision == "q4"  # no measurement: q4 everywhere, as before
    save_measurement(load_manifest(tmp_model), measured({
        "vision_encoder": {"fp32": 981.0, "q4": 1069.0, "int8": 2000.0},
        "embed_tokens": {"fp32": 0.1, "q4": 0.3},
        "decoder": {"fp32": 90.0, "q4": 31.0, "int8": 120.0}}))
    rt = cpu_runtime(tmp_model)
    assert {c.name: c.precision for c in rt.components.all()} == {
        "vision_encoder": "fp32", "embed_tokens": "q4", "decoder": "q4"}
    assert rt.models.precision_choices["vision_encoder"] == (
        "auto: fp32 on cpu, measured 981 ms against q4 1069 ms (1 thread; tools/choose_precisions.py, 2026-12-02)")
    assert rt.precision == "fp32+q4"
    assert cpu_runtime(tmp_model, threads=2).precision == "q4"  # measured at 1 thread only
    assert rt.infer(tmp_model / "samples" / "scene_11.png", "describe the image", max_new_tokens=3).tokens


# ---- the measurement ---------------------------------------------------------------------------

def scripted_clock(durations_ms: list[float]):
    """A clock whose timed spans (start, end pairs) last `durations_ms` in turn."""
    now, spans = [0.0], itertools.cycle(durations_ms)
    ticks = itertools.count()

    def clock() -> float:
        if next(ticks) % 2:
            now[0] += next(spans) / 1e3
        return now[0]
    return clock


def test_median_ms_times_the_runs_after_an_untimed_first_call():
    calls = []
    assert median_ms(lambda: calls.append(1), 3, scripted_clock([5.0, 1.0, 3.0])) == pytest.approx(3.0)
    assert len(calls) == 4


def test_measure_times_every_graph_in_every_precision_present(tmp_model):
    runs = 3
    manifest = load_manifest(tmp_model)
    order = [(c, p) for c, ps in manifest.graph_precisions().items() for p in ps]
    # each (graph, precision) takes its index + 1 ms, the q4 encoder 0.5 ms: the scripted clock
    # decides which is fastest, not this machine
    spans = [0.5 if cp == ("vision_encoder", "q4") else i + 1.0 for i, cp in enumerate(order) for _ in range(runs)]
    m = measure(tmp_model, 1, runs, clock=scripted_clock(spans))
    assert m.threads == 1 and m.device == cpu_identity()
    assert [(c, p) for c, t in m.timings.items() for p in t] == order
    assert m.timings["vision_encoder"]["q4"]["ms"] == 0.5
    assert m.timings["decoder"]["fp32"]["ms"] == order.index(("decoder", "fp32")) + 1.0
    assert m.timings["vision_encoder"]["int8"]["kind"] == "qdq-int8"
    assert m.choose("vision_encoder", manifest.graph_precisions()["vision_encoder"])[0] == "q4"
    assert m.choose("decoder", manifest.graph_precisions()["decoder"])[0] == "fp32"


def test_the_tool_prints_the_table_keeps_it_and_auto_follows(tmp_model, tmp_path, monkeypatch):
    env = {**os.environ, "EDGEMM_PRECISIONS": str(tmp_path / "p"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "tools/choose_precisions.py", str(tmp_model), "--threads", "1",
                          "--runs", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "| graph | fp32 | int8 | q4 | auto takes |" in out.stdout
    kept = Path(out.stdout.rsplit("kept in ", 1)[1].strip())
    monkeypatch.setenv("EDGEMM_PRECISIONS", str(tmp_path / "p"))
    m = load_measurement(load_manifest(tmp_model), cpu_identity(), 1)
    assert kept == cache_file(load_manifest(tmp_model), cpu_identity(), 1) and m is not None
    assert sorted(m.timings) == ["decoder", "embed_tokens", "vision_encoder"]
    assert all(sorted(t) == ["fp32", "int8", "q4"] and all(v["ms"] > 0 for v in t.values())
               for t in m.timings.values())
    rt = cpu_runtime(tmp_model)
    assert {c.name: c.precision for c in rt.components.all()} == {
        c: m.choose(c, ["fp32", "int8", "q4"], ("q4", "fp32"))[0] for c in m.timings}
    assert all("tools/choose_precisions.py" in why for why in rt.models.precision_choices.values())


def test_the_tool_refuses_a_bad_folder_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "tools/choose_precisions.py", str(tmp_path / "missing")], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1
