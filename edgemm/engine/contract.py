"""The model contract, checked against what a loaded graph actually declares.

A graph exported with other tensor names fails here, at load time, with the
missing name spelled out, instead of deep inside the first request; so does a
folder whose prompt would hold another number of image tokens than its encoder
gives (check_image_tokens).
"""
from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from edgemm.backends.base import Component
from edgemm.errors import ModelError
from edgemm.model.family import LOAD_CHECK_PROMPT, Family, GraphInputs, graph_inputs
from edgemm.model.manifest_types import ModelManifest

REQUIRED = {
    "vision_encoder": (("pixel_values",), ("image_features",)),
    "embed_tokens": (("input_ids",), ("inputs_embeds",)),
    "decoder": (("inputs_embeds", "attention_mask"), ("logits",)),
}
# position_ids: a graph may compute them from the mask (transformers.js feeds them only when
# declared); a family with positions of its own (M-RoPE, GraphInputs.position_axes) requires them
OPTIONAL_DECODER_INPUTS = ("position_ids", "use_cache_branch", "num_logits_to_keep")
OPTIONAL_ENCODER_INPUTS = ("pixel_attention_mask",)  # tiled families (idefics3); fed all ones
_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")


def decoder_layers(component: Component) -> int:
    """Number of decoder layers, counted from the declared past_key_values inputs."""
    layers = {int(m.group(1)) for m in map(_PAST.match, component.inputs) if m}
    return len(layers)


def check_component(kind: str, component: Component, path: str, fed: GraphInputs | None = None) -> None:
    """Refuse a graph whose names or position layout differ from the contract plus what the
    family feeds (`fed`: its GraphInputs; None: the default, no extra inputs)."""
    fed = fed or GraphInputs()
    want_in, want_out = REQUIRED[kind]
    if kind == "vision_encoder":
        want_in = (*want_in, *fed.encoder)
    for name in want_in:
        if name not in component.inputs:
            by = "the model's family feeds it" if name in fed.encoder else "required by the model contract"
            raise ModelError(f"{path}: {kind} graph lacks input '{name}' ({by}; it declares: "
                             f"{', '.join(component.inputs)})")
    for name in want_out:
        if name not in component.outputs:
            raise ModelError(f"{path}: {kind} graph lacks output '{name}' required by the model "
                             f"contract (it declares: {', '.join(component.outputs)})")
    if kind == "vision_encoder":
        extra = [n for n in component.inputs if n not in (*want_in, *OPTIONAL_ENCODER_INPUTS)]
        if extra:
            raise ModelError(f"{path}: vision_encoder graph has inputs the runtime does not know how to "
                             f"feed: {', '.join(extra)}")
        _check_pixel_values(component, path, fed.pixel_values, fed.pixel_values_from)
    if kind != "decoder":
        return
    if "position_ids" in component.inputs:
        _check_positions(component, path, fed.position_axes)
    elif fed.position_axes:
        raise ModelError(f"{path}: decoder graph lacks input 'position_ids' (the model's family feeds "
                         f"[{fed.position_axes}, batch, sequence] rotary positions; it declares: "
                         f"{', '.join(component.inputs)})")
    layers = decoder_layers(component)
    if layers == 0:
        raise ModelError(f"{path}: decoder graph declares no past_key_values.N.key/value inputs "
                         "(the runtime needs the merged decoder with a KV cache)")
    for i in range(layers):
        for kind_kv in ("key", "value"):
            for name, table in ((f"past_key_values.{i}.{kind_kv}", component.inputs),
                                (f"present.{i}.{kind_kv}", component.outputs)):
                if name not in table:
                    raise ModelError(f"{path}: decoder graph lacks '{name}' "
                                     f"(it has {layers} layers of past_key_values)")
    known = set(want_in) | set(OPTIONAL_DECODER_INPUTS)
    extra = [n for n in component.inputs if n not in known and not _PAST.match(n)]
    if extra:
        raise ModelError(f"{path}: decoder graph has inputs the runtime does not know how to feed: "
                         f"{', '.join(extra)}")


def _check_positions(component: Component, path: str, axes: int) -> None:
    """position_ids must have the rank the family fills: [B, S], or [axes, B, S] (M-RoPE)."""
    shape = component.inputs["position_ids"].shape
    if shape is None:  # a rank the graph leaves open: the family's positions are fed as they are
        return
    want = 3 if axes else 2
    if len(shape) != want or (axes and isinstance(shape[0], int) and shape[0] != axes):
        needed = f"[{axes}, batch, sequence] (one row per rotary axis)" if axes else "[batch, sequence]"
        raise ModelError(f"{path}: decoder graph declares input 'position_ids' of shape "
                         f"[{', '.join(str(d) for d in shape)}] but the model's family feeds {needed}")


def _check_pixel_values(component: Component, path: str, fed: tuple[int | None, ...], source: str) -> None:
    """pixel_values must have the rank the family feeds, and its size on every axis both fix."""
    shape = component.inputs["pixel_values"].shape
    if not fed or shape is None:  # nothing the family fixes, or a rank the graph leaves open
        return
    static = [d if isinstance(d, int) and d >= 0 else None for d in shape]  # symbolic names: they vary
    if len(shape) == len(fed) and all(a is None or b is None or a == b for a, b in zip(static, fed)):
        return
    declared = ", ".join(str(d) for d in shape)
    feeds = ", ".join("any" if d is None else str(d) for d in fed)
    raise ModelError(f"{path}: vision_encoder graph declares input 'pixel_values' of shape [{declared}] but "
                     f"the model's family feeds [{feeds}] ({source})")


def check_image_tokens(family: Family, manifest: ModelManifest, encoder: Component,
                       encode: Callable[[np.ndarray], np.ndarray] | None) -> int:
    """Refuse a folder whose prompt would hold another number of image tokens, at some tier,
    than its vision encoder gives there: one line naming both numbers, the tier and where each
    comes from. Checked at load, before any image is prepared.

    The encoder's count is read from the graph where its image_features fix it, else `encode`
    runs once on a blank image of the tier (one tile for a tiled family, whose count is per
    tile; a shape already run is not run again); with no `encode`, such a tier is not checked
    here. Returns the encoder calls it made."""
    fed = graph_inputs(family)
    declared = encoder.outputs["image_features"].shape
    fixed = declared[1] if fed.encoder_feeds is None and declared is not None and len(declared) == 3 \
        and isinstance(declared[1], int) and declared[1] > 0 else None
    source = getattr(family, "image_tokens_from", "") or "model.yaml: the tier's image_tokens"
    prompt_text = next(iter(family.known_prompts), LOAD_CHECK_PROMPT)
    counted: dict[tuple, int] = {}  # the shape of one image (one tile) fed → the tokens it gives
    for tier in manifest.tiers.values():
        pixels = family.pixels(np.zeros((tier.height, tier.width, 3), np.uint8), tier)
        want = len(family.build_prompt(prompt_text, tier, (tier.height, tier.width)).image_positions)
        tiled = pixels.ndim == 5 and fed.encoder_feeds is None  # (Qwen2-VL's 5 axes are one image's grid)
        tiles = pixels.shape[1] if tiled else 1
        unit = pixels[:, :1] if tiled else pixels  # a tiled family's count is per tile
        if fixed is None and encode is None:
            continue  # unchecked at load: a contradiction fails the request (generate.image_positions)
        if fixed is None and unit.shape not in counted:
            counted[unit.shape] = encode(unit).shape[1]
        got = (fixed if fixed is not None else counted[unit.shape]) * tiles
        if got != want:
            how = (f"image_features' token axis is fixed at {fixed}" if fixed is not None
                   else f"image_features of a blank {tier.width}x{tier.height} image")
            per_tile = f", {got // tiles} per tile x {tiles} tiles" if tiles > 1 else ""
            raise ModelError(f"{manifest.path}: tier {tier.name}: the prompt holds {want} image tokens "
                             f"({source}) but the vision encoder gives {got} ({how}{per_tile})")
    return len(counted)
