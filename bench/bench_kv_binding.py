#!/usr/bin/env python3
"""The decoder's KV cache between steps: `session.run` with numpy feeds against onnxruntime's
IOBinding with the cache kept as OrtValues, through edgemm's own decode loop, side by side.

    python -m bench.bench_kv_binding [--model DIR] [--rounds 20] [--threads 1] [--tokens 32]

Both candidates run the same Generator and DecodingBatch (edgemm/engine/decode.py) on the same
onnxruntime session; only the decoder component's run differs:

  session.run   edgemm's OrtComponent: numpy arrays in, numpy arrays out. onnxruntime wraps
                a C-contiguous numpy input without copying it and hands each output back as a
                numpy array over onnxruntime's own buffer (no copy either), so a step's present
                tensors become the next step's past without a copy already
  IOBinding     BoundDecoder (tests/support/bound_decoder.py): every present output stays the OrtValue onnxruntime
                allocated and is bound as the next step's past with bind_ortvalue_input (never
                wrapped again); the loop gets zero-copy numpy views of the same OrtValues for
                what it does in numpy (row gathers, merges, the prefix cache's views)

The candidates alternate request by request (the order swapped each round), on one prompt
(the folder's reference.json prompt and image if it has one, else the built-in model's
"describe the image" on a generated scene at the top tier), stop tokens honoured, the
feature and prefix caches off. Per request: wall time of the decode phase per token, and the
calling thread's CPU time for the whole decode (with --threads 1 onnxruntime computes on that
thread, so this is the work done, whatever else the machine runs). Tokens must be equal.
Prints JSON, then a Markdown table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from edgemm.config import load_config  # noqa: E402
from edgemm.engine.decode import BatchItem, generate  # noqa: E402
from edgemm.engine.generate import Generator  # noqa: E402
from edgemm.engine.runtime import Runtime  # noqa: E402
from edgemm.model.scenes import make_scene  # noqa: E402
from tests.support.bound_decoder import BoundDecoder  # noqa: E402


def request_for(rt: Runtime, model: Path):
    reference = model / "reference.json"
    if reference.is_file():
        ref = json.loads(reference.read_text())
        return rt.prepare(model / ref["image"], ref["prompt"], tier=ref.get("tier"))
    top = max(rt.manifest.tiers.values(), key=lambda t: t.pixels).name
    return rt.prepare(make_scene(300_000, n_shapes=4).image, "describe the image", tier=top)


def bench(model: Path, rounds: int, threads: int, tokens: int) -> dict:
    rt = Runtime(load_config({"model": {"path": str(model)},
                              "backend": {"intra_op_threads": threads, "warmup": False},
                              "cache": {"max_bytes": 0}}))
    g = rt.generator
    generators = {"session.run": g,
                  "IOBinding": Generator(g.encoder, g.embed, BoundDecoder(g.decoder), g.max_context, g.stop_ids)}
    request = request_for(rt, model)
    request.options = dataclasses.replace(request.options, max_new_tokens=tokens)
    features = rt.encode(request.pixel_values, [None])
    item = BatchItem(features, request.prompt.input_ids, request.prompt.image_positions, request.options)
    runs: dict[str, dict[str, list[float]]] = {name: {"decode_ms_per_token": [], "cpu_ms": []} for name in generators}
    answers = {name: generate(gen, item).tokens for name, gen in generators.items()}  # untimed: allocates
    for round_ in range(rounds):
        order = list(generators) if round_ % 2 == 0 else list(generators)[::-1]
        for name in order:
            cpu = time.thread_time()
            generation = generate(generators[name], item)
            runs[name]["cpu_ms"].append((time.thread_time() - cpu) * 1e3)
            steps = max(len(generation.tokens), 1)
            runs[name]["decode_ms_per_token"].append(generation.timings_ms["decode"] / steps)
            assert generation.tokens == answers[name], f"{name}: tokens changed between runs"
    assert answers["IOBinding"] == answers["session.run"], "IOBinding and session.run gave different tokens"
    result = {"model": rt.manifest.name, "layers": g.layers, "prompt_tokens": int(item.input_ids.shape[1]),
              "tokens": len(answers["session.run"]), "threads": threads, "rounds": rounds}
    for name, r in runs.items():
        result[name] = {k: {"median": round(statistics.median(v), 4), "min": round(min(v), 4),
                            "max": round(max(v), 4)} for k, v in r.items()}
    for k in ("decode_ms_per_token", "cpu_ms"):
        paired = [b / a for a, b in zip(runs["session.run"][k], runs["IOBinding"][k])]
        result[f"IOBinding / session.run, {k}, paired median"] = round(statistics.median(paired), 4)
    return result


def markdown(r: dict) -> str:
    rows = [f"| {r['model']} ({r['layers']} layers, {r['prompt_tokens']}-token prompt, {r['tokens']} tokens, "
            f"{r['threads']} thread(s), {r['rounds']} rounds) | session.run | IOBinding | IOBinding / session.run (paired) |",
            "|---|---|---|---|"]
    for k, label in (("decode_ms_per_token", "decode, ms per token (wall)"), ("cpu_ms", "decode, CPU ms of the calling thread")):
        a, b = r["session.run"][k], r["IOBinding"][k]
        rows.append(f"| {label} | {a['median']} ({a['min']}–{a['max']}) | {b['median']} ({b['min']}–{b['max']}) "
                    f"| {r[f'IOBinding / session.run, {k}, paired median']:.3f}× |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-vlm")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens at most")
    args = ap.parse_args()
    result = bench(args.model, args.rounds, args.threads, args.tokens)
    print(json.dumps(result, indent=1))
    print()
    print(markdown(result))


if __name__ == "__main__":
    main()
