"""Model folders as they are published, made in a test's tmp_path from the committed fixtures:

- `only_variant(src, dst, "q4")`: a copy holding each graph in that one precision and no fp32
  (what `--include onnx/*_q4.onnx` downloads);
- `published_int8(src, dst)`: a copy whose only graphs are `_int8` files of dynamic int8, as
  transformers.js's scripts/quantize.py makes them (tests/fixtures/make/published_variants.py:
  MatMul and Conv become DynamicQuantizeLinear + MatMulInteger / ConvInteger with per-tensor
  weights, the embedding table's rows dequantized after the Gather), not edgemm's QDQ. The
  weights are the recipe's uint8 ones: onnxruntime 1.23, the newest for Python 3.10 (JetPack
  6's), has no ConvInteger for int8 weights, and the kind (dynamic int8) is what the tests need.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx

from edgemm.model.manifest_types import PRECISIONS
from tests.fixtures.make.published_variants import variant

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ("vision_encoder", "embed_tokens", "decoder_model_merged")


def graphs_folder(folder: Path) -> Path:
    """Where a folder's graphs are: onnx/ in a Hugging Face folder, the folder itself with model.yaml."""
    return folder / "onnx" if (folder / "onnx").is_dir() else folder


def _without_graphs(_folder, names):
    return [n for n in names if n.endswith(".onnx")]


def only_variant(src: Path, dst: Path, precision: str) -> Path:
    """`src` copied to `dst` with each graph only as its `precision` file: taken from `src` where it
    has one, else made by tools/quantize.py --variant `precision` from the fp32 graphs."""
    shutil.copytree(src, dst, ignore=_without_graphs)
    have = graphs_folder(src)
    if not all((have / f"{g}_{precision}.onnx").is_file() for g in GRAPHS):
        made = dst.with_name(dst.name + "-made")
        shutil.copytree(src, made)
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "quantize.py"), str(made), "--variant", precision],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        have = graphs_folder(made)
    for graph in GRAPHS:
        shutil.copy(have / f"{graph}_{precision}.onnx", graphs_folder(dst) / f"{graph}_{precision}.onnx")
    return dst


def published_int8(src: Path, dst: Path) -> Path:
    """`src` copied to `dst` with only `_int8` graphs, each dynamic int8 made from `src`'s fp32 graph."""
    shutil.copytree(src, dst, ignore=_without_graphs)
    for graph in GRAPHS:
        onnx.save(variant(graphs_folder(src) / f"{graph}.onnx", "uint8"), str(graphs_folder(dst) / f"{graph}_int8.onnx"))
    return dst


def variants_in(folder: Path) -> set[str]:
    """The precisions of the graph files in `folder`."""
    names = [p.stem for p in graphs_folder(folder).glob("*.onnx")]
    return {next((p for p in PRECISIONS[1:] if n.endswith(f"_{p}")), "fp32") for n in names}


def batch_mate_difference(decoder) -> float:
    """How far a decoder component's logits for one row move when a batch mate of a larger
    magnitude is prefilled beside it (0.0: its rows are exact alone or batched)."""
    width = decoder.inputs["inputs_embeds"].shape[-1]
    x = np.random.default_rng(0).normal(size=(2, 5, width)).astype(np.float32)
    x[1] *= 50  # a batch mate of a larger magnitude
    past = {n: np.zeros((2, s.shape[1], 0, s.shape[3]), np.float32)
            for n, s in decoder.inputs.items() if n.startswith("past_key_values")}
    feeds = {"inputs_embeds": x, "attention_mask": np.ones((2, 5), np.int64),
             "position_ids": np.tile(np.arange(5), (2, 1)), **past}
    together = decoder.run(feeds)["logits"][0]
    alone = decoder.run({k: v[:1] for k, v in feeds.items()})["logits"][0]
    return float(np.abs(together - alone).max())
