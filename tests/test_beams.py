"""edgemm.engine.beams: gate 0 is greedy, gate 1 is plain beam search (checked against a from-scratch
reference without the KV cache), options, stats, streaming, and the CLI's --beams / --scheduler."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from edgemm.cli.main import main
from edgemm.errors import InputError
from edgemm.engine.decode import BatchItem, generate
from edgemm.engine.generate import GenerationOptions, Generator
from edgemm.model.scenes import make_scene

PROMPTS = ("describe the image", "what does the text say ?", "how many shapes are there ?")
SEEDS = (402_000, 402_001, 402_002)


def no_stop(runtime) -> Generator:
    g = runtime.generator
    return Generator(g.encoder, g.embed, g.decoder, g.max_context, stop_ids=set())


def inputs(runtime, seed: int, prompt: str):
    pixels, tier = runtime.preprocess(make_scene(seed).image)
    built = runtime.adapter.build_prompt(prompt, runtime.manifest.tiers[tier])
    return runtime.generator.encode(pixels), built.input_ids, built.image_start


def reference_beam_search(gen: Generator, features, input_ids, image_start, width: int, budget: int):
    """Plain beam search the slow, obvious way: every beam re-runs its whole sequence alone.

    Same rules as edgemm.engine.beams: summed log-probs, the best 2*width continuations in order,
    a stop among the first `width` finishes a hypothesis, stop when a finished one leads.
    """
    prompt = gen.embed_prompt(input_ids, features, image_start)

    def next_logp(tokens: list[int]) -> np.ndarray:
        embeds = prompt
        if tokens:
            more = gen.embed.run({"input_ids": np.array([tokens], np.int64)})["inputs_embeds"]
            embeds = np.concatenate([prompt, more.astype(prompt.dtype)], axis=1)
        logits, _ = gen.step(embeds, np.ones((1, embeds.shape[1]), np.int64), gen.empty_past(1))
        z = logits[0].astype(np.float64)
        return z - z.max() - np.log(np.exp(z - z.max()).sum())

    live, finished = [([], 0.0)], []
    while True:
        if not live or (finished and max(f[1] for f in finished) >= max(b[1] for b in live)):
            return max(finished, key=lambda f: f[1])[0], "stop"
        candidates = []
        for parent, (tokens, total) in enumerate(live):
            logp = next_logp(tokens)
            candidates += [(total + lp, parent * len(logp) + t, tokens, t) for t, lp in enumerate(logp)]
        candidates.sort(key=lambda c: (-c[0], c[1]))
        live = []
        for rank, (total, _, tokens, token) in enumerate(candidates[:2 * width]):
            if token in gen.stop_ids:
                if rank < width:
                    finished.append((tokens, total))
                continue
            live.append((tokens + [token], total))
            if len(live) == width:
                break
        if live and len(live[0][0]) >= budget:
            best = max(live, key=lambda b: b[1])
            if finished and max(f[1] for f in finished) >= best[1]:
                return max(finished, key=lambda f: f[1])[0], "stop"
            return best[0], "length"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_gate_zero_is_greedy(runtime, seed, prompt):
    request = inputs(runtime, seed, prompt)
    for gen in (runtime.generator, no_stop(runtime)):
        greedy = generate(gen, BatchItem(*request, GenerationOptions(max_new_tokens=8)))
        gated = generate(gen, BatchItem(*request, GenerationOptions(max_new_tokens=8, num_beams=4, beam_gate=0.0)))
        assert (gated.tokens, gated.finish_reason) == (greedy.tokens, greedy.finish_reason)
        assert gated.stats["collapsed_at"] == 0 and gated.stats["beam_steps"] == 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("width", [2, 3])
def test_gate_one_is_plain_beam_search(runtime, seed, prompt, width):
    request = inputs(runtime, seed, prompt)
    for gen, budget in ((runtime.generator, 8), (no_stop(runtime), 5)):
        beams = generate(gen, BatchItem(*request, GenerationOptions(max_new_tokens=budget, num_beams=width, beam_gate=1.0)))
        assert (beams.tokens, beams.finish_reason) == reference_beam_search(gen, *request, width, budget)
        assert beams.stats["collapsed_at"] is None


def test_gated_search_costs_no_more_than_full_beams(runtime):
    gen = no_stop(runtime)
    for seed in SEEDS:
        request = inputs(runtime, seed, PROMPTS[0])
        full = generate(gen, BatchItem(*request, GenerationOptions(max_new_tokens=6, num_beams=3, beam_gate=1.0)))
        gated = generate(gen, BatchItem(*request, GenerationOptions(max_new_tokens=6, num_beams=3, beam_gate=0.85)))
        assert gated.stats["decoder_rows"] <= full.stats["decoder_rows"]
        assert len(gated.tokens) == len(full.tokens) == 6


def test_streamed_tokens_are_the_answer(runtime):
    request = inputs(runtime, SEEDS[0], PROMPTS[0])
    for gate in (0.0, 0.5, 1.0):
        seen = []
        result = generate(no_stop(runtime), BatchItem(*request, GenerationOptions(max_new_tokens=5, num_beams=3,
                                                                        beam_gate=gate), seen.append))
        assert seen == result.tokens


def test_runtime_and_config_take_beams(make_runtime):
    image = make_scene(SEEDS[1]).image
    rt = make_runtime(generation={"num_beams": 3, "beam_gate": 0.0})
    assert rt.infer(image, PROMPTS[0]).tokens == rt.infer(image, PROMPTS[0], num_beams=1).tokens
    assert rt.infer(image, PROMPTS[0], beam_gate=1.0).finish_reason in ("stop", "length")


@pytest.mark.parametrize("bad, message", [
    ({"num_beams": 0}, "num_beams"), ({"beam_gate": -0.1}, "beam_gate"), ({"beam_gate": 1.5}, "beam_gate"),
    ({"num_beams": 2, "temperature": 0.7}, "temperature 0")])
def test_bad_beam_options(bad, message):
    with pytest.raises(InputError, match=message):
        GenerationOptions(**bad)


# ---- the command line -----------------------------------------------------------------------------

def cli_json(*args) -> dict:
    result = CliRunner().invoke(main, ["infer", *map(str, args), "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cli_beams(model_dir):
    sample = model_dir / "samples" / "scene_12.png"
    greedy = cli_json(sample, "--prompt", PROMPTS[0])
    assert cli_json(sample, "--prompt", PROMPTS[0], "--beams", "3", "--beam-gate", "0")["tokens"] == greedy["tokens"]
    assert cli_json(sample, "--prompt", PROMPTS[0], "--beams", "3")["finish_reason"] in ("stop", "length")
    bad = CliRunner().invoke(main, ["infer", str(sample), "--beams", "0"])
    assert bad.exit_code == 2 and "--beams" in bad.stderr


def test_cli_scheduler(model_dir, tmp_path, tmp_model):
    sample = model_dir / "samples" / "scene_12.png"
    config = tmp_path / "edgemm.yaml"
    config.write_text("scheduler:\n  thresholds: [1.0, 1.0]\nbackend:\n  warmup: false\n")
    default = cli_json(sample, "--config", config)  # the model ships scheduler.yaml: auto runs calibrated
    assert default["schedule"]["policy"] == "calibrated" and "scheduler.yaml" in default["schedule"]["policy_reason"]
    assert default["schedule"]["reason"].startswith("calibrated (scheduler.yaml)")
    top = cli_json(sample, "--config", config, "--scheduler", "top")
    assert top["tier"] == "high" and top["schedule"]["reason"].startswith("policy top")
    assert top["schedule"]["policy"] == "top" and top["schedule"]["policy_reason"] == "scheduler.policy: top"
    low = cli_json(sample, "--config", config, "--scheduler", "thresholds")
    assert low["tier"] == "low" and low["schedule"]["stats"]["edge_density"] < 1.0
    reading = cli_json(sample, "--config", config, "--scheduler", "thresholds", "--prompt", "read the text")
    assert reading["tier"] == "high" and "detail" in reading["schedule"]["reason"]
    pinned = cli_json(sample, "--config", config, "--scheduler", "thresholds", "--tier", "mid")
    assert pinned["tier"] == "mid" and pinned["schedule"]["reason"] == "pinned"
    (tmp_model / "scheduler.yaml").unlink(missing_ok=True)
    missing = CliRunner().invoke(main, ["infer", str(sample), "--scheduler", "calibrated", "--model",
                                        str(tmp_model)])
    assert missing.exit_code == 2 and "tools/calibrate_scheduler.py" in missing.stderr
