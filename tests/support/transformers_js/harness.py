"""transformers.js (npm, pinned in package-lock.json beside this file) run on a model folder as it is.

The published ONNX folders (onnx-community, a model's own ONNX release) are made for transformers.js.
`run_given` feeds it the pixel values and prompt ids edgemm prepared (its own image resizing differs
from transformers', which is the reference for pixels); `run_as_user` lets the folder's own
processor and chat template make them, as a user of transformers.js would. Both answer with the
greedy tokens. The npm packages are installed once into a cache folder outside the repository,
`~/.cache/edgemm/transformers-js/<version>` (EDGEMM_TRANSFORMERS_JS_CACHE moves it), with
`ONNXRUNTIME_NODE_INSTALL=skip`: onnxruntime-node's bundled CPU binary is all it needs.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
VERSION = json.loads((HERE / "package.json").read_text())["dependencies"]["@huggingface/transformers"]
RUN_TIMEOUT_S = 300  # one folder's model load and every case it runs
NODE_AT_LEAST = (20, 9)  # sharp, transformers.js's image reader, needs node 20.9 or newer
INSTALLED = ".installed"  # written into the cache folder after `npm ci` succeeded: the lock it installed
# transformers.js's dtype for each of edgemm's precisions (a file suffix): its "q8" loads `_quantized`.
# A dtype it does not know it takes silently for fp32 (utils/dtypes.js selectDtype), so only these are run
DTYPES = {**{p: p for p in ("fp32", "fp16", "int8", "uint8", "q4", "q4f16", "bnb4")}, "quantized": "q8"}


class Unavailable(Exception):
    """Node or npm is missing, or the npm install failed: the one-line reason."""


@dataclass(frozen=True)
class Generated:
    tokens: list[int]  # the new tokens
    input_ids: list[int]  # the prompt transformers.js ran


def cache_dir() -> Path:
    root = os.environ.get("EDGEMM_TRANSFORMERS_JS_CACHE") or Path.home() / ".cache" / "edgemm" / "transformers-js"
    return Path(root) / VERSION


def install() -> Path:
    """The node_modules folder holding transformers.js, installed by `npm ci` when the lock file changed."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        raise Unavailable(f"transformers.js needs node and npm on PATH (node: {node}, npm: {npm})")
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    try:
        major_minor = tuple(int(part) for part in version.lstrip("v").split(".")[:2])
    except ValueError:
        major_minor = (0, 0)
    if major_minor < NODE_AT_LEAST:
        raise Unavailable(f"transformers.js needs node {'.'.join(map(str, NODE_AT_LEAST))} or newer, "
                          f"not {version or 'an unknown version'}")
    target = cache_dir()
    lock = (HERE / "package-lock.json").read_text()
    modules = target / "node_modules"
    # the marker holds the lock it installed and is written only once `npm ci` has succeeded: an
    # install killed half way (a partial node_modules) is done again, never taken for complete
    if (target / INSTALLED).is_file() and (target / INSTALLED).read_text() == lock:
        return modules
    target.mkdir(parents=True, exist_ok=True)
    (target / INSTALLED).unlink(missing_ok=True)
    shutil.copy(HERE / "package.json", target / "package.json")
    shutil.copy(HERE / "package-lock.json", target / "package-lock.json")
    env = {**os.environ, "ONNXRUNTIME_NODE_INSTALL": "skip"}
    try:
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=target, env=env,
                              capture_output=True, text=True, timeout=600)
    except (subprocess.TimeoutExpired, OSError) as e:
        raise Unavailable(f"npm ci of transformers.js {VERSION} in {target} did not finish: "
                          f"{type(e).__name__}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise Unavailable(f"npm ci of transformers.js {VERSION} in {target} failed: {last}")
    marker = target / f"{INSTALLED}.{os.getpid()}"
    marker.write_text(lock)
    os.replace(marker, target / INSTALLED)
    return modules


def encoded(array: np.ndarray) -> dict:
    """A tensor for run.mjs: its dtype, dims and little-endian bytes in base64."""
    dtype = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64", np.dtype(bool): "bool"}[array.dtype]
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return {"dtype": dtype, "dims": list(array.shape), "data": base64.b64encode(data).decode("ascii")}


def _run(folder: Path, dtype: str, max_new_tokens: int, runs: list[dict]) -> list[Generated]:
    if dtype not in DTYPES.values():
        raise ValueError(f"transformers.js would load {dtype!r} as fp32: one of {', '.join(DTYPES.values())}")
    modules = install()
    request = {"folder": str(folder), "dtype": dtype, "max_new_tokens": max_new_tokens, "runs": runs}
    with tempfile.TemporaryDirectory(prefix="edgemm-tjs-") as scratch:
        request_file = Path(scratch) / "request.json"
        request_file.write_text(json.dumps(request))
        # run.mjs is an ES module, whose imports NODE_PATH does not reach: it runs from a copy
        # beside the node_modules it was installed into
        script = modules.parent / "run.mjs"
        if not script.is_file() or script.read_bytes() != (HERE / "run.mjs").read_bytes():
            # copied beside it, then renamed: a suite running at the same time never reads half of it
            copy = script.with_name(f"run.{os.getpid()}.mjs")
            shutil.copy(HERE / "run.mjs", copy)
            os.replace(copy, script)
        done = subprocess.run(["node", str(script), str(request_file)], capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"transformers.js failed on {folder} ({dtype}):\n{done.stderr.strip()}")
    answers = json.loads(done.stdout.strip().splitlines()[-1])["answers"]
    return [Generated(tokens=a["tokens"], input_ids=a["input_ids"]) for a in answers]


def run_given(folder: Path, inputs: list[dict[str, np.ndarray]], max_new_tokens: int,
              dtype: str = "fp32") -> list[Generated]:
    """Greedy tokens for each request's generate() inputs (input_ids, attention_mask, pixel_values,
    the family's own), one model load for them all; `dtype` names the graphs' precision as
    transformers.js does (DTYPES: edgemm's precision → its name)."""
    runs = [{"inputs": {name: encoded(value) for name, value in one.items()}} for one in inputs]
    return _run(folder, dtype, max_new_tokens, runs)


def run_as_user(folder: Path, questions: list[tuple[Path, str]], max_new_tokens: int,
                dtype: str = "fp32") -> list[Generated]:
    """Greedy tokens for each (image, question), through the folder's own processor and chat template."""
    return _run(folder, dtype, max_new_tokens, [{"image": str(image), "prompt": prompt} for image, prompt in questions])
