"""Generated scenes with known content: the built-in model's world.

A scene is 1-4 coloured shapes on a noisy background, sometimes with a short
string of digits drawn small. Every scene carries its ground truth, so answers
can be scored exactly. Training, calibration, tests, benchmarks and the
`synthetic://` source all draw from here; the inference path never imports it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from edgemm.util.opencv import cv2

SHAPES = ("circle", "square", "triangle", "diamond")
COLOURS = {  # RGB, saturated so colour survives the lowest tier and noise
    "red": (215, 35, 35),
    "green": (35, 165, 55),
    "blue": (40, 70, 225),
    "yellow": (240, 215, 35),
    "purple": (140, 55, 190),
    "orange": (250, 135, 20),
}
COUNT_WORDS = ("zero", "one", "two", "three", "four")
TEXT_LENGTH = 3  # digits per text label
SCENE_SIZE = 256  # native side of a generated scene (= the top tier)

TASKS = ("describe", "count", "colour", "read")

# Several phrasings per task so the model keys on meaning, not one string.
PROMPTS = {
    "describe": ("describe the image", "what is in the image ?", "describe the scene",
                 "what do you see ?"),
    "count": ("how many shapes are there ?", "how many shapes ?", "count the shapes"),
    "colour": ("what color is the {shape} ?", "what colour is the {shape} ?",
               "which color is the {shape} ?"),
    "read": ("what does the text say ?", "read the text", "what is written ?"),
}
NO_TEXT_ANSWER = "no text"


@dataclass
class Shape:
    kind: str
    colour: str
    cx: int
    cy: int
    radius: int


@dataclass
class Scene:
    """An RGB image (H, W, 3) uint8 and what is in it."""
    image: np.ndarray
    shapes: list[Shape]
    text: str | None
    text_box: tuple[int, int, int, int] | None = None  # x, y, w, h
    seed: int | None = None

    def describe(self) -> str:
        items = [f"{'an' if s.colour[0] in 'aeiou' else 'a'} {s.colour} {s.kind}"
                 for s in sorted(self.shapes, key=lambda s: s.cx)]
        if len(items) == 1:
            return items[0]
        return " , ".join(items[:-1]) + " and " + items[-1]

    def count(self) -> str:
        return COUNT_WORDS[len(self.shapes)]

    def unique_kinds(self) -> list[str]:
        kinds = [s.kind for s in self.shapes]
        return [k for k in SHAPES if kinds.count(k) == 1]

    def colour_of(self, kind: str) -> str:
        matches = [s.colour for s in self.shapes if s.kind == kind]
        if len(matches) != 1:
            raise ValueError(f"the scene has {len(matches)} {kind}s, not exactly one")
        return matches[0]

    def read(self) -> str:
        return " ".join(self.text) if self.text else NO_TEXT_ANSWER


@dataclass
class Question:
    task: str
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


def _draw_shape(img: np.ndarray, s: Shape) -> None:
    colour = tuple(int(c) for c in COLOURS[s.colour])
    r, cx, cy = s.radius, s.cx, s.cy
    if s.kind == "circle":
        cv2.circle(img, (cx, cy), r, colour, -1, cv2.LINE_AA)
        return
    if s.kind == "square":
        h = int(round(r * 0.85))
        pts = [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    elif s.kind == "triangle":
        pts = [(cx, cy - r), (cx + int(r * 0.95), cy + int(r * 0.75)),
               (cx - int(r * 0.95), cy + int(r * 0.75))]
    elif s.kind == "diamond":
        pts = [(cx, cy - r), (cx + int(r * 0.8), cy), (cx, cy + r), (cx - int(r * 0.8), cy)]
    else:
        raise ValueError(f"unknown shape {s.kind!r}")
    cv2.fillPoly(img, [np.array(pts, np.int32)], colour, cv2.LINE_AA)


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    grey = rng.uniform(105, 175)
    tint = rng.uniform(-10, 10, size=3).astype(np.float32)
    # a gentle linear gradient plus pixel noise: texture without colour cues
    gx, gy = rng.uniform(-25, 25, size=2)
    ramp = np.linspace(-0.5, 0.5, size, dtype=np.float32)
    plane = np.float32(grey) + np.float32(gx) * ramp[None, :] + np.float32(gy) * ramp[:, None]
    img = rng.standard_normal((size, size, 3), dtype=np.float32)
    img *= np.float32(rng.uniform(6, 16))
    img += plane[:, :, None]
    img += tint
    np.clip(img, 0, 255, out=img)
    return img.astype(np.uint8)


def _overlaps(box: tuple[int, int, int, int], boxes: list[tuple[int, int, int, int]],
              margin: int) -> bool:
    x0, y0, x1, y1 = box
    return any(x0 < b[2] + margin and b[0] < x1 + margin and y0 < b[3] + margin
               and b[1] < y1 + margin for b in boxes)


def make_scene(seed: int, size: int = SCENE_SIZE, text_probability: float = 0.5,
               n_shapes: int | None = None) -> Scene:
    """Deterministic scene for `seed`: same seed, same pixels and ground truth."""
    rng = np.random.default_rng(seed)
    scale = size / SCENE_SIZE
    img = _background(rng, size)
    boxes: list[tuple[int, int, int, int]] = []

    text = None
    text_box = None
    if rng.random() < text_probability:
        text = "".join(str(d) for d in rng.integers(0, 10, size=TEXT_LENGTH))
        font_scale = rng.uniform(0.42, 0.50) * scale  # 12-14 px tall at 256: legible at the top tier
        (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, font_scale, 1)
        # Labels sit on a coarse grid: they start 2-5 px into a 64-px column and are centred in
        # a 32-px row (at 256 px), like a caption on a display. A label then lies inside one
        # top-tier image token at a few fixed offsets, so reading depends on how many pixels the
        # tier gives each digit, not on a tiny CNN finding the label anywhere in its field.
        cols = int((size - tw - 2) // (64 * scale)) + 1
        x = int(rng.integers(0, cols) * 64 * scale + rng.integers(2, 6) * scale)
        row = int(rng.integers(0, int(size // (32 * scale))))
        y = int(row * 32 * scale + (32 * scale + th) / 2)
        shade = int(rng.integers(0, 45))
        cv2.putText(img, text, (x, y), cv2.FONT_HERSHEY_SIMPLEX, font_scale,
                    (shade, shade, shade), 1, cv2.LINE_AA)
        text_box = (x, y - th, tw, th + base)
        boxes.append((x, y - th, x + tw, y + base))

    count = n_shapes if n_shapes is not None else int(rng.integers(1, 5))
    shapes: list[Shape] = []
    while len(shapes) < count:
        for _ in range(200):
            r = int(rng.integers(14, 27) * scale)
            cx = int(rng.integers(r + 3, size - r - 3))
            cy = int(rng.integers(r + 3, size - r - 3))
            box = (cx - r, cy - r, cx + r, cy + r)
            # distinct x centres keep "left to right" unambiguous in descriptions
            if not _overlaps(box, boxes, int(6 * scale)) and all(
                    abs(cx - s.cx) > 6 * scale for s in shapes):
                break
        else:  # crowded: start again with a fresh layout from the same stream
            return make_scene(int(rng.integers(0, 2**31)), size, text_probability, n_shapes)
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        shapes.append(Shape(kind, colour, cx, cy, r))
        boxes.append(box)
    for s in shapes:
        _draw_shape(img, s)
    return Scene(img, shapes, text, text_box, seed)


def questions_for(scene: Scene) -> list[Question]:
    """Every task the scene supports, with its canonical answer (first phrasing)."""
    qs = [Question("describe", PROMPTS["describe"][0], scene.describe()),
          Question("count", PROMPTS["count"][0], scene.count())]
    for kind in scene.unique_kinds():
        qs.append(Question("colour", PROMPTS["colour"][0].format(shape=kind),
                           scene.colour_of(kind), {"shape": kind}))
    if scene.text:
        qs.append(Question("read", PROMPTS["read"][0], scene.read()))
    return qs


def sample_question(scene: Scene, rng: np.random.Generator, task: str | None = None) -> Question:
    """One question about `scene`, with a random phrasing (for training)."""
    task = task or TASKS[int(rng.integers(len(TASKS)))]
    if task == "colour" and not scene.unique_kinds():
        task = "count"
    phrasing = PROMPTS[task][int(rng.integers(len(PROMPTS[task])))]
    if task == "describe":
        return Question(task, phrasing, scene.describe())
    if task == "count":
        return Question(task, phrasing, scene.count())
    if task == "colour":
        kinds = scene.unique_kinds()
        kind = kinds[int(rng.integers(len(kinds)))]
        return Question(task, phrasing.format(shape=kind), scene.colour_of(kind), {"shape": kind})
    return Question(task, phrasing, scene.read())


def normalise_answer(text: str) -> str:
    """Lower case, punctuation spaced out, single spaces: exact match compares these."""
    text = text.lower().replace("colour", "color")
    text = re.sub(r"([,.?!])", r" \1 ", text)
    return " ".join(text.split())


def vocabulary() -> list[str]:
    """Every word the built-in model reads or writes (special tokens come first)."""
    words: set[str] = set()
    for phrasings in PROMPTS.values():
        for p in phrasings:
            words.update(normalise_answer(p.replace("{shape}", "")).split())
    words.update(SHAPES)
    words.update(COLOURS)
    words.update(COUNT_WORDS)
    words.update(str(d) for d in range(10))
    words.update(["a", "an", "and", ",", "no", "text", "color"])
    return sorted(words)
