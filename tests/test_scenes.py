"""edgemm.model.scenes (the built-in model's world), model.yaml and the tokenizer's vocabulary."""
from __future__ import annotations

import re

import cv2
import numpy as np
import pytest
from tokenizers import Tokenizer

from edgemm.model.manifest import load_manifest
from edgemm.model.scenes import (COLOURS, COUNT_WORDS, NO_TEXT_ANSWER, SHAPES, TEXT_LENGTH, Scene, Shape,
                           make_scene, normalise_answer, questions_for, vocabulary)

SEEDS = range(100, 130)


def ground_truth_of(scene: Scene) -> list[tuple[str, str, str]]:
    return [(q.task, q.prompt, q.answer) for q in questions_for(scene)]


def test_same_seed_same_scene():
    a, b = make_scene(7), make_scene(7)
    assert np.array_equal(a.image, b.image)
    assert a.shapes == b.shapes and a.text == b.text
    assert ground_truth_of(a) == ground_truth_of(b)


def test_different_seed_differs():
    a, b = make_scene(7), make_scene(8)
    assert not np.array_equal(a.image, b.image)
    assert a.shapes != b.shapes


def test_scene_image_format():
    scene = make_scene(3)
    assert scene.image.shape == (256, 256, 3) and scene.image.dtype == np.uint8


def test_samples_match_their_seeds(model_dir, ground_truth):
    """The shipped sample PNGs and ground truth regenerate exactly from their seeds."""
    for name, entry in ground_truth.items():
        seed = entry["seed"]
        # tools/export_tiny_vlm.py write_samples: odd seeds always carry text
        scene = make_scene(seed, text_probability=1.0 if seed % 2 else 0.5)
        png = cv2.cvtColor(cv2.imread(str(model_dir / "samples" / name)), cv2.COLOR_BGR2RGB)
        assert np.array_equal(png, scene.image), name
        assert [(q["task"], q["prompt"], q["answer"]) for q in entry["questions"]] == ground_truth_of(scene)


@pytest.mark.parametrize("seed", SEEDS)
def test_ground_truth_is_consistent(seed):
    scene = make_scene(seed)
    assert 1 <= len(scene.shapes) <= 4
    assert all(s.kind in SHAPES and s.colour in COLOURS for s in scene.shapes)
    assert scene.count() == COUNT_WORDS[len(scene.shapes)]

    # describe: "a red circle , a blue square and an orange diamond", left to right
    items = scene.describe().replace(" and ", " , ").split(" , ")
    left_to_right = sorted(scene.shapes, key=lambda s: s.cx)
    assert [item.split()[1:] for item in items] == [[s.colour, s.kind] for s in left_to_right]
    assert [item.split()[0] for item in items] == ["an" if s.colour[0] in "aeiou" else "a"
                                                   for s in left_to_right]
    assert scene.describe().count(" and ") == (len(items) > 1)

    kinds = [s.kind for s in scene.shapes]
    for kind in SHAPES:
        if kinds.count(kind) == 1:
            assert scene.colour_of(kind) == next(s.colour for s in scene.shapes if s.kind == kind)
        else:
            with pytest.raises(ValueError):
                scene.colour_of(kind)

    if scene.text:
        assert re.fullmatch(r"\d( \d){%d}" % (TEXT_LENGTH - 1), scene.read())
        assert scene.read().replace(" ", "") == scene.text
    else:
        assert scene.read() == NO_TEXT_ANSWER == "no text"


def test_colour_of_refuses_non_unique_kinds():
    shapes = [Shape("circle", "red", 40, 40, 20), Shape("circle", "blue", 120, 40, 20),
              Shape("square", "green", 200, 150, 20)]
    scene = Scene(np.zeros((256, 256, 3), np.uint8), shapes, text=None)
    assert scene.colour_of("square") == "green"
    with pytest.raises(ValueError, match="2 circles"):
        scene.colour_of("circle")
    with pytest.raises(ValueError, match="0 triangles"):
        scene.colour_of("triangle")
    assert scene.unique_kinds() == ["square"]
    colour_questions = [q for q in questions_for(scene) if q.task == "colour"]
    assert [(q.prompt, q.answer) for q in colour_questions] == [("what color is the square ?", "green")]
    assert scene.describe() == "a red circle , a blue circle and a green square"


def test_text_probability_extremes():
    assert all(make_scene(s, text_probability=0.0).text is None for s in range(5))
    assert all(len(make_scene(s, text_probability=1.0).text) == TEXT_LENGTH for s in range(5))


def test_n_shapes_is_honoured():
    for n in range(1, 5):
        assert len(make_scene(42, n_shapes=n).shapes) == n


def test_normalise_answer():
    assert normalise_answer("A Red circle, a BLUE square.") == "a red circle , a blue square ."
    assert normalise_answer("  what colour  is it?") == "what color is it ?"


def test_model_yaml_validates(model_dir):
    m = load_manifest(model_dir)
    assert m.family == "tiny-vlm"
    assert list(m.tiers) == ["low", "mid", "high"] and m.default_tier == "high"
    assert [t.image_tokens for t in m.tiers.values()] == [9, 36, 64]
    assert m.image_token in m.prompt_format and "{prompt}" in m.prompt_format
    assert m.max_context > m.tiers["high"].image_tokens
    for component in ("vision_encoder", "embed_tokens", "decoder"):
        for precision in m.precisions:
            assert m.graph_path(component, precision).is_file()


def test_tokenizer_knows_every_vocabulary_word(model_dir):
    m = load_manifest(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / m.files["tokenizer"]))
    unk = tokenizer.token_to_id(m.special_tokens["unk"])
    ids = {}
    for word in vocabulary():
        encoded = tokenizer.encode(word, add_special_tokens=False).ids
        assert len(encoded) == 1 and encoded[0] != unk, (word, encoded)
        ids[word] = encoded[0]
    assert len(set(ids.values())) == len(ids)  # no two words share an id
    for token in (*m.special_tokens.values(), m.image_token, *m.stop_tokens):
        assert tokenizer.token_to_id(token) is not None, token
    assert tokenizer.encode("what colour is it", add_special_tokens=False).ids == [
        ids["what"], ids["color"], ids["is"], tokenizer.token_to_id("<unk>")]
