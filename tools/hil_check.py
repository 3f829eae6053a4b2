#!/usr/bin/env python3
"""Hardware-in-the-loop acceptance run, on the Jetson: TensorRT engines against ONNX Runtime CPU.

    python tools/hil_check.py models/tiny-vlm --precision int8 --encoder dla0,gpu --decoder gpu --build --n 100

Builds the engines first with --build (the same code as `edgemm engines build`), loads the
model twice — placed on TensorRT as asked, and on ONNX Runtime CPU as the reference (the
same precision's ONNX graph; fp32 for fp16 engines) — and runs generated eval scenes
through both. Prints one JSON object:

    platform      TensorRT version, GPU, compute capability, DLA cores, integrated or not
    placement     where each component ended up, and why earlier devices were skipped
    tiers.<tier>  accuracy of each side ("placed" as asked, "onnxruntime_cpu"), answers that agree, max |logit difference| of the
                  prefill step, median latency per stage (encode, prefill, decode) and device
    ok            every component runs on the first device asked for it
    kv_memory     the decoder's KV tensors in zero-copy (mapped host) memory against device memory
                  with copies: median ms per decode step at a long past, each way (Orin: measure,
                  then choose; skipped when the decoder is not on TensorRT)

A CUDA or TensorRT that will not start is reported (platform.error, placement.*.skipped), not raised.

Exit status 0 when ok, 1 when a component fell back (the JSON says why), 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from edgemm.config import load_config  # noqa: E402
from edgemm.errors import EdgemmError  # noqa: E402
from edgemm.engine.decode import BatchItem, generate  # noqa: E402
from edgemm.engine.generate import GenerationOptions  # noqa: E402
from edgemm.engine.runtime import Runtime  # noqa: E402
from edgemm.model.scenes import make_scene, normalise_answer, questions_for  # noqa: E402

HIL_SEED_BASE = 400_000  # eval range (< 500 000), apart from eval_tiny_vlm's default seeds


def devices(text: str) -> list[str]:
    return [d.strip() for d in text.split(",") if d.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", type=Path, default=ROOT / "models" / "tiny-vlm")
    ap.add_argument("--engines", type=Path, help="engine folder (default: the engines root's <model name>: $EDGEMM_ENGINES, /var/lib/edgemm/engines as root, else ~/.cache/edgemm/engines)")
    ap.add_argument("--precision", choices=["int8", "fp16"], default="int8")
    ap.add_argument("--encoder", type=devices, default=["dla0", "gpu"], help="vision encoder devices, in order")
    ap.add_argument("--embed", type=devices, default=["gpu"], help="embed_tokens devices, in order")
    ap.add_argument("--decoder", type=devices, default=["gpu"], help="decoder devices, in order")
    ap.add_argument("--build", action="store_true", help="build the engines for these devices first")
    ap.add_argument("--n", type=int, default=50, help="generated eval scenes")
    ap.add_argument("--tiers", type=devices, help="tiers to check (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    return ap.parse_args(argv)


def build(args) -> None:
    from edgemm.cli.main import main
    wanted: dict[str, set[str]] = {}
    for component, devs in (("vision_encoder", args.encoder), ("embed_tokens", args.embed), ("decoder", args.decoder)):
        for device in devs:
            if device != "cpu":
                wanted.setdefault(device, set()).add(component)
    for device, components in wanted.items():
        argv = ["engines", "build", str(args.model_dir), "--device", device, "--precision", args.precision,
                "--components", ",".join(sorted(components))]
        if args.engines:
            argv += ["--out", str(args.engines)]
        main(argv, standalone_mode=False)


def runtimes(args) -> tuple[Runtime, Runtime]:
    model = {"path": str(args.model_dir), "precision": args.precision,
             "engines": str(args.engines) if args.engines else None}
    placement = {"vision_encoder": args.encoder + ["cpu"], "embed_tokens": args.embed + ["cpu"],
                 "decoder": args.decoder + ["cpu"]}
    device_rt = Runtime(load_config({"model": model, "placement": placement, "backend": {"warmup": True}}))
    reference = "int8" if args.precision == "int8" else "fp32"
    cpu_rt = Runtime(load_config({"model": {"path": str(args.model_dir), "precision": reference},
                                  "backend": {"warmup": True}}))
    return device_rt, cpu_rt


def prefill_logits(rt: Runtime, features: np.ndarray, prompt) -> np.ndarray:
    embeds = rt.generator.embed_prompt(prompt.input_ids, features, prompt.image_start)
    mask = np.ones(prompt.input_ids.shape, np.int64)
    logits, _ = rt.generator.step(embeds, mask, rt.generator.empty_past(1))
    return logits


def check_tier(device_rt: Runtime, cpu_rt: Runtime, tier: str, seeds: range, max_new_tokens: int) -> dict:
    options = GenerationOptions(max_new_tokens=max_new_tokens)
    sides = {"placed": device_rt, "onnxruntime_cpu": cpu_rt}
    correct = {side: 0 for side in sides}
    stage_ms = {side: {"encode": [], "prefill": [], "decode": []} for side in sides}
    agree, total, max_diff = 0, 0, 0.0
    for seed in seeds:
        scene = make_scene(seed)
        features, answers = {}, {}
        for side, rt in sides.items():
            pixels, _ = rt.preprocess(scene.image, tier)
            t0 = time.perf_counter()
            features[side] = rt.generator.encode(pixels)
            stage_ms[side]["encode"].append((time.perf_counter() - t0) * 1e3)
        for question in questions_for(scene):
            total += 1
            for side, rt in sides.items():
                prompt = rt.adapter.build_prompt(question.prompt, rt.manifest.tiers[tier])
                generated = generate(rt.generator, BatchItem(features[side], prompt.input_ids, prompt.image_start, options))
                for stage in ("prefill", "decode"):
                    if stage in generated.timings_ms:
                        stage_ms[side][stage].append(generated.timings_ms[stage])
                answers[side] = normalise_answer(rt.adapter.decode(generated.tokens))
                correct[side] += answers[side] == normalise_answer(question.answer)
            agree += answers["placed"] == answers["onnxruntime_cpu"]
            prompt = device_rt.adapter.build_prompt(question.prompt, device_rt.manifest.tiers[tier])
            diff = np.abs(prefill_logits(device_rt, features["placed"], prompt).astype(np.float32)
                          - prefill_logits(cpu_rt, features["onnxruntime_cpu"], prompt).astype(np.float32)).max()
            max_diff = max(max_diff, float(diff))
    return {
        "questions": total,
        "accuracy": {side: round(100 * correct[side] / max(1, total), 2) for side in sides},
        "answers_agree": round(100 * agree / max(1, total), 2),
        "max_abs_logit_diff": round(max_diff, 5),
        "latency_ms": {side: {stage: round(statistics.median(v), 3) if v else None for stage, v in stages.items()}
                       for side, stages in stage_ms.items()},
        "devices": {"placed": device_rt.devices, "onnxruntime_cpu": cpu_rt.devices},
    }


def kv_memory(rt: Runtime, past: int = 128, steps: int = 20) -> dict:
    """One decode step with `past` cached positions, timed with the decoder's buffers in zero-copy
    memory and in device memory (the buffers made afresh each way), then put back as they were."""
    decoder = rt.generator.decoder
    engines = getattr(decoder, "engines", None)
    if not engines:
        return {"skipped": f"the decoder runs on {decoder.device} ({decoder.provider}), not on TensorRT"}
    generator = rt.generator
    past = min(past, rt.manifest.max_context - 2)
    embeds = generator.embed_next([0])
    mask = np.ones((1, past + 1), generator.mask_dtype)
    cache = {name: np.zeros((1, generator.kv_shape[0], past, generator.kv_shape[1]), generator.kv_dtype)
             for name in generator.past_names}
    kept = [(engine, engine.zero_copy, engine.buffers) for engine in engines]
    medians = {}
    try:
        for mode, zero_copy in (("zero_copy", True), ("device", False)):
            times = []
            for engine in engines:
                engine.zero_copy, engine.buffers = zero_copy, {}
            generator.step(embeds, mask, cache)  # allocates this way's buffers
            for _ in range(steps):
                started = time.perf_counter()
                generator.step(embeds, mask, cache)
                times.append((time.perf_counter() - started) * 1e3)
            medians[mode] = round(statistics.median(times), 3)
    finally:
        for engine, zero_copy, buffers in kept:
            engine.zero_copy, engine.buffers = zero_copy, buffers
    return {"past": past, "steps": steps, "median_ms": medians,
            "faster": min(medians, key=medians.get)}


def platform_info() -> dict:
    try:
        from edgemm.backends.tensorrt.platform import probe
        return vars(probe())
    except EdgemmError as e:
        return {"error": str(e)}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.build:
            build(args)
        device_rt, cpu_rt = runtimes(args)
        tiers = args.tiers or list(device_rt.manifest.tiers)
        for tier in tiers:
            device_rt.manifest.tier(tier)
    except EdgemmError as e:
        print(f"hil_check: error: {e}", file=sys.stderr)
        return e.exit_code
    seeds = range(HIL_SEED_BASE, HIL_SEED_BASE + args.n)
    placement = device_rt.placement_report()
    asked = {"vision_encoder": args.encoder[0], "embed_tokens": args.embed[0], "decoder": args.decoder[0]}
    ok = all(placement[c]["device"] == asked[c] for c in asked)
    report = {"model": device_rt.manifest.name, "precision": args.precision, "scenes": args.n,
              "platform": platform_info(), "placement": placement, "ok": ok, "kv_memory": kv_memory(device_rt),
              "tiers": {tier: check_tier(device_rt, cpu_rt, tier, seeds, args.max_new_tokens) for tier in tiers}}
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
