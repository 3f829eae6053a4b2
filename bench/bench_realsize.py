#!/usr/bin/env python3
"""Real size, side by side: edgemm, a raw onnxruntime loop and transformers + torch on one model.

    python -m bench.bench_realsize [--shape smolvlm-256m | --model DIR] [--warm 10] [--cold 3] [--threads 2]
                                   [--precisions fp32,q4,auto] [--candidates edgemm,raw]
    python -m bench.bench_realsize --cold-only --cold 8      # `edgemm infer` against the raw loop, cold

The model is a random-weight model of a real shape (tools/make_sized_model.py, built first
if its cache folder is not complete). One question about probe.png at one 512×512 tile
(the `global` tier), greedy, up to --tokens new tokens, --threads intra-op threads for every
candidate:

  edgemm         `Runtime.infer` (feature and prefix cache off: every request pays the encoder);
                 with precision `auto`, after tools/choose_precisions.py measured the folder
                 at --threads (it runs first)
  raw ORT        the same three graphs in onnxruntime sessions with edgemm's session options,
                 called by a plain loop: encoder, embed, splice, prefill, one decoder call a
                 token. Its inputs (ids, pixel values) are computed once before timing, so its
                 time is the graphs' alone: the bound
  transformers   `Idefics3ForConditionalGeneration.generate` on the same weights
                 (model.safetensors), processor call included
  edgemm CLI     cold only: `edgemm infer` as a user runs it (default config, and with
                 `backend.warmup: false`: a one-shot warms nothing either way)

Warm: each candidate is a process of its own that loads once, answers one untimed
request, then answers when told; the driver asks the candidates in turn, request by
request, in a rotating order, so all see the same machine load. Peak RSS is each process's
VmHWM. Cold: a fresh process per answer (wall time from spawn to exit, ru_maxrss), the
candidates again in turn. Every candidate's tokens are checked against transformers' own
answer recorded at build time (reference.json); quantized variants present in the folder
(onnx/*_q4.onnx, *_quantized.onnx, *_int8.onnx, …; or those --precisions names) are run by
edgemm and the raw loop, and their agreement with fp32 is reported instead. --candidates
narrows the warm candidates (fewer processes held at once); --cold 0 skips the cold starts.

Time to first token is prepare + encode + prefill; decode tokens/s counts the tokens
after the first over the time after it. Paste the Markdown into docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
# make_sized_model.CACHE, not imported: that module imports torch, and the driver stays small
SIZED_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edgemm" / "sized"


def peak_rss_mb() -> float:
    """This process's high-water resident set (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- candidates (each runs in a process of its own) -----------------------------------------

class EdgemmCandidate:
    def __init__(self, model: Path, precision: str, threads: int, tokens: int, reference: dict):
        from edgemm.config import load_config
        from edgemm.engine.runtime import Runtime
        self.runtime = Runtime(load_config({"model": {"path": str(model), "precision": precision},
                                            "backend": {"intra_op_threads": threads, "warmup": False},
                                            "cache": {"max_bytes": 0}}))
        self.image, self.prompt, self.tokens = model / reference["image"], reference["prompt"], tokens

    def run(self) -> dict:
        started = time.perf_counter()
        result = self.runtime.infer(self.image, self.prompt, tier="global", max_new_tokens=self.tokens)
        e2e = (time.perf_counter() - started) * 1e3
        t = result.timings_ms
        return {"e2e_ms": e2e, "ttft_ms": t["preprocess"] + t["encode"] + t["prefill"],
                "steps": result.decoder_steps, "tokens": result.tokens, "precision": self.runtime.precision}


class RawOrtCandidate:
    """The graphs and nothing else: what any runtime over them cannot beat."""

    def __init__(self, model: Path, precision: str, threads: int, tokens: int, reference: dict):
        import onnxruntime as ort
        options = ort.SessionOptions()  # as edgemm.backends.onnxruntime makes them
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        suffix = "" if precision == "fp32" else f"_{precision}"

        def session(name: str):
            return ort.InferenceSession(str(model / "onnx" / f"{name}{suffix}.onnx"), options,
                                        providers=["CPUExecutionProvider"])
        self.encoder, self.embed, self.decoder = (session(n) for n in
                                                   ("vision_encoder", "embed_tokens", "decoder_model_merged"))
        inputs = np.load(os.environ["BENCH_REALSIZE_INPUTS"])
        self.input_ids, self.pixels = inputs["input_ids"], inputs["pixel_values"]
        self.image_positions, self.stop_ids = inputs["image_positions"], set(inputs["stop_ids"].tolist())
        self.past = {i.name: i for i in self.decoder.get_inputs() if i.name.startswith("past_key_values.")}
        self.kv_dtype = np.float16 if "float16" in next(iter(self.past.values())).type else np.float32
        self.tokens = tokens

    def run(self) -> dict:
        started = time.perf_counter()
        pixels = self.pixels.astype(np.float16 if "float16" in self.encoder.get_inputs()[0].type else np.float32)
        features = self.encoder.run(None, {"pixel_values": pixels,
                                           "pixel_attention_mask": np.ones((*pixels.shape[:2], *pixels.shape[3:]),
                                                                           bool)})[0]
        embeds = self.embed.run(None, {"input_ids": self.input_ids})[0]
        embeds[0, self.image_positions] = features.reshape(-1, features.shape[-1])
        length = embeds.shape[1]
        past = {name: np.zeros((1, spec.shape[1], 0, spec.shape[3]), self.kv_dtype) for name, spec in self.past.items()}
        feeds = {"inputs_embeds": embeds, "attention_mask": np.ones((1, length), np.int64),
                 "position_ids": np.arange(length, dtype=np.int64)[None], **past}
        tokens, first_at, steps = [], 0.0, 0
        while True:
            logits, *presents = self.decoder.run(None, feeds)
            token = int(logits[0, -1].argmax())
            if first_at:
                steps += 1
            else:  # the prefill gave the first token
                first_at = time.perf_counter()
            if token in self.stop_ids:
                break
            tokens.append(token)
            if len(tokens) == self.tokens:
                break
            length += 1
            feeds = {"inputs_embeds": self.embed.run(None, {"input_ids": np.array([[token]], np.int64)})[0],
                     "attention_mask": np.ones((1, length), np.int64),
                     "position_ids": np.array([[length - 1]], np.int64),
                     **dict(zip(self.past, presents))}
        return {"e2e_ms": (time.perf_counter() - started) * 1e3, "ttft_ms": (first_at - started) * 1e3,
                "steps": steps, "tokens": tokens}


class TransformersCandidate:
    def __init__(self, model: Path, precision: str, threads: int, tokens: int, reference: dict):
        import torch
        from PIL import Image
        from transformers import Idefics3ForConditionalGeneration, Idefics3Processor, StoppingCriteria
        torch.set_num_threads(threads)
        self.torch, self.open_image = torch, Image.open
        self.model = Idefics3ForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
        self.processor = Idefics3Processor.from_pretrained(model)
        self.image, self.tokens = model / reference["image"], tokens
        self.tile = self.model.config.vision_config.image_size
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": reference["prompt"]}]}]
        self.text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        stamps = self.stamps = []

        class Stamp(StoppingCriteria):  # called once per generated token: when it came
            def __call__(self, input_ids, scores, **kwargs):
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)
        self.stamp = Stamp()

    def run(self) -> dict:
        self.stamps.clear()
        started = time.perf_counter()
        inputs = self.processor(text=[self.text], images=[[self.open_image(self.image).convert("RGB")]],
                                return_tensors="pt", size={"longest_edge": self.tile})
        with self.torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=self.tokens, do_sample=False,
                                      stopping_criteria=[self.stamp])
        e2e = (time.perf_counter() - started) * 1e3
        tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
        if tokens and tokens[-1] == self.processor.tokenizer.eos_token_id:
            tokens = tokens[:-1]
        return {"e2e_ms": e2e, "ttft_ms": (self.stamps[0] - started) * 1e3, "steps": len(self.stamps) - 1,
                "tokens": tokens}


CANDIDATES = {"edgemm": EdgemmCandidate, "raw": RawOrtCandidate, "transformers": TransformersCandidate}


def worker(spec: str, args, once: bool) -> None:
    """`name:precision` loaded here; one answer (--once), or answers on request (stdin lines)."""
    name, precision = spec.split(":")
    reference = json.loads((args.model / "reference.json").read_text())
    candidate = CANDIDATES[name](args.model, precision, args.threads, args.tokens, reference)
    if once:
        print(json.dumps(candidate.run()), flush=True)
        return
    candidate.run()  # untimed: the first run allocates
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(json.dumps(candidate.run()), flush=True)
    print(json.dumps({"peak_rss_mb": peak_rss_mb()}), flush=True)


# ---- the driver -----------------------------------------------------------------------------

def raw_inputs(model: Path, path: Path) -> None:
    """What the raw loop is handed: edgemm's own prompt ids and pixels (equal to the
    processor's, tests/test_idefics3.py), so the raw loop times the graphs only."""
    from edgemm.model.family import adapter_for
    from edgemm.model.image import load_image
    from edgemm.model.manifest import load_manifest
    reference = json.loads((model / "reference.json").read_text())
    manifest = load_manifest(model)
    adapter = adapter_for(manifest)
    tier = manifest.tiers["global"]
    rgb = load_image(model / reference["image"])
    prompt = adapter.build_prompt(reference["prompt"], tier, rgb.shape[:2])
    assert prompt.input_ids[0].tolist() == reference["input_ids"], "edgemm's prompt ids differ from the processor's"
    np.savez(path, input_ids=prompt.input_ids, pixel_values=adapter.pixels(rgb, tier),
             image_positions=prompt.image_positions, stop_ids=np.array(sorted(adapter.stop_ids)))


class Worker:
    def __init__(self, spec: str, args, env: dict):
        self.spec = spec
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", spec, "--model", str(args.model),
                                      "--threads", str(args.threads), "--tokens", str(args.tokens)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.runs: list[dict] = []

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.spec}: the worker ended (exit {self.proc.wait()})")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()


def cold_commands(args, spec: str, nowarm_config: Path) -> list[str]:
    if spec.startswith("edgemm-cli"):
        reference = json.loads((args.model / "reference.json").read_text())
        exe = str(Path(sys.executable).parent / "edgemm")
        command = [exe, "infer", str(args.model / reference["image"]), "--model", str(args.model), "--prompt",
                   reference["prompt"], "--tier", "global", "--max-new-tokens", str(args.tokens), "--threads",
                   str(args.threads), "--precision", "fp32", "--json", "--quiet"]  # the raw loop's graphs, not auto's pick
        return command + (["--config", str(nowarm_config)] if spec.endswith("no-warm-up") else [])
    return [sys.executable, __file__, "--once", spec, "--model", str(args.model), "--threads", str(args.threads),
            "--tokens", str(args.tokens)]


def spawn_measured(command: list[str], env: dict) -> tuple[float, float, list[int]]:
    """Wall time spawn → exit and the child's own peak RSS (wait4's rusage)."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command[:4])} failed: {err.decode()[-2000:]}")
    return wall, usage.ru_maxrss / 1024, json.loads(out.decode().strip().splitlines()[-1])["tokens"]


def summary(values: list[float], digits: int = 1) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "n": len(values)}


def bench(args) -> dict:
    reference = json.loads((args.model / "reference.json").read_text())
    from edgemm.model.manifest import load_manifest
    present = load_manifest(args.model).precisions
    precisions = args.precisions.split(",") if args.precisions else present
    if missing := [p for p in precisions if p not in present and p != "auto"]:
        raise SystemExit(f"--precisions {','.join(missing)}: not in {args.model} (present: {', '.join(present)})")
    candidates = args.candidates.split(",")
    # auto: edgemm only (the raw loop has no choice to make), after the tool measured the folder
    specs = [f"{name}:{p}" for p in precisions for name in ("edgemm", "raw")
             if name in candidates and (p != "auto" or name == "edgemm")]
    if "auto" in precisions:
        subprocess.run([sys.executable, str(TOOLS / "choose_precisions.py"), str(args.model), "--threads",
                        str(args.threads)], check=True, stdout=sys.stderr)
    specs += ["transformers:fp32"] if "transformers" in candidates else []
    scratch = Path(tempfile.mkdtemp(prefix="bench-realsize-"))
    inputs = scratch / "raw_inputs.npz"
    raw_inputs(args.model, inputs)
    nowarm = scratch / "no-warm-up.yaml"
    nowarm.write_text("backend:\n  warmup: false\n")
    env = {**os.environ, "BENCH_REALSIZE_INPUTS": str(inputs), "OMP_NUM_THREADS": str(args.threads)}

    # cold first, while no warm worker holds memory the machine may need
    cold_specs = [] if not args.cold else ["edgemm-cli", "raw:fp32"] if args.cold_only else \
        ["edgemm-cli", "edgemm-cli no-warm-up", "raw:fp32", "transformers:fp32"]
    cold: dict[str, dict] = {s: {"wall_s": [], "rss_mb": [], "tokens": None} for s in cold_specs}
    for round_ in range(args.cold):
        for spec in cold_specs[round_ % len(cold_specs):] + cold_specs[:round_ % len(cold_specs)]:
            wall, rss, tokens = spawn_measured(cold_commands(args, spec, nowarm), env)
            cold[spec]["wall_s"].append(wall)
            cold[spec]["rss_mb"].append(rss)
            cold[spec]["tokens"] = tokens
            print(f"cold {spec}: {wall:.1f} s, {rss:.0f} MB", file=sys.stderr)

    workers = [] if args.cold_only else [Worker(spec, args, env) for spec in specs]
    for w in workers:
        w.read()  # loaded and warmed
    for round_ in range(args.warm if workers else 0):
        shift = round_ % len(workers)
        for w in workers[shift:] + workers[:shift]:
            w.runs.append(w.ask("run"))
        print(f"warm round {round_ + 1}/{args.warm}", file=sys.stderr)
    warm = {}
    for w in workers:
        rss = w.ask("quit")["peak_rss_mb"]
        w.proc.wait()
        e2e = [r["e2e_ms"] for r in w.runs]
        ttft = [r["ttft_ms"] for r in w.runs]
        rates = [r["steps"] / ((r["e2e_ms"] - r["ttft_ms"]) / 1e3) for r in w.runs if r["steps"]]
        answers = {tuple(r["tokens"]) for r in w.runs}
        warm[w.spec] = {"e2e_ms": summary(e2e), "ttft_ms": summary(ttft), "decode_tokens_per_s": summary(rates),
                        "peak_rss_mb": round(rss), "tokens": w.runs[-1]["tokens"],
                        **({"precision": w.runs[-1]["precision"]} if "precision" in w.runs[-1] else {}),
                        "same_tokens_every_run": len(answers) == 1}
    expected = reference["tokens"]
    for spec, r in list(warm.items()) + list(cold.items()):
        precision = spec.split(":")[1] if ":" in spec else "fp32"
        r["tokens_equal_transformers_reference"] = r["tokens"] == expected
        if precision != "fp32":
            r["agreement_with_fp32"] = sum(a == b for a, b in zip(r["tokens"], expected)) / max(len(expected), 1)
            # greedy decoding: after the first token that differs, the rest follow another path
            r["leading_tokens_equal_fp32"] = next((i for i, (a, b) in enumerate(zip(r["tokens"], expected)) if a != b),
                                                  min(len(r["tokens"]), len(expected)))
    for r in cold.values():
        r["wall_s"], r["rss_mb"] = summary(r["wall_s"], 2), summary(r["rss_mb"], 0)
    return {"model": str(args.model), "shape": json.loads((args.model / "build.json").read_text())["shape"],
            "threads": args.threads, "max_new_tokens": args.tokens, "prompt_tokens": len(reference["input_ids"]),
            "reference_tokens": len(expected), "reference_min_top2_margin": reference["min_top2_margin"],
            "warm": warm, "cold": cold}


def spread(s: dict, unit: str) -> str:
    return f"{s['median']} {unit} ({s['min']}–{s['max']})"


def cold_markdown(r: dict) -> str:
    """--cold-only: `edgemm infer` and the raw loop, process → answer."""
    raw = r["cold"]["raw:fp32"]
    rows = ["| candidate | cold start (process → answer) | vs raw | peak RSS (cold) | vs raw | tokens = transformers |",
            "|---|---|---|---|---|---|"]
    for spec, name in (("edgemm-cli", "`edgemm infer`, fp32"), ("raw:fp32", "raw onnxruntime loop, fp32")):
        c = r["cold"][spec]
        rows.append(f"| {name} | {spread(c['wall_s'], 's')} | {c['wall_s']['median'] / raw['wall_s']['median']:.2f}× "
                    f"| {spread(c['rss_mb'], 'MB')} | {c['rss_mb']['median'] / raw['rss_mb']['median']:.2f}× "
                    f"| {'yes' if c['tokens_equal_transformers_reference'] else 'no'} |")
    return "\n".join(rows)


def auto_markdown(warm: dict) -> list[str]:
    """auto against fp32's time to first token and q4's decode speed (medians), where all three ran."""
    auto, fp32, q4 = (warm.get(f"edgemm:{p}") for p in ("auto", "fp32", "q4"))
    if not (auto and fp32 and q4):
        return []
    return ["", f"auto ({auto['precision']}): time to first token {auto['ttft_ms']['median'] / fp32['ttft_ms']['median']:.3f}× "
            f"fp32's, {auto['ttft_ms']['median'] / q4['ttft_ms']['median']:.3f}× q4's; decode tokens/s "
            f"{auto['decode_tokens_per_s']['median'] / q4['decode_tokens_per_s']['median']:.3f}× q4's, "
            f"{auto['decode_tokens_per_s']['median'] / fp32['decode_tokens_per_s']['median']:.3f}× fp32's"]


def markdown(r: dict) -> str:
    raw = r["warm"]["raw:fp32"]["e2e_ms"]["median"] if "raw:fp32" in r["warm"] else float("nan")
    cold_of = {"edgemm:fp32": "edgemm-cli", "raw:fp32": "raw:fp32", "transformers:fp32": "transformers:fp32"}
    names = {"edgemm": "edgemm `Runtime.infer`", "raw": "raw onnxruntime loop", "transformers": "transformers + torch"}
    rows = ["| candidate | warm end-to-end | vs raw | time to first token | decode tokens/s | peak RSS (warm) "
            "| cold start (process → answer) | peak RSS (cold) | tokens = transformers |",
            "|---|---|---|---|---|---|---|---|---|"]
    for spec, w in r["warm"].items():
        name, precision = spec.split(":")
        c = r["cold"].get(cold_of.get(spec, ""))
        cold_text = (spread(c["wall_s"], "s"), f"{c['rss_mb']['max']:.0f} MB") if c else ("–", "–")
        exact = "yes" if w["tokens_equal_transformers_reference"] else \
            f"no ({100 * w.get('agreement_with_fp32', 0):.0f} % agree, first {w.get('leading_tokens_equal_fp32', 0)} equal)"
        rows.append(f"| {names[name]}, {precision} | {spread(w['e2e_ms'], 'ms')} | {w['e2e_ms']['median'] / raw:.3f}× "
                    f"| {spread(w['ttft_ms'], 'ms')} | {spread(w['decode_tokens_per_s'], 'tok/s')} | {w['peak_rss_mb']} MB "
                    f"| {cold_text[0]} | {cold_text[1]} | {exact} |")
    rows += auto_markdown(r["warm"])
    c = r["cold"].get("edgemm-cli no-warm-up")
    if c is None:
        return "\n".join(rows)
    rows.append(f"| `edgemm infer` with `backend.warmup: false`, fp32 | – | – | – | – | – "
                f"| {spread(c['wall_s'], 's')} | {c['rss_mb']['max']:.0f} MB "
                f"| {'yes' if c['tokens_equal_transformers_reference'] else 'no'} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smolvlm-256m", help="a tools/make_sized_model.py shape, built if missing")
    ap.add_argument("--model", type=Path, help="a folder built by tools/make_sized_model.py (instead of --shape)")
    ap.add_argument("--warm", type=int, default=10, help="warm requests per candidate")
    ap.add_argument("--cold", type=int, default=3, help="cold starts per candidate")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens at most")
    ap.add_argument("--cold-only", action="store_true",
                    help="cold starts of `edgemm infer` and the raw loop only (more rounds in the same time)")
    ap.add_argument("--precisions", help="comma-separated variants to run (default: every one in the folder); "
                                         "auto: edgemm's choice after tools/choose_precisions.py measured the folder")
    ap.add_argument("--candidates", default="edgemm,raw,transformers",
                    help="warm candidates, comma-separated (transformers runs fp32 only)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--once", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker or args.once:
        return worker(args.worker or args.once, args, once=bool(args.once))
    if args.model is None:
        # a process of its own: the driver stays small, so children's peak RSS is theirs
        subprocess.run([sys.executable, str(TOOLS / "make_sized_model.py"), args.shape], check=True)
        args.model = SIZED_CACHE / args.shape
    results = bench(args)
    print(json.dumps(results, indent=1))
    print()
    print(cold_markdown(results) if args.cold_only else markdown(results))


if __name__ == "__main__":
    sys.exit(main())
