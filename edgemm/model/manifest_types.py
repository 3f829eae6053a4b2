"""The dataclasses a model folder is read into: what every family and reader shares.

model.yaml (edgemm.model.manifest) and Hugging Face folders (edgemm.model.hf_folder)
both end as a ModelManifest; the families (edgemm.model.families) read it. Kept apart
from both readers so that imports point one way: readers and families → this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edgemm.errors import InputError, ModelError
from edgemm.util.files import regular_file_present

COMPONENTS = ("vision_encoder", "embed_tokens", "decoder")
# Precision variants, named by the file suffix of the Hugging Face ONNX layout (Optimum,
# transformers.js): decoder_model_merged_q4.onnx is the decoder's q4 variant; fp32 has none.
#   fp16       float16 graph
#   int8       QDQ int8 where tools/quantize.py made it (what TensorRT builds from; slow on onnxruntime's
#              CPU), dynamic int8 where transformers.js's quantize script did (published folders):
#              edgemm.model.quantization reads which from the graph
#   q4         weight-only 4-bit MatMulNBits (tools/quantize.py --variant q4): the CPU's fastest
#   q4f16      q4 over a float16 graph (for GPUs)
#   quantized  dynamic int8 (onnxruntime's quantize_dynamic; tools/quantize.py --variant quantized)
#   uint8      dynamic int8 with uint8 weights: the layout's other name for it
#   bnb4       weight-only 4-bit NF4/FP4 MatMulBnb4
PRECISIONS = ("fp32", "fp16", "int8", "q4", "q4f16", "quantized", "uint8", "bnb4")
QUANTIZE_VARIANTS = ("int8", "q4", "q4f16", "quantized", "fp16", "bnb4")  # tools/quantize.py makes these
AUTO = "auto"  # model.precision / --precision: the fastest variant present for the device
# What `auto` takes, fastest first, by backend. onnxruntime's CPU provider: q4, the fewest weight
# bytes per token (docs/BENCHMARKS.md, "CPU quantization at real size"), else fp32. Never the QDQ
# int8 (slower than fp32 there), nor dynamic int8 (quantized, uint8): it scales the activations
# per call over the whole batch, so a row's tokens would depend on the rows decoded beside it
# (tests/test_precisions.py); q4 quantizes them per row and block. bnb4 is unmeasured: by name only.
# TensorRT: its engines are built int8 (from the QDQ graphs) or fp16.
AUTO_ORDER = {"onnxruntime": ("q4", "fp32"),
              "tensorrt": ("int8", "fp16")}
# A graph with none of AUTO_ORDER's variants (a folder published with only `_fp16`, or only a
# dynamic `_int8`) runs the one it has: the first of these present. Whether its rows batch
# exactly is read from the graph itself (edgemm.model.quantization), not from this name.
AUTO_FALLBACK = {"onnxruntime": ("fp16", "q4f16", "bnb4", "int8", "uint8", "quantized")}


def variant_file(base: Path, precision: str) -> Path:
    """The file of a graph's `precision` variant: `base` itself for fp32, else base_<precision>.onnx."""
    return base if precision == "fp32" else base.with_name(f"{base.stem}_{precision}{base.suffix}")


@dataclass(frozen=True)
class ResolutionTier:
    name: str
    height: int
    width: int
    image_tokens: int  # placeholders the prompt gets for this tier

    @property
    def pixels(self) -> int:
        return self.height * self.width


@dataclass(frozen=True)
class Preprocessing:
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    color: str = "rgb"
    resize: str = "stretch"


@dataclass
class ModelManifest:
    path: Path
    name: str
    family: str
    files: dict[str, str]
    tiers: dict[str, ResolutionTier]  # ordered from cheapest to richest
    default_tier: str
    preprocessing: Preprocessing
    special_tokens: dict[str, str]
    image_token: str
    prompt_format: str
    stop_tokens: list[str]
    max_context: int
    precisions: list[str] = field(default_factory=lambda: ["fp32"])
    decoder: dict = field(default_factory=dict)
    chat_template: str | None = None  # Jinja chat template (Hugging Face folders)
    chat_template_file: Path | None = None  # the file it was read from, for the error messages
    family_config: dict = field(default_factory=dict)  # what the family adapter needs beyond this

    def tier(self, name: str | None) -> ResolutionTier:
        name = name or self.default_tier
        if name not in self.tiers:
            raise InputError(f"unknown tier {name!r} for model {self.name} "
                             f"(tiers: {', '.join(self.tiers)})")
        return self.tiers[name]

    def encoder_images(self, tier: ResolutionTier) -> int:
        """The most encoder inputs one image makes at `tier`: a tiled family's tiles plus its
        global image or thumbnail (its image tokens over one tile's, `image_seq_len`), else 1."""
        per_tile = self.family_config.get("image_seq_len")
        return max(1, tier.image_tokens // per_tile) if per_tile else 1

    def graph_path(self, component: str, precision: str) -> Path:
        """The ONNX file of `component` in `precision`, by the Optimum suffix convention; one line
        naming, per graph, the precisions present and the graphs `precision` is missing for,
        where it is not there."""
        path = variant_file(self.path / self.files[component], precision)
        if not regular_file_present(path, lambda detail: ModelError(f"{path}: {detail}")):
            by_graph = self.graph_precisions()
            present = ", ".join(self.precisions) or "none for all three graphs"
            missing = [c for c, found in by_graph.items() if precision not in found]
            hint = ""
            if precision in QUANTIZE_VARIANTS:
                hint = f"; make it with: python tools/quantize.py {self.path}"
                hint += "" if precision == "int8" else f" --variant {precision}"
            raise ModelError(f"model {self.name}: {component} has no {precision} graph "
                             f"({path} not found; precisions present: {present}; {precision} missing for "
                             f"{', '.join(missing)}; per graph: {describe_graphs(by_graph)}){hint}")
        return path

    def has_graph(self, component: str, precision: str) -> bool:
        return variant_file(self.path / self.files[component], precision).is_file()

    def graph_precisions(self) -> dict[str, list[str]]:
        """component → the precisions its graph is present in (read from the folder now: a
        variant made after loading counts)."""
        return graph_precisions(self.path, self.files)


def graph_precisions(path: Path, files: dict[str, str]) -> dict[str, list[str]]:
    """component → the precisions whose file of that graph is in the folder `path`
    (files: component → fp32 file), in PRECISIONS order."""
    return {c: [p for p in PRECISIONS if variant_file(path / files[c], p).is_file()] for c in COMPONENTS}


def describe_graphs(by_graph: dict[str, list[str]]) -> str:
    """`vision_encoder fp32, q4 · embed_tokens q4 · decoder none`: each graph's precisions, one line."""
    return " · ".join(f"{c} {', '.join(found) or 'none'}" for c, found in by_graph.items())


def precisions_present(path: Path, files: dict[str, str]) -> list[str]:
    """The precisions whose graphs are all in the folder `path` (files: component → fp32 file):
    what ModelManifest.precisions lists; a folder may have none (each graph in another)."""
    by_graph = graph_precisions(path, files)
    return [p for p in PRECISIONS if all(p in found for found in by_graph.values())]
