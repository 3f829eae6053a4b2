"""edgemm.engine.tiers: saliency statistics, tier policies, the calibrated policy file, and the
scheduler inside Runtime.prepare (pinned tier, reason and statistics in the result)."""
from __future__ import annotations

import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from edgemm.errors import ConfigError, ModelError
from edgemm.engine.tiers import (POLICY_FILE, STATISTICS, SaliencyStats, Scheduler, TierPolicy,
                              analysis_grey, saliency_stats, spectral_residual)

from tools import calibrate_scheduler

TIERS = ["low", "mid", "high"]
H, W = 480, 640


# ---- constructed images -----------------------------------------------------------------------

def flat() -> np.ndarray:
    return np.full((H, W, 3), 128, np.uint8)


def blob() -> np.ndarray:
    """One big smooth object: a salient region, little fine detail."""
    img = flat()
    cv2.circle(img, (320, 240), 80, (200, 30, 30), -1, cv2.LINE_AA)
    return img


def text() -> np.ndarray:
    """A short line of small dark text on a flat background."""
    img = flat()
    cv2.putText(img, "EXIT 42", (260, 250), cv2.FONT_HERSHEY_SIMPLEX, 1.0, (0, 0, 0), 2, cv2.LINE_AA)
    return img


def textured() -> np.ndarray:
    """Fine random texture over the whole frame."""
    rng = np.random.default_rng(0)
    cells = rng.integers(0, 256, (H // 8, W // 8, 1), np.uint8)
    return np.repeat(np.repeat(np.repeat(cells, 8, 0), 8, 1), 3, 2)


@pytest.fixture(scope="module")
def stats() -> dict[str, SaliencyStats]:
    return {name: saliency_stats(make()) for name, make in
            (("flat", flat), ("blob", blob), ("text", text), ("textured", textured))}


def test_a_flat_frame_has_no_saliency_edges_or_detail(stats):
    s = stats["flat"]
    assert (s.mean_saliency, s.salient_fraction, s.high_freq, s.edge_density) == (0, 0, 0, 0)


def test_statistics_are_fractions(stats):
    for s in stats.values():
        assert all(0 <= getattr(s, name) <= 1 for name in STATISTICS)
        assert s.ms > 0


def test_detail_orders_flat_then_text_then_texture(stats):
    for name in ("high_freq", "edge_density", "mean_saliency"):
        values = [getattr(stats[k], name) for k in ("flat", "text", "textured")]
        assert values == sorted(values) and len(set(values)) == 3, (name, values)


def test_text_is_fine_detail_a_big_smooth_object_is_not(stats):
    assert stats["text"].high_freq > 10 * stats["blob"].high_freq


def test_small_text_is_a_small_salient_area_texture_none(stats):
    assert 0 < stats["text"].salient_fraction < 0.05
    assert stats["textured"].salient_fraction < stats["text"].salient_fraction  # nothing stands out
    assert stats["blob"].salient_fraction > stats["text"].salient_fraction  # a big object does


def test_saliency_map_peaks_on_the_object():
    grey = analysis_grey(blob(), 64)
    saliency = spectral_residual(grey)
    assert saliency.max() == pytest.approx(1.0)
    y, x = np.unravel_index(np.argmax(saliency), saliency.shape)
    cy, cx = 240 * grey.shape[0] / H, 320 * grey.shape[1] / W
    radius = 80 * grey.shape[1] / W
    assert np.hypot(y - cy, x - cx) < radius * 1.5


@pytest.mark.parametrize("shape", [(1080, 1920, 3), (256, 256, 3), (37, 500, 3), (1, 1, 3)])
def test_analysis_frame_is_128_wide_with_the_aspect_kept(shape):
    grey = analysis_grey(np.zeros(shape, np.uint8))
    assert grey.dtype == np.uint8 and grey.shape[1] == 128
    assert grey.shape[0] == max(1, round(128 * shape[0] / shape[1]))


def test_grey_frames_are_accepted():
    assert saliency_stats(np.zeros((50, 60), np.uint8)).edge_density == 0


# ---- policy decisions for given statistics ------------------------------------------------------

def given(**values) -> SaliencyStats:
    return SaliencyStats(**{"mean_saliency": 0.0, "salient_fraction": 0.0, "high_freq": 0.0,
                            "edge_density": 0.0, **values})


POLICY = TierPolicy("edge_density", [0.01, 0.02])


@pytest.mark.parametrize("value, tier", [(0.0, "low"), (0.0099, "low"), (0.01, "mid"), (0.015, "mid"),
                                         (0.02, "high"), (0.9, "high")])
def test_thresholds_lift_one_tier_each(value, tier):
    chosen, reason = POLICY.choose(given(edge_density=value), "how many shapes ?", TIERS)
    assert chosen == tier
    assert reason.startswith("thresholds: edge_density")


def test_a_reading_prompt_raises_the_floor_to_the_top():
    chosen, reason = POLICY.choose(given(), "What does the TEXT say?", TIERS)
    assert chosen == "high" and "detail ('text')" in reason


def test_detail_floor_and_words_are_configurable():
    policy = TierPolicy("edge_density", [0.01, 0.02], detail_words=("plate",), detail_floor="mid")
    assert policy.choose(given(), "read the text", TIERS)[0] == "low"
    assert policy.choose(given(), "what is on the plate ?", TIERS)[0] == "mid"
    assert policy.choose(given(edge_density=0.5), "what is on the plate ?", TIERS)[0] == "high"


def test_ordinary_floor():
    policy = TierPolicy("high_freq", [0.2, 0.4], floor="mid")
    chosen, reason = policy.choose(given(high_freq=0.1), "describe", TIERS)
    assert chosen == "mid" and "floor mid" in reason


def test_infinite_threshold_never_lifts():
    policy = TierPolicy("edge_density", [0.01, float("inf")])
    assert policy.choose(given(edge_density=1.0), "count", TIERS)[0] == "mid"


def test_floors_alone_skip_the_statistics():
    policy = TierPolicy("edge_density", [float("inf")] * 2, floor="mid")
    assert not policy.uses_statistics and TierPolicy("edge_density", [0.5, float("inf")]).uses_statistics
    decision = Scheduler(TIERS, "high", policy).decide(textured(), "count the shapes")
    assert (decision.tier, decision.stats) == ("mid", None)
    assert decision.reason == "thresholds: floor mid; no threshold to reach"
    assert Scheduler(TIERS, "high", policy).decide(textured(), "read it").tier == "high"


@pytest.mark.parametrize("kwargs, message", [
    ({"statistic": "sharpness", "thresholds": [0, 1]}, "unknown statistic"),
    ({"statistic": "high_freq", "thresholds": [0.5, 0.1]}, "must not decrease")])
def test_bad_policies_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TierPolicy(**kwargs)


@pytest.mark.parametrize("policy, message", [
    (TierPolicy("high_freq", [0.1]), "1 thresholds for 3 tiers"),
    (TierPolicy("high_freq", [0.1, 0.2], floor="huge"), "'huge' is not one of")])
def test_policy_must_fit_the_models_tiers(policy, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(TIERS, "high", policy)


def test_pinned_tier_bypasses_the_policy_and_top_needs_no_statistics():
    scheduler = Scheduler(TIERS, "high", TierPolicy("edge_density", [0.0, 0.0]))
    pinned = scheduler.decide(textured(), "count", pinned="low")
    assert (pinned.tier, pinned.reason, pinned.stats) == ("low", "pinned", None)
    top = Scheduler(TIERS, "high").decide(textured(), "count")
    assert top.tier == "high" and top.stats is None and "top" in top.reason
    chosen = scheduler.decide(flat(), "count")
    assert chosen.tier == "high" and chosen.stats is not None
    assert chosen.to_dict()["stats"]["edge_density"] == 0


# ---- the calibrated policy file ----------------------------------------------------------------

def test_policy_file_round_trips(tmp_path):
    policy = TierPolicy("salient_fraction", [0.03, float("inf")], ("read", "text"), "high", "mid")
    path = tmp_path / POLICY_FILE
    policy.save(path, comment="fitted\nby a test", extra={"calibration": {"accuracy": 99.0}})
    assert path.read_text().startswith("# fitted\n# by a test\n")
    loaded = TierPolicy.load(path)
    assert (loaded.statistic, loaded.thresholds, loaded.detail_words, loaded.detail_floor, loaded.floor) == \
           (policy.statistic, policy.thresholds, policy.detail_words, policy.detail_floor, policy.floor)
    assert loaded.source == f"calibrated ({POLICY_FILE})"


def test_missing_or_broken_policy_file_says_how_to_make_it(tmp_path):
    with pytest.raises(ModelError, match="tools/calibrate_scheduler.py"):
        TierPolicy.load(tmp_path / POLICY_FILE)
    (tmp_path / POLICY_FILE).write_text("statistic: edge_density\n")
    with pytest.raises(ModelError, match="not a valid scheduler policy"):
        TierPolicy.load(tmp_path / POLICY_FILE)


def synthetic_table(n_scenes: int = 60) -> calibrate_scheduler.Table:
    """Other questions fail at the cheapest tier when the scene's edge density is above
    0.5 (mid is enough). Half the scenes carry text (fine_strokes 0.01, else 0): reading
    it is right only at the top tier; "no text" is right at every tier."""
    rng = np.random.default_rng(0)
    density = rng.uniform(0, 1, n_scenes)
    text = np.arange(n_scenes) % 2 == 0
    stats = [given(edge_density=float(d), high_freq=float(rng.uniform()), fine_strokes=0.01 if t else 0.0)
             for d, t in zip(density, text)]
    scene, prompts, tasks, correct = [], [], [], []
    for i, d in enumerate(density):
        for prompt, task in (("read the text", "read"), ("how many shapes ?", "count")):
            scene.append(i)
            prompts.append(prompt)
            tasks.append(task)
            if task == "read":
                correct.append([False, False, True] if text[i] else [True, True, True])
            else:
                correct.append([d <= 0.5, True, True])
    n = len(prompts)
    return calibrate_scheduler.Table(TIERS, stats, np.tile([1.0, 2.0, 4.0], (n_scenes, 1)),
                                     np.array(scene), prompts, tasks, np.array(correct), np.ones((n, 3)))


def test_calibration_fits_the_cheapest_policy_that_keeps_accuracy(tmp_path):
    table = synthetic_table()
    policy, summary = calibrate_scheduler.fit(table, tolerance=0.0)
    assert summary["accuracy"] == summary["accuracy_top"] == 100.0
    assert (policy.statistic, policy.floor) == ("edge_density", "low")
    assert 0.4 < policy.thresholds[0] <= min(s.edge_density for s in table.stats if s.edge_density > 0.5)
    # reading prompts get their own rule: top tier only where there are fine strokes
    assert (policy.detail_statistic, policy.detail_floor) == ("fine_strokes", "low")
    assert 0 < policy.detail_thresholds[-1] <= 0.01
    assert summary["saving"] > 0.4  # half the reading and most counting leave the 4 ms tier
    # the written file, loaded back, makes the same decisions as the fitted policy
    policy.save(tmp_path / POLICY_FILE, extra={"calibration": summary})
    loaded = Scheduler(TIERS, "high", TierPolicy.load(tmp_path / POLICY_FILE)).policy
    assert loaded.detail_thresholds == policy.detail_thresholds
    for i, prompt in zip(table.scene, table.prompts):
        assert loaded.choose(table.stats[i], prompt, TIERS)[0] == policy.choose(table.stats[i], prompt, TIERS)[0]


def test_calibration_keeps_the_tolerance_in_points():
    table = synthetic_table()
    policy, summary = calibrate_scheduler.fit(table, tolerance=30.0)
    assert summary["accuracy"] >= summary["accuracy_top"] - 30.0
    strict, strict_summary = calibrate_scheduler.fit(table, tolerance=0.0)
    assert summary["ms_per_request"] < strict_summary["ms_per_request"]  # a looser bound buys a cheaper policy


def test_calibration_tool_writes_a_policy_the_runtime_loads(tmp_model, make_runtime, monkeypatch, sample):
    out = tmp_model / POLICY_FILE
    out.unlink(missing_ok=True)
    monkeypatch.setattr(sys, "argv", ["calibrate_scheduler.py", str(tmp_model), "--n", "3", "--threads", "1"])
    calibrate_scheduler.main()
    text = out.read_text()
    assert text.startswith("# edgemm scheduler policy for tiny-vlm") and "calibration:" in text
    policy = TierPolicy.load(out)
    rt = make_runtime(model={"path": str(tmp_model)}, scheduler={"policy": "calibrated"})
    assert rt.scheduler.policy.thresholds == policy.thresholds
    result = rt.infer(sample, "how many shapes are there ?")
    assert result.schedule["reason"].startswith("calibrated (scheduler.yaml)")


def test_mixed_questions_ask_everything_in_several_phrasings():
    from edgemm.model.scenes import make_scene
    asked = [q for seed in range(40) for q in
             calibrate_scheduler.mixed_questions(make_scene(seed), np.random.default_rng(seed))]
    assert {q.task for q in asked} == {"describe", "count", "colour", "read"}
    assert any(q.task == "read" and q.answer == "no text" for q in asked)
    assert len({q.prompt for q in asked if q.task == "read"}) > 1
    assert all("{" not in q.prompt for q in asked)


def test_vectorised_levels_match_policy_choose():
    table = synthetic_table()
    detail = calibrate_scheduler.detail_requests(table)
    for thresholds, floor, detail_floor in (([0.3, 0.7], 0, 2), ([0.0, 0.9], 1, 0), ([0.5, np.inf], 0, 1)):
        policy = TierPolicy("edge_density", thresholds, detail_floor=TIERS[detail_floor], floor=TIERS[floor])
        values = table.stat("edge_density")
        fast = np.where(detail, calibrate_scheduler.levels(values, thresholds, detail_floor),
                        calibrate_scheduler.levels(values, thresholds, floor))
        slow = [TIERS.index(policy.choose(table.stats[i], p, TIERS)[0])
                for i, p in zip(table.scene, table.prompts)]
        assert list(fast) == slow


# ---- inside the runtime ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sample(model_dir) -> Path:
    return model_dir / "samples" / "scene_12.png"


def test_default_policy_is_calibrated_when_the_model_ships_a_calibration(runtime, sample, model_dir):
    assert (model_dir / POLICY_FILE).is_file()
    result = runtime.infer(sample, "how many shapes are there ?")
    assert result.schedule["policy"] == "calibrated"
    assert result.schedule["policy_reason"] == "scheduler.policy auto: model tiny-vlm ships its calibration (scheduler.yaml)"
    assert result.schedule["reason"].startswith("calibrated (scheduler.yaml)")
    calibrated = TierPolicy.load(model_dir / POLICY_FILE)
    assert result.tier == calibrated.choose(None, "how many shapes are there ?", list(runtime.manifest.tiers))[0]


def test_default_policy_is_the_top_tier_without_a_calibration(make_runtime, tmp_model, sample):
    (tmp_model / POLICY_FILE).unlink()
    rt = make_runtime(model={"path": str(tmp_model)})
    result = rt.infer(sample, "how many shapes are there ?")
    assert result.tier == "high" and result.schedule["stats"] is None
    assert result.schedule["policy"] == "top" and "ships no calibration" in result.schedule["policy_reason"]
    assert "schedule" not in result.timings_ms


@pytest.mark.parametrize("thresholds, tier", [([0.0, 0.0], "high"), ([0.0, 1.1], "mid"), ([1.1, 1.1], "low")])
def test_thresholds_policy_picks_the_tier_and_says_why(make_runtime, sample, thresholds, tier):
    rt = make_runtime(scheduler={"policy": "thresholds", "thresholds": thresholds})
    result = rt.infer(sample, "how many shapes are there ?")
    assert result.tier == result.schedule["tier"] == tier
    assert result.image_tokens == rt.manifest.tiers[tier].image_tokens
    assert result.schedule["reason"].startswith("thresholds: edge_density")
    assert set(result.schedule["stats"]) == {*STATISTICS, "ms"}
    assert result.timings_ms["schedule"] > 0
    reading = rt.infer(sample, "what does the text say ?")
    assert reading.tier == "high" and "detail" in reading.schedule["reason"]
    pinned = rt.infer(sample, "what does the text say ?", tier="low")
    assert pinned.tier == "low" and pinned.schedule == {"tier": "low", "reason": "pinned", "stats": None,
                                                        "policy": "thresholds",
                                                        "policy_reason": "scheduler.policy: thresholds"}


def test_configured_tier_is_a_pin_too(make_runtime, sample):
    rt = make_runtime(scheduler={"policy": "thresholds", "thresholds": [0.0, 0.0]}, generation={"tier": "low"})
    assert rt.infer(sample, "how many shapes are there ?").tier == "low"


def test_thresholds_that_dont_fit_the_model_are_a_config_error(make_runtime):
    with pytest.raises(ConfigError, match="scheduler: 3 thresholds for 3 tiers"):
        make_runtime(scheduler={"policy": "thresholds", "thresholds": [0.1, 0.2, 0.3]})


def test_calibrated_policy_is_read_from_the_model_folder(make_runtime, tmp_model, sample):
    (tmp_model / POLICY_FILE).unlink(missing_ok=True)  # the shipped model may carry one
    with pytest.raises(ModelError, match="calibrate_scheduler"):
        make_runtime(model={"path": str(tmp_model)}, scheduler={"policy": "calibrated"})
    TierPolicy("edge_density", [1.1, 1.1], floor="mid").save(tmp_model / POLICY_FILE)
    rt = make_runtime(model={"path": str(tmp_model)}, scheduler={"policy": "calibrated"})
    result = rt.infer(sample, "how many shapes are there ?")
    assert result.tier == "mid" and result.schedule["reason"].startswith("calibrated (scheduler.yaml)")


def test_systemd_config_documents_the_defaults():
    from edgemm.config import CacheConfig, GenerationConfig, SchedulerConfig, load_config
    documented = load_config(Path(__file__).resolve().parent.parent / "systemd" / "edgemm.yaml")
    assert documented.scheduler == SchedulerConfig()
    assert documented.cache == CacheConfig()
    assert documented.generation == GenerationConfig()


# ---- fine strokes and the detail prompts' own rule ------------------------------------------

def test_fine_strokes_see_a_small_label_that_edges_barely_notice():
    from edgemm.model.scenes import make_scene
    plain = make_scene(11, text_probability=0.0).image
    labelled = plain.copy()
    cv2.putText(labelled, "408", (20, 40), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (20, 20, 20), 1, cv2.LINE_AA)
    before, after = saliency_stats(plain), saliency_stats(labelled)
    assert after.fine_strokes > 3 * max(before.fine_strokes, 1e-4)
    assert after.edge_density < 2 * before.edge_density  # the label is a small share of the edges


def test_detail_prompts_follow_their_own_rule():
    policy = TierPolicy("edge_density", [np.inf, np.inf], floor="mid", detail_floor="low",
                        detail_statistic="fine_strokes", detail_thresholds=[0.001, 0.001])
    assert policy.choose(given(fine_strokes=0.0, edge_density=1.0), "read the text", TIERS)[0] == "low"
    tier, reason = policy.choose(given(fine_strokes=0.01), "read the text", TIERS)
    assert tier == "high" and "fine_strokes 0.01 >= 0.001" in reason
    assert policy.choose(given(fine_strokes=0.01), "how many shapes ?", TIERS)[0] == "mid"
    assert policy.needs_statistics("read the text") and not policy.needs_statistics("how many shapes ?")
    scheduler = Scheduler(TIERS, "high", policy)
    frame = np.full((64, 64, 3), 128, np.uint8)
    assert scheduler.decide(frame, "how many shapes ?").stats is None  # the frame is not analysed for it
    assert scheduler.decide(frame, "read the text").stats is not None


def test_detail_thresholds_are_checked_like_the_others():
    with pytest.raises(ValueError, match="must not decrease"):
        TierPolicy("edge_density", [0.1, 0.2], detail_thresholds=[0.5, 0.1])
    with pytest.raises(ValueError, match="unknown statistic"):
        TierPolicy("edge_density", [0.1, 0.2], detail_statistic="ink", detail_thresholds=[0.1, 0.2])
    with pytest.raises(ValueError, match="1 thresholds for 3 tiers"):
        TierPolicy("edge_density", [0.1, 0.2], detail_thresholds=[0.1]).check_tiers(TIERS)
