"""What every model family's fixture is, for the conformance tests all families share.

Each tests/fixtures/<family>-tiny folder is a tiny random transformers model exported to the
Hugging Face ONNX layout, with what transformers' processor and greedy `generate` gave for a
few images and prompts (reference.json; tests/fixtures/make/make_*_fixture.py). tests/test_family_conformance.py
runs the same cases on every one of them (reference tokens, batch = alone, a cached second
question, a missing file named, the int8 graphs through the same path, the pipeline, ...);
a family's own test file keeps only what is its own (its preprocessing maths, special tokens
and refusals) and takes its runtime from here.
"""
from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgemm.config import load_config
from edgemm.engine.runtime import Runtime

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
TOOLS = ROOT / "tools"


def make_runtime(path: Path, **sections) -> Runtime:
    """A runtime on one model folder, one thread, no warm-up; `sections` update the config's."""
    cfg = {"model": {"path": str(path)}, "backend": {"intra_op_threads": 1, "warmup": False}}
    for key, values in sections.items():
        cfg[key] = {**cfg.get(key, {}), **values}
    return Runtime(load_config(cfg))


def maker_command(fixture: FamilyFixture, *args: str) -> list[str]:
    """The fixture maker, run as the repository's scripts outside tools/ are: a module, from the
    repository root (subprocess.run(..., cwd=ROOT))."""
    return [sys.executable, "-m", f"tests.fixtures.make.{Path(fixture.tool).stem}", *fixture.tool_args, *args]


@dataclass(frozen=True)
class FamilyFixture:
    """One fixture folder and what its reference cases mean for the shared tests."""
    name: str  # the fixture's name in test ids
    family: str  # the family load_manifest detects
    folder: str  # under tests/fixtures/
    tool: str  # the tests/fixtures/make/ script that makes it
    tiers: dict[str, int]  # the folder's tiers in order → their image tokens
    default_tier: str
    precisions: list[str]
    tier_of: Callable[[dict], str | None]  # the tier a case was recorded at (None: the folder's one tier)
    image_tokens: Callable[[dict], int]  # how many image tokens a case's prompt has
    pixel_shape: Callable[[dict], tuple[int, ...]]  # the prepared request's pixel_values
    case_label: Callable[[dict], str]
    second_question: tuple[int, int]  # two cases on one image and tier, the second after the first
    batch: tuple[int, ...]  # cases decoded together
    batch_lengths: int  # how many different prompt lengths those rows have (left padding in play)
    int8_cases: tuple[int, ...] = ()
    tool_args: tuple[str, ...] = ()
    tool_imports: tuple[str, ...] = ()  # what the tool imports besides transformers and torch
    pixels_file: str = "reference_pixels.npz"
    pixels_key: str = "case{i}"
    pixel_atol: float = 1e-6
    grid_input: str | None = None  # the encoder input that carries the case's image_grid_thw
    fake_tensorrt: bool = False  # its int8 engines are built against tests/support/fake_tensorrt.py
    unknown_model_type: str = "no_such_vlm"

    @property
    def path(self) -> Path:
        return FIXTURES / self.folder

    @property
    def reference(self) -> dict:
        return _reference(self.path)

    @property
    def cases(self) -> list[dict]:
        return self.reference["cases"]

    @property
    def max_new_tokens(self) -> int:
        return self.reference["max_new_tokens"]

    def reference_pixels(self, i: int) -> np.ndarray:
        return np.load(self.path / self.pixels_file)[self.pixels_key.format(i=i)]

    def encoder_inputs(self, runtime: Runtime, pixel_values: np.ndarray) -> dict[str, np.ndarray]:
        """What the encoder is fed for a request's pixel_values (Qwen2-VL flattens them and adds the grid)."""
        feeds = getattr(runtime.adapter, "encoder_feeds", None)
        return feeds(pixel_values) if feeds else {"pixel_values": pixel_values}


@functools.cache
def _reference(path: Path) -> dict:
    return json.loads((path / "reference.json").read_text())


def _words(case: dict) -> str:
    return f"{case['image']}-{case['prompt'].split()[0]}"


def _qwen_tokens(case: dict) -> int:
    _, h, w = case["image_grid_thw"]
    return h * w // 4  # 2x2 patches merge into one token


def _qwen_shape(case: dict) -> tuple[int, ...]:
    _, h, w = case["image_grid_thw"]
    return (1, h // 2, w // 2, 4, 1176)  # the grid is in the shape


def _qwen(name: str, folder: str) -> FamilyFixture:
    return FamilyFixture(
        name=name, family="qwen2_vl", folder=folder, tool="make_qwen2vl_fixture.py", tool_args=("--family", name),
        tiers={"16x28x28": 16, "32x28x28": 32, "64x28x28": 64}, default_tier="64x28x28",
        precisions=["fp32", "int8"], tier_of=lambda c: f"{c['budget_tokens']}x28x28", image_tokens=_qwen_tokens,
        pixel_shape=_qwen_shape, case_label=lambda c: f"{c['image'][:-4]}-{c['budget_tokens']}",
        second_question=(0, 5), batch=(0, 1, 2, 3), batch_lengths=4,
        int8_cases=(1, 2, 3),  # two grids of one patch count, and another budget
        pixels_file="reference_arrays.npz", pixels_key="case{i}_pixels", grid_input=GRID_INPUTS[name],
        unknown_model_type="qwen9_vl")


GRID_INPUTS = {"qwen2_vl": "grid_thw", "qwen2_5_vl": "image_grid_thw"}

GEMMA3 = FamilyFixture(
    name="gemma3", family="gemma3", folder="gemma3-tiny", tool="make_gemma3_fixture.py",
    tiers={"32x32": 16}, default_tier="32x32", precisions=["fp32", "int8"], tier_of=lambda c: None,
    image_tokens=lambda c: 16, pixel_shape=lambda c: (1, 3, 32, 32), case_label=_words,
    second_question=(0, 2), batch=(1, 2, 3), batch_lengths=2, int8_cases=(0, 1), fake_tensorrt=True)
LLAVA = FamilyFixture(
    name="llava", family="llava", folder="llava-tiny", tool="make_llava_fixture.py",
    tiers={"32x32": 16}, default_tier="32x32", precisions=["fp32", "int8"], tier_of=lambda c: None,
    image_tokens=lambda c: 16, pixel_shape=lambda c: (1, 3, 32, 32), case_label=_words,
    second_question=(0, 2), batch=(1, 2, 3), batch_lengths=2, int8_cases=(0, 1), fake_tensorrt=True)
FASTVLM = FamilyFixture(  # transformers' fast_vlm, read by the llava family; no int8 graphs
    name="fastvlm", family="llava", folder="fastvlm-tiny", tool="make_fastvlm_fixture.py",
    tool_imports=("timm", "transformers"),  # timm needs torchvision, whose wheel needs a matching torch
    tiers={"256x256": 16}, default_tier="256x256", precisions=["fp32"], tier_of=lambda c: None,
    image_tokens=lambda c: 16,  # (256 // 64) ** 2: FastViT-HD's last feature map, no CLS
    pixel_shape=lambda c: (1, 3, 256, 256), case_label=_words, second_question=(0, 2), batch=(1, 2, 3),
    batch_lengths=2)
IDEFICS3 = FamilyFixture(
    name="idefics3", family="idefics3", folder="idefics3-tiny", tool="make_idefics3_fixture.py",
    tiers={"global": 16, "2x2": 5 * 16, "3x3": 10 * 16}, default_tier="3x3", precisions=["fp32", "int8"],
    # the fixture records the processor's size.longest_edge; tiers are named by their tiling
    tier_of=lambda c: {32: "global", 64: "2x2", 96: "3x3"}[c["longest_edge"]],
    image_tokens=lambda c: c["tiles"] * 16, pixel_shape=lambda c: (1, c["tiles"], 3, 32, 32),
    case_label=lambda c: f"{c['image']}-{c['longest_edge']}",
    second_question=(0, 0),  # no two prompts share an image and tier: the same question again
    batch=(0, 1, 2, 3), batch_lengths=4, int8_cases=(0, 1, 2, 3), pixel_atol=1e-5)
INTERNVL = FamilyFixture(
    name="internvl", family="internvl", folder="internvl-tiny", tool="make_internvl_fixture.py",
    tool_imports=("torchvision.transforms.v2.functional",),  # the reference processor's
    tiers={"tiles1": 16, "tiles4": 5 * 16, "tiles6": 7 * 16}, default_tier="tiles6", precisions=["fp32", "int8"],
    tier_of=lambda c: f"tiles{c['max_patches']}", image_tokens=lambda c: c["tiles"] * 16,
    pixel_shape=lambda c: (1, c["tiles"], 3, 32, 32),
    case_label=lambda c: f"{c['image']}-{c['max_patches']}-{c['prompt'].split()[0]}",
    second_question=(0, 4), batch=(0, 1, 3), batch_lengths=3,  # 7, 3 and 3 tiles: prompts of three lengths
    int8_cases=(0, 1, 2, 3), unknown_model_type="internvl_chat")  # the remote-code InternVL's type
QWEN2_VL = _qwen("qwen2_vl", "qwen2-vl-tiny")
QWEN2_5_VL = _qwen("qwen2_5_vl", "qwen2.5-vl-tiny")

FAMILIES = {f.name: f for f in (GEMMA3, LLAVA, FASTVLM, IDEFICS3, INTERNVL, QWEN2_VL, QWEN2_5_VL)}

_RUNTIMES: dict[str, Runtime] = {}


def runtime_of(fixture: FamilyFixture) -> Runtime:
    """One runtime per fixture without the feature cache, shared by every test that only reads."""
    if fixture.name not in _RUNTIMES:
        _RUNTIMES[fixture.name] = make_runtime(fixture.path, cache={"max_bytes": 0})
    return _RUNTIMES[fixture.name]


def answer(runtime: Runtime, fixture: FamilyFixture, case: dict, **options):
    """The runtime's answer to a reference case, at the case's tier, as long as the reference's."""
    options = {"max_new_tokens": fixture.max_new_tokens, **options}
    return runtime.infer(fixture.path / case["image"], case["prompt"], tier=fixture.tier_of(case), **options)


def prepare(runtime: Runtime, fixture: FamilyFixture, case: dict, **options):
    return runtime.prepare(fixture.path / case["image"], case["prompt"], tier=fixture.tier_of(case), **options)
