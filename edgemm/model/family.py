"""Model families: the one interface the runtime uses, and the registry that finds them.

A family turns an image into pixel values and a user prompt into input ids, and the
generated ids back into text. Each family is one module in edgemm/model/families/ that
registers itself by model type:

    @register("idefics3", "smolvlm", hf_folder=read_hf_folder)
    class Idefics3: ...

The key is the model type: `family:` in model.yaml, `model_type` in a Hugging Face
folder's config.json (as transformers.js keys its model registry). The first name is
the family's own, written into ModelManifest.family. `hf_folder` is for families whose
published folders have no model.yaml: it reads what the family needs from the folder's
JSON files (edgemm.model.hf_folder fills in the rest).

This module imports no family. The registry imports every module of the package
edgemm.model.families the first time it is asked, so a new family is one new file there;
a family from elsewhere calls `register` itself before its models are loaded.
"""
from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np
from tokenizers import Tokenizer

from edgemm.errors import InputError, ModelError
from edgemm.model.manifest_types import ModelManifest, Preprocessing, ResolutionTier
from edgemm.model.tokenizer import load_tokenizer, token_id

BUILTIN_FAMILIES = "edgemm.model.families"
LOAD_CHECK_PROMPT = "describe the image"  # what a family's chat template is rendered with at load


@dataclass
class Prompt:
    input_ids: np.ndarray  # int64 [1, S], image placeholders expanded
    image_start: int  # index of the first image placeholder
    image_tokens: int  # how many placeholders (= encoder output tokens)
    # words of the user's text the vocabulary does not have (they read as <unk>), in order;
    # a byte-level BPE (idefics3) has none
    unknown_words: tuple[str, ...]
    # where the encoder's output tokens go, in order; one contiguous run unless given
    image_positions: np.ndarray | None = None
    # a family with its own rotary positions (Qwen2-VL's M-RoPE, see GraphInputs): the
    # prompt's position ids [axes, 1, S], and what every decode step adds, on every axis, to
    # the tokens the row holds so far. None: positions are 0 … S-1 (cumsum of the mask)
    position_ids: np.ndarray | None = None
    rope_delta: int = 0
    # the positions as a slice when they are the one run made here (else None): the decode
    # loop places the image features through it, at a third of an index array's cost
    image_span: slice | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.image_positions is None:
            self.image_positions = np.arange(self.image_start, self.image_start + self.image_tokens)
            self.image_span = slice(self.image_start, self.image_start + self.image_tokens)


@runtime_checkable
class Family(Protocol):
    """What the runtime asks of a loaded model's family (Runtime.adapter).

    Optional: `reuses_image_prefix: bool` (True when absent). The decode loop keeps the
    KV cache of the prompt up to the last image placeholder and reuses it for the next
    question about the same image; that is exact only if no position of that prefix
    attends to the text after it. A family whose decoder lets it (a prefix-LM that
    attends bidirectionally over image and question) sets it False."""

    manifest: ModelManifest
    tokenizer: Tokenizer
    stop_ids: set[int]  # generation ends at any of these
    # questions the model was trained to answer, shown when a prompt has unknown words
    # (Prompt.unknown_words); empty when the family cannot say (an open-vocabulary model)
    known_prompts: tuple[str, ...]

    def pixels(self, rgb: np.ndarray, tier: ResolutionTier) -> np.ndarray:
        """RGB8 [H, W, 3] → the vision encoder's pixel_values at `tier` (float32, batch of 1)."""
        ...

    def build_prompt(self, prompt: str, tier: ResolutionTier, image_size: tuple[int, int] | None = None) -> Prompt:
        """The user's text → input ids with the image placeholders for an image of `image_size` (h, w)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Generated ids → the answer's text (stop tokens left out)."""
        ...

    # Optional (not part of the isinstance check): `graph_inputs: GraphInputs`, what the family
    # feeds beyond the contract (Qwen2-VL: the encoder's grid, [3, B, S] positions); and, on the
    # class, `encoder_patches(manifest, tier) -> EncoderPatches` for an encoder that takes its
    # image as flattened patches (Qwen2-VL): what the engine builder sizes its profiles by; and
    # `image_tokens_from: str`, the keys the prompt's image-token count comes from (the load
    # check, edgemm/engine/contract.py's check_image_tokens, names them when the encoder disagrees).


class TokenizedFamily:
    """What every built-in family does the same way around its tokenizer; a family class
    inherits it. It keeps the manifest and its family_config (`cfg`), loads the folder's
    tokenizer, looks tokens up and decodes answers (Family.decode)."""

    stop_ids: set[int]  # the family's own __init__ fills it

    def __init__(self, manifest: ModelManifest):
        self.manifest = manifest
        self.cfg = manifest.family_config
        # where the prompt's image-token count comes from, for the load check's message
        self.image_tokens_from: str = self.cfg.get("image_tokens_from", "model.yaml: the tier's image_tokens")
        self.tokenizer = load_tokenizer(manifest.path / manifest.files["tokenizer"])

    def id_of(self, token: str) -> int:
        """The token's id; a ModelError naming the model folder when the vocabulary lacks it."""
        return token_id(self.tokenizer, token, f"{self.manifest.path}: token {token!r}")

    def decode(self, ids: list[int]) -> str:
        """Generated ids → the answer's text: stop tokens and special tokens left out."""
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=True)


@dataclass(frozen=True)
class GraphInputs:
    """What a family feeds the graphs beyond the model contract's own inputs, as its
    optional attribute `graph_inputs` (a family without one has the default: pixel_values
    alone, position_ids [B, S]). edgemm/engine/contract.py checks a loaded graph against it,
    by name: a graph missing an input the family fills, or declaring one nobody fills, is
    refused at load."""
    # vision_encoder inputs besides pixel_values that `encoder_feeds` fills (Qwen2-VL: grid_thw)
    encoder: tuple[str, ...] = ()
    # leading axes of position_ids before [B, S] (M-RoPE: 3, temporal/height/width); 0: [B, S].
    # With axes, Prompt.position_ids and Prompt.rope_delta give each row's positions
    position_axes: int = 0
    # pixel values of a batch of same-shape images (as Family.pixels made them, stacked) → the
    # encoder's feeds, pixel_values included; its image_features may be [B·N, D]
    encoder_feeds: Callable[[np.ndarray], dict[str, np.ndarray]] | None = None
    # those feeds of several images → one image's feeds each, in order (Qwen2-VL: the grid's
    # rows, and each row's patches): how an encoder that takes one image per call (a static
    # DLA plan) runs a batch; the features of the parts, concatenated, are the batch's
    split_encoder_feeds: Callable[[dict[str, np.ndarray]], list[dict[str, np.ndarray]]] | None = None
    # the shape of the encoder's pixel_values as the family feeds them, an int for each axis whose
    # size the folder's config fixes, None for one that varies (Qwen2-VL: (None, 1176), the patch
    # row's channels x temporal copies x patch²): a graph that declares another static size is
    # refused at load, not inside the first request. () checks nothing
    pixel_values: tuple[int | None, ...] = ()
    pixel_values_from: str = "the folder's preprocessing config"  # where those sizes come from, for the message


def graph_inputs(family: object) -> GraphInputs:
    """The family's GraphInputs, or the default for a family that has none."""
    return getattr(family, "graph_inputs", None) or GraphInputs()


@dataclass(frozen=True)
class EncoderPatches:
    """The rows of flattened patches ([N, patch values]) one image makes at a tier, for a family
    whose vision encoder takes them so (Qwen2-VL) instead of pixels [B, 3, H, W]: what a TensorRT
    profile must hold. The family says it with `encoder_patches(manifest, tier)` on its class."""
    least: int  # the fewest any image makes (one image token's patches)
    budget: int  # an image that takes the tier's whole budget: the shape to optimise for
    most: int  # the most any image makes at the tier (an elongated one may pass its budget)
    square: int  # the tier's own square image (tier.height x tier.width): a static plan's one shape


PatchCounter = Callable[[ModelManifest, ResolutionTier], EncoderPatches]


@dataclass
class FamilyFields:
    """What a family reads from a Hugging Face folder for its ModelManifest."""
    tiers: dict[str, ResolutionTier]  # cheapest first
    preprocessing: Preprocessing
    image_token: str
    stop_tokens: list[str]
    family_config: dict  # whatever else the family's adapter needs (ModelManifest.family_config)
    default_tier: str | None = None  # None: the richest tier

    @classmethod
    def normalised(cls, cfg: dict, resize: str, tiers: dict[str, ResolutionTier], image_token: str,
                   stop_tokens: list[str]) -> FamilyFields:
        """The fields of a family whose `cfg` (its family_config) has the RGB image_mean and
        image_std the pixels are normalised by, and whose images are resized by `resize`."""
        return cls(tiers=tiers, image_token=image_token, stop_tokens=stop_tokens, family_config=cfg,
                   preprocessing=Preprocessing(tuple(cfg["image_mean"]), tuple(cfg["image_std"]), "rgb", resize))


def one_tier(height: int, width: int, image_tokens: int) -> dict[str, ResolutionTier]:
    """The tiers of a family that takes every image at one size: one, named `{height}x{width}`."""
    name = f"{height}x{width}"
    return {name: ResolutionTier(name, height, width, image_tokens)}


HFReader = Callable[[Path, dict], FamilyFields]  # (folder, its config.json) → the family's fields


@dataclass(frozen=True)
class FamilyEntry:
    name: str  # ModelManifest.family of the models it loads
    model_types: tuple[str, ...]
    adapter: Callable[[ModelManifest], Family]  # the family's class
    hf_folder: HFReader | None = None  # None: its models come with a model.yaml


_registry: dict[str, FamilyEntry] = {}  # model type → family
_discovered = False
_lock = threading.RLock()  # a family module registers from inside the discovery's import
F = TypeVar("F")


def register(name: str, *model_types: str, hf_folder: HFReader | None = None) -> Callable[[F], F]:
    """Class decorator: the class is the family `name`, also known by `model_types`."""
    def add(cls: F) -> F:
        entry = FamilyEntry(name, (name, *model_types), cls, hf_folder)  # type: ignore[arg-type]
        with _lock:
            for key in entry.model_types:
                known = _registry.get(key)
                # the same class again is its module imported twice (e.g. reloaded), not a clash
                if known is not None and _where(known.adapter) != _where(cls):
                    raise ValueError(f"model type {key!r} is already the family {known.name}")
            _registry.update(dict.fromkeys(entry.model_types, entry))
        return cls
    return add


def _where(cls: object) -> str:
    return f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', repr(cls))}"


def _discover() -> None:
    """Import every module of edgemm.model.families once; each registers its family."""
    global _discovered
    with _lock:
        if _discovered:
            return
        package = importlib.import_module(BUILTIN_FAMILIES)
        for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            if not module.name.startswith("_"):
                importlib.import_module(f"{BUILTIN_FAMILIES}.{module.name}")
        _discovered = True


def registered() -> dict[str, FamilyEntry]:
    """Every known model type → its family (the built-in ones and any registered since)."""
    _discover()
    with _lock:
        return dict(_registry)


def family_entry(model_type: object, refused: str, hf_folder: bool = False) -> FamilyEntry:
    """The family of `model_type`, or a one-line ModelError starting with `refused` that
    names the known model types. `hf_folder`: only families that read Hugging Face folders."""
    known = {k: e for k, e in registered().items() if e.hf_folder is not None or not hf_folder}
    entry = known.get(model_type) if isinstance(model_type, str) else None
    if entry is None:
        hint = ""
        if isinstance(model_type, str) and model_type in registered():
            hint = f"; {model_type} models are folders with a model.yaml"
        raise ModelError(f"{refused} {model_type!r} (known: {', '.join(sorted(known))}){hint}")
    return entry


def _entry_of(manifest: ModelManifest) -> FamilyEntry:
    where = Path(manifest.path) / "model.yaml"
    return family_entry(manifest.family, f"{where}: unknown family")


def family_for(manifest: ModelManifest) -> Family:
    """The family adapter for a loaded manifest, by ModelManifest.family.

    A family with a chat template (its `chat_text`) renders it once here, so that a template
    that fails is said at load, one line naming it, whatever backend.warmup says: `serve`
    refuses to start rather than fail every request."""
    family = _entry_of(manifest).adapter(manifest)
    chat_text = getattr(family, "chat_text", None)
    if chat_text is not None:
        try:
            chat_text(LOAD_CHECK_PROMPT)
        except InputError as e:  # the template's raise_exception: it would refuse every request like it
            raise ModelError(f"{manifest.chat_template_file or manifest.path}: the chat template refuses "
                             f"the prompt {LOAD_CHECK_PROMPT!r}: {e}") from None
    return family


adapter_for = family_for  # the name the runtime has always called


def encoder_patches(manifest: ModelManifest) -> PatchCounter | None:
    """The family's `encoder_patches`, asked of its class (no tokenizer is loaded), or None for a
    family whose encoder takes pixels."""
    return getattr(_entry_of(manifest).adapter, "encoder_patches", None)
