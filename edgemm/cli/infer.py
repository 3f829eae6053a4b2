"""`edgemm infer IMAGE`: one answer about one image, then exit (no pipeline, no warm-up)."""
from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

import click

from edgemm.cli.options import (DEFAULT_PROMPT, GENERATION_FLAGS, PRECISION_CHOICE, PRECISION_HELP, build_config,
                                model_label, quiet_libraries)
from edgemm.cli.output import echo_result, progress, reports_errors, standard_output, to_stderr
from edgemm.errors import InputError
from edgemm.util.generation_limits import MAX_BEAMS, MAX_NEW_TOKENS, MIN_TEMPERATURE, check_generation, check_text

if TYPE_CHECKING:
    import numpy as np

    from edgemm.config import LimitsConfig


def read_image_arg(image: str, limits: LimitsConfig) -> np.ndarray:
    """The decoded image: `-` reads stdin (bounded), anything else is a path (a regular
    file only). Decoded here, before the model loads, so a bad image costs no load."""
    from edgemm.model.image import load_image
    max_bytes = limits.max_image_bytes
    bounds = {"max_pixels": limits.max_pixels, "max_decoded_bytes": limits.max_decoded_bytes}
    if image != "-":
        return load_image(image, max_bytes=max_bytes, **bounds)
    data = sys.stdin.buffer.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputError(f"image on stdin is larger than {max_bytes} bytes (limits.max_image_bytes)")
    return load_image(data, **bounds)


class TierOption(click.Option):
    """--tier: its help names the default model's tiers, read only when help is shown."""

    def get_help_record(self, ctx: click.Context):
        try:
            from edgemm.model.manifest import load_manifest
            from edgemm.engine.runtime import default_model_dir
            manifest = load_manifest(default_model_dir())
            tiers = f"{manifest.name} has {', '.join(manifest.tiers)}; "
        except Exception:  # no readable default model: the help is still shown
            tiers = ""
        self.help = (f"Pin the resolution tier ({tiers}a wrong name lists the --model's own). "
                     "Default: the scheduler picks (see --scheduler).")
        return super().get_help_record(ctx)


@click.command()
@click.argument("image")
@click.option("--prompt", "-p", default=DEFAULT_PROMPT, show_default=True, help="Question about the image.")
@click.option("--tier", cls=TierOption)
@click.option("--scheduler", type=click.Choice(["auto", "top", "thresholds", "calibrated"]),
              help="Tier policy when no tier is pinned (default: scheduler.policy, auto: calibrated when "
                   "the model folder ships scheduler.yaml, else top).")
@click.option("--beams", type=int, help=f"Beam search width, 1..{MAX_BEAMS} (1 = greedy).")
@click.option("--beam-gate", type=float,
              help="Collapse beams once the best next token is this likely (0 = greedy, 1 = plain beams).")
@click.option("--precision", type=PRECISION_CHOICE, help=PRECISION_HELP)
@click.option("--model", "model_dir", type=click.Path(), help="Model folder (default: built-in tiny-vlm).")
@click.option("--config", "config_path", type=click.Path(), envvar="EDGEMM_CONFIG",
              help="YAML config file.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer with timings and metadata as JSON.")
@click.option("--max-new-tokens", type=int,
              help=f"Most tokens in the answer, 1..{MAX_NEW_TOKENS} (default: generation.max_new_tokens, 32).")
@click.option("--temperature", type=float,
              help=f"0 = greedy (the default); sampling needs at least {MIN_TEMPERATURE:g}.")
@click.option("--top-p", type=float,
              help="Sampling keeps the most likely tokens whose probabilities add up to this, in (0, 1] "
                   "(default: generation.top_p, 1 = all).")
@click.option("--seed", type=int,
              help="Sampling seed, 0..2**64-1: the same seed gives the same answer (default: random).")
@click.option("--threads", type=click.IntRange(0), help="Intra-op threads (0 = onnxruntime decides).")
@click.option("--quiet", "-q", is_flag=True, help="No progress line on stderr (warnings and errors still).")
@reports_errors
def infer(image, prompt, tier, scheduler, beams, beam_gate, precision, model_dir, config_path, as_json,
          max_new_tokens, temperature, top_p, seed, threads, quiet) -> None:
    """Answer PROMPT about IMAGE (a file, or - for stdin).

    Loads the model, answers, exits; no warm-up: the answer is the graphs' first run. A prompt with
    words the model does not know is answered with a warning (stderr; `warnings` in --json),
    or refused with limits.unknown_words: refuse."""
    quiet_libraries()
    check_generation(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                     num_beams=beams, beam_gate=beam_gate, names=GENERATION_FLAGS)  # before the model loads
    check_text(prompt, "--prompt")  # a NUL or undecodable bytes: exit 2, not the tokenizer's error
    standard_output()  # closed (`>&-`): said before the model loads, not after the answer
    from edgemm.engine.runtime import Runtime
    cfg = build_config(config_path, model_dir, precision, threads)
    if scheduler is not None:
        cfg.scheduler.policy = scheduler  # a click.Choice, so already valid
    source = read_image_arg(image, cfg.limits)
    with progress(model_label(cfg), quiet) as notes:
        # a warm-up would answer twice: the answer's own first run is all the warming it needs
        runtime = Runtime(cfg, warm_up=False, one_shot=True)
        if cfg.model.precision == "auto":  # which variant auto took
            notes.append(runtime.models.precision)
        started = time.perf_counter()
        request = runtime.prepare(source, prompt, tier=tier, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_p=top_p, seed=seed,
                                  num_beams=beams, beam_gate=beam_gate)
    result = runtime.answer(request, started=started)
    if as_json:
        echo_result(json.dumps({"answer": result.text, "prompt": prompt,
                               "image": image if image != "-" else "<stdin>", **result.to_dict()}))
    else:
        echo_result(result.text)
        for warning in result.warnings:
            to_stderr(f"edgemm: warning: {warning}")
