"""The dataclasses a model folder is read into: what every family and reader shares.

model.yaml (edgemm.model.manifest) and Hugging Face folders (edgemm.model.hf_folder)
both end as a ModelManifest; the families (edgemm.model.families) read it. Kept apart
from both readers so that imports point one way: readers and families → this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edgemm.errors import InputError, ModelError

COMPONENTS = ("vision_encoder", "embed_tokens", "decoder")
PRECISIONS = ("fp32", "fp16", "int8")


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
    family_config: dict = field(default_factory=dict)  # what the family adapter needs beyond this

    def tier(self, name: str | None) -> ResolutionTier:
        name = name or self.default_tier
        if name not in self.tiers:
            raise InputError(f"unknown tier {name!r} for model {self.name} "
                             f"(tiers: {', '.join(self.tiers)})")
        return self.tiers[name]

    def graph_path(self, component: str, precision: str) -> Path:
        """The ONNX file of `component` in `precision`, by the Optimum suffix convention."""
        base = self.path / self.files[component]
        if precision == "fp32":
            path = base
        else:
            path = base.with_name(f"{base.stem}_{precision}{base.suffix}")
        if not path.is_file():
            hint = (f"; make it with: python tools/quantize.py {self.path}"
                    if precision == "int8" else "")
            raise ModelError(f"model {self.name}: {component} has no {precision} graph "
                             f"({path} not found){hint}")
        return path
