"""Scheduler: look at a frame cheaply, then pick the resolution tier to encode it at.

The vision encoder dominates the cost of a request and its cost grows with the
number of pixels, so a frame that doesn't need the top tier shouldn't pay for it.

    frame ─► grey, 128 px wide ─► statistics ─► policy ─► tier (+ reason)
                 └─► 64 px ─► spectral-residual saliency map

Saliency is Hou & Zhang's spectral residual (CVPR 2007): the log-amplitude
spectrum minus its local average is what is "unexpected" in the frame; back in
the image domain it lights up the regions that stand out. It is a few FFTs on a
64 px frame, so the whole analysis costs well under a millisecond; the expensive
part is shrinking a 1080p frame, done by striding first (the top tier sees
~256 px anyway, so detail finer than the stride is never encoded).

Policies (`scheduler.policy` in the config):
  auto         calibrated when the model folder ships its calibration (scheduler.yaml),
               else top (the default)
  top          always the model's default tier, its top one unless model.yaml says otherwise
               (edgemm's behaviour before the scheduler)
  thresholds   a statistic against rising thresholds from the config: each one reached
               lifts the frame one tier above the cheapest
  calibrated   the same rule with values fitted by tools/calibrate_scheduler.py and
               stored next to the model (scheduler.yaml)
Prompts that ask for fine detail (by default: reading text) have a floor tier, and
a tier pinned by the caller bypasses the policy altogether.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml

from edgemm.errors import ModelError
from edgemm.util.files import load_yaml, read_model_file
from edgemm.config import DETAIL_WORDS, STATISTICS

POLICY_FILE = "scheduler.yaml"  # in the model folder, written by tools/calibrate_scheduler.py
SALIENCY_WIDTH = 64  # the frame size spectral residual was designed for
ANALYSIS_WIDTH = 128  # edges and spectrum: enough to see digits a few pixels tall at the top tier
EDGE_LOW, EDGE_HIGH = 40, 100  # Canny hysteresis in grey levels: above sensor noise, below object edges
STROKE_CONTRAST = 30  # grey levels a stroke stands out from its 3x3 surroundings (top-hat / black-hat)


def opencv():
    """cv2, imported when a frame is first measured, not with this module: the config
    (edgemm.config names the statistics and detail words this module computes) loads without OpenCV, so
    `edgemm doctor` can report a missing cv2 as one check among the others. Whatever
    measures frames (the runtime) imports edgemm.util.opencv itself first."""
    from edgemm.util.opencv import cv2
    return cv2


@lru_cache(maxsize=1)
def _stroke() -> np.ndarray:
    cv2 = opencv()
    return cv2.getStructuringElement(cv2.MORPH_RECT, (3, 3))


# ---- statistics ---------------------------------------------------------------------------

@dataclass(frozen=True)
class SaliencyStats:
    """Cheap predictors of how much detail a frame holds; all in [0, 1]."""
    mean_saliency: float  # mean of the saliency map scaled to max 1: high = clutter, low = few things stand out
    salient_fraction: float  # area above 3x the mean saliency (Hou & Zhang's object threshold)
    high_freq: float  # share of the spectrum's (non-DC) power in the upper half of frequencies
    edge_density: float  # share of pixels on a strong edge (Canny)
    fine_strokes: float = 0.0  # share of pixels on thin strokes, dark or light (text, fine print)
    ms: float = 0.0  # what computing these cost

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 5) for k, v in asdict(self).items()}


def analysis_grey(rgb: np.ndarray, width: int = ANALYSIS_WIDTH) -> np.ndarray:
    """RGB8 (H, W, 3) → grey uint8 `width` wide, same aspect. Strides before averaging."""
    cv2 = opencv()
    h, w = rgb.shape[:2]
    stride = max(1, w // (2 * width))  # keep ≥ 2 source pixels per output pixel for the area filter
    small = np.ascontiguousarray(rgb[::stride, ::stride])
    grey = cv2.cvtColor(small, cv2.COLOR_RGB2GRAY) if small.ndim == 3 else small
    height = max(1, round(width * h / w))
    if grey.shape[1] == width and grey.shape[0] == height:
        return grey
    interp = cv2.INTER_AREA if grey.shape[1] > width else cv2.INTER_LINEAR
    return cv2.resize(grey, (width, height), interpolation=interp)


def spectral_residual(grey: np.ndarray) -> np.ndarray:
    """Saliency map (float32, max 1; all zeros for a flat frame) of a small grey frame."""
    cv2 = opencv()
    f = grey.astype(np.float32)
    if float(f.std()) < 1e-3:
        return np.zeros_like(f)
    spectrum = cv2.dft(f, flags=cv2.DFT_COMPLEX_OUTPUT)
    amplitude = cv2.magnitude(spectrum[..., 0], spectrum[..., 1]) + 1e-6
    log_amplitude = np.log(amplitude)
    residual = log_amplitude - cv2.blur(log_amplitude, (3, 3))
    # keep the phase, replace the amplitude by exp(residual): scale each complex bin
    spectrum *= (np.exp(residual) / amplitude)[..., None]
    back = cv2.idft(spectrum, flags=cv2.DFT_SCALE)
    saliency = cv2.magnitude(back[..., 0], back[..., 1]) ** 2
    saliency = cv2.GaussianBlur(saliency, (0, 0), sigmaX=max(1.0, grey.shape[1] / 24))
    peak = float(saliency.max())
    return saliency / peak if peak > 0 else saliency


def high_frequency_share(grey: np.ndarray) -> float:
    """Share of the non-DC spectral power above half the Nyquist frequency (radially)."""
    cv2 = opencv()
    f = grey.astype(np.float32)
    f -= f.mean()
    spectrum = cv2.dft(f, flags=cv2.DFT_COMPLEX_OUTPUT)
    power = spectrum[..., 0] ** 2 + spectrum[..., 1] ** 2
    total = float(power.sum())
    if total <= 0:
        return 0.0
    return float(power[_high_band(*grey.shape)].sum()) / total


def fine_stroke_share(grey: np.ndarray) -> float:
    """Share of pixels on strokes thinner than the 3x3 window, darker or lighter than
    their surroundings by STROKE_CONTRAST: the marks of text and fine print. Object
    outlines and flat regions hardly respond; on generated scenes it tells a frame
    with a label from one without almost perfectly, where edge density cannot."""
    cv2 = opencv()
    dark = cv2.morphologyEx(grey, cv2.MORPH_BLACKHAT, _stroke())
    light = cv2.morphologyEx(grey, cv2.MORPH_TOPHAT, _stroke())
    return float(np.count_nonzero(np.maximum(dark, light) > STROKE_CONTRAST)) / grey.size


@lru_cache(maxsize=16)
def _high_band(height: int, width: int) -> np.ndarray:
    """DFT bins whose radial frequency is above half Nyquist (cycles per pixel > 0.25)."""
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.fftfreq(width)[None, :]
    return (fx * fx + fy * fy) > 0.25 * 0.25


def saliency_stats(rgb: np.ndarray) -> SaliencyStats:
    """The statistics of an RGB8 frame of any size."""
    cv2 = opencv()
    t0 = time.perf_counter()
    grey = analysis_grey(rgb)
    small = cv2.resize(grey, (SALIENCY_WIDTH, max(1, round(SALIENCY_WIDTH * grey.shape[0] / grey.shape[1]))),
                       interpolation=cv2.INTER_AREA)
    saliency = spectral_residual(small)
    mean = float(saliency.mean())
    salient = float((saliency > 3 * mean).mean()) if mean > 0 else 0.0
    edges = cv2.Canny(cv2.GaussianBlur(grey, (3, 3), 0), EDGE_LOW, EDGE_HIGH)
    return SaliencyStats(mean_saliency=mean, salient_fraction=salient,
                         high_freq=high_frequency_share(grey),
                         edge_density=float(np.count_nonzero(edges)) / edges.size,
                         fine_strokes=fine_stroke_share(grey), ms=(time.perf_counter() - t0) * 1e3)


# ---- policy -------------------------------------------------------------------------------


def lifts(thresholds: list[float]) -> bool:
    """Whether any threshold can be reached (`.inf` never lifts)."""
    return any(math.isfinite(t) for t in thresholds)


def prompt_words(prompt: str) -> set[str]:
    return set(re.findall(r"[a-z0-9']+", prompt.lower()))


@dataclass
class TierPolicy:
    """Statistic + rising thresholds → tier, with floors for ordinary and detail prompts.

    thresholds[i] is the value of `statistic` at which a frame needs at least tier
    i+1 (tiers counted from the cheapest), so there is one threshold per tier above
    the cheapest; `.inf` never lifts. A prompt containing one of `detail_words`
    never goes below `detail_floor`; any other never below `floor` (None = cheapest).
    Detail prompts may have a rule of their own (`detail_statistic`, `detail_thresholds`):
    e.g. a reading prompt stays cheap on a frame without fine strokes and goes to the top
    tier on one with them. Without it they share `statistic` and `thresholds`.
    """
    statistic: str
    thresholds: list[float]
    detail_words: tuple[str, ...] = DETAIL_WORDS
    detail_floor: str | None = None  # None = the model's top tier
    floor: str | None = None
    source: str = "thresholds"  # where the values come from, shown in every decision's reason
    detail_statistic: str | None = None  # None: detail prompts use `statistic` ...
    detail_thresholds: list[float] | None = None  # ... and `thresholds`

    def __post_init__(self) -> None:
        for statistic, thresholds in ((self.statistic, self.thresholds),
                                      (self.detail_statistic or self.statistic, self.detail_thresholds or [])):
            if statistic not in STATISTICS:
                raise ValueError(f"unknown statistic {statistic!r} (known: {', '.join(STATISTICS)})")
            if any(b < a for a, b in zip(thresholds, thresholds[1:])):
                raise ValueError(f"thresholds must not decrease: {thresholds}")
        self.detail_words = tuple(w.lower() for w in self.detail_words)

    def rule(self, detail: bool) -> tuple[str, list[float]]:
        """(statistic, thresholds) for ordinary or detail prompts."""
        if detail and self.detail_thresholds is not None:
            return self.detail_statistic or self.statistic, self.detail_thresholds
        return self.statistic, self.thresholds

    def check_tiers(self, tiers: list[str]) -> None:
        """Refuse a policy that doesn't fit this model's tiers, naming what is wrong."""
        for thresholds in (self.thresholds, self.detail_thresholds):
            if thresholds is not None and len(thresholds) != len(tiers) - 1:
                raise ValueError(f"{len(thresholds)} thresholds for {len(tiers)} tiers "
                                 f"({', '.join(tiers)}): give one per tier above the cheapest")
        for name in (self.floor, self.detail_floor):
            if name is not None and name not in tiers:
                raise ValueError(f"floor tier {name!r} is not one of {', '.join(tiers)}")

    @property
    def uses_statistics(self) -> bool:
        """False when every threshold is infinite: only the floors decide, so skip the analysis."""
        return lifts(self.thresholds) or lifts(self.detail_thresholds or [])

    def needs_statistics(self, prompt: str) -> bool:
        """Whether deciding for this prompt looks at the frame at all."""
        return lifts(self.rule(self.is_detail_prompt(prompt) is not None)[1])

    def is_detail_prompt(self, prompt: str) -> str | None:
        """The first detail word the prompt contains, if any."""
        words = prompt_words(prompt)
        return next((w for w in self.detail_words if w in words), None)

    def choose(self, stats: SaliencyStats | None, prompt: str, tiers: list[str]) -> tuple[str, str]:
        """(tier, reason) for a frame with `stats` asked `prompt`; tiers cheapest first.

        `stats` may be None when this prompt's rule doesn't use statistics (needs_statistics).
        """
        word = self.is_detail_prompt(prompt)
        statistic, thresholds = self.rule(word is not None)
        if stats is None or not lifts(thresholds):
            reached, measured = 0, "no threshold to reach"
        else:
            value = getattr(stats, statistic)
            reached = sum(value >= t for t in thresholds)  # thresholds rise, so this is a level
            measured = f"{statistic} {value:.4g}"  # ASCII: reasons end up in logs and JSON
            if reached:
                measured += f" >= {thresholds[reached - 1]:.4g}"
            elif thresholds:
                measured += f" < {thresholds[0]:.4g}"
        floor_name = (self.detail_floor or tiers[-1]) if word else (self.floor or tiers[0])
        floor = tiers.index(floor_name)
        if reached > floor:
            why = measured
        elif word:
            why = f"prompt asks for detail ({word!r}), floor {floor_name}; {measured}"
        elif floor > 0:
            why = f"floor {floor_name}; {measured}"
        else:
            why = measured
        return tiers[max(reached, floor)], f"{self.source}: {why}"

    # ---- the calibrated policy file -----------------------------------------------------

    def save(self, path: Path, comment: str = "", extra: dict | None = None) -> None:
        data = {"statistic": self.statistic, "thresholds": [float(t) for t in self.thresholds],
                "detail_words": list(self.detail_words), "detail_floor": self.detail_floor,
                "floor": self.floor}
        if self.detail_thresholds is not None:
            data["detail_statistic"] = self.detail_statistic or self.statistic
            data["detail_thresholds"] = [float(t) for t in self.detail_thresholds]
        data.update(extra or {})
        header = "".join(f"# {line}\n" for line in comment.splitlines())
        path.write_text(header + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> "TierPolicy":
        if not path.is_file():
            raise ModelError(f"scheduler policy 'calibrated' needs {path}; make it with: "
                             f"python tools/calibrate_scheduler.py {path.parent}")
        try:
            data = load_yaml(read_model_file(path))
            return cls(statistic=data["statistic"], thresholds=[float(t) for t in data["thresholds"]],
                       detail_words=tuple(data.get("detail_words", DETAIL_WORDS)),
                       detail_floor=data.get("detail_floor"), floor=data.get("floor"),
                       source=f"calibrated ({path.name})", detail_statistic=data.get("detail_statistic"),
                       detail_thresholds=[float(t) for t in data["detail_thresholds"]]
                       if data.get("detail_thresholds") is not None else None)
        except (yaml.YAMLError, TypeError, KeyError, ValueError) as e:
            raise ModelError(f"{path}: not a valid scheduler policy ({type(e).__name__}: {' '.join(str(e).split())})") from None


# ---- the scheduler ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    tier: str
    reason: str
    stats: SaliencyStats | None = None  # None when no statistics were needed (pinned, top)
    policy: str = "top"  # the scheduler's policy (a pinned tier bypassed it: reason "pinned")
    policy_reason: str = ""  # why that policy: the config's choice, or what `auto` found

    def to_dict(self) -> dict:
        return {"tier": self.tier, "reason": self.reason,
                "stats": self.stats.to_dict() if self.stats else None,
                "policy": self.policy, "policy_reason": self.policy_reason}


class Scheduler:
    """Picks the tier for each (frame, prompt): pinned > policy; `policy=None` is `top`.

    `name` and `why` say which policy this is and why it was chosen (scheduler.policy, or
    what `auto` found in the model folder); every Decision carries them."""

    def __init__(self, tiers: list[str], default_tier: str, policy: TierPolicy | None = None,
                 name: str | None = None, why: str = ""):
        self.tiers = list(tiers)  # cheapest first
        self.default_tier = default_tier
        self.policy = policy
        self.name = name or ("top" if policy is None else policy.source.split()[0])
        self.why = why
        if policy is not None:
            policy.check_tiers(self.tiers)
        # the decisions that need no statistics are the same for every frame: made once (a
        # frozen dataclass costs microseconds to build, on every request's path)
        self._pinned = {tier: Decision(tier, "pinned", policy=self.name, policy_reason=why) for tier in self.tiers}
        self._top = Decision(default_tier, "policy top: the model's default tier", policy=self.name, policy_reason=why)

    def decide(self, rgb: np.ndarray, prompt: str, pinned: str | None = None,
               stats: SaliencyStats | None = None) -> Decision:
        """`stats`: the image's statistics, if a decision for another prompt about it computed them."""
        if pinned is not None:
            made = self._pinned.get(pinned)
            return made if made is not None else Decision(pinned, "pinned", policy=self.name, policy_reason=self.why)
        if self.policy is None:
            return self._top
        if not self.policy.needs_statistics(prompt):
            stats = None
        elif stats is None:
            stats = saliency_stats(rgb)
        tier, reason = self.policy.choose(stats, prompt, self.tiers)
        return Decision(tier, reason, stats, self.name, self.why)
