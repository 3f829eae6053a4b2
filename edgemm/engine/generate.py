"""The model's three graphs for generation: encoder, token embedding, decoder with a KV cache.

    features = encoder(pixel_values)                       once per image
    embeds   = embed_tokens(input_ids); image slots ← features
    prefill:   decoder(embeds, mask, positions, past = empty)  → logits, present
    decode:    decoder(embed(token), mask + [1], next position, past = present) …

The attention mask keeps the whole history and position ids are cumsum(mask) - 1,
as the model contract says; a decoder that does not declare position_ids computes them
from the mask itself and is fed none. Generator makes the calls; the loop that produces every
token is edgemm/engine/decode.py (greedy, seeded temperature + top-p sampling, and gated
beams as branches of one step).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edgemm.backends.base import Component
from edgemm.errors import ModelError
from edgemm.util.generation_limits import check_generation  # the one place the limits live
from edgemm.engine.contract import decoder_layers
from edgemm.model.family import GraphInputs

TOKEN_EMBED_BYTES = 8 << 20  # Generator.embed_next's table: ~3600 tokens of a 576-wide fp32 embedding



@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    num_beams: int = 1  # > 1: beam search (greedy, so temperature must be 0)
    beam_gate: float = 0.85  # beams collapse to the best when its next token is this likely (see beams.py)

    def __post_init__(self) -> None:
        check_generation(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                         seed=self.seed, num_beams=self.num_beams, beam_gate=self.beam_gate)


class ArrayStore(Protocol):
    def get(self, key: bytes) -> np.ndarray | tuple[np.ndarray, ...] | None: ...
    def put(self, key: bytes, value: np.ndarray | tuple[np.ndarray, ...], copy: bool = True) -> None: ...


@dataclass
class PrefixReuse:
    """Where to find and keep the decoder's KV cache for the question-independent start
    of a prompt: everything up to the end of the image block. The decoder is causal, so
    those positions never see the question; a second question about the same image then
    skips their prefill as well as the encoder."""
    store: ArrayStore  # the feature cache: one byte-bounded LRU for features and prefixes
    image_key: bytes  # the image's feature-cache key (its image or pixels, tier, model, precision)


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens or context)
    timings_ms: dict[str, float] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)  # decoder details, e.g. beam steps and rows


def _run_length(ids: np.ndarray, start: int) -> int:
    """How many times ids[start] repeats from `start` on (the image placeholder block)."""
    if start >= len(ids):
        return 0
    different = np.flatnonzero(ids[start:] != ids[start])
    return int(different[0]) if len(different) else len(ids) - start


def image_positions(input_ids: np.ndarray, image: int | np.ndarray | slice, features: int) -> np.ndarray | slice:
    """Indices in input_ids[0] that the `features` encoder tokens replace, in order.

    `image` is the start of one contiguous placeholder run (the built-in family), the
    positions themselves (tiled families, whose placeholders come in runs per tile), or
    one run as a slice (Prompt.image_span), which is handed back as it is."""
    if image.__class__ is slice:
        positions, placeholders = image, image.stop - image.start
    elif isinstance(image, np.ndarray) and image.ndim == 1:
        # the positions themselves (Prompt.image_positions), as they are: this runs twice per
        # request on the caches the encoder left cold, where np.ndim and np.asarray cost ~10 µs
        positions, placeholders = image, len(image)
    elif np.ndim(image) == 0:
        positions = np.arange(int(image), int(image) + _run_length(input_ids[0], int(image)))
        placeholders = len(positions)
    else:
        positions = np.asarray(image)
        placeholders = len(positions)
    if placeholders != features:
        raise ModelError(f"the encoder gave {features} image tokens but the prompt has {placeholders} "
                         "image placeholders: the tier's image_tokens (model.yaml) or the family's "
                         "image expansion is wrong")
    return positions


def sample_token(logits: np.ndarray, options: GenerationOptions, rng: np.random.Generator | None) -> int:
    if options.temperature == 0:
        return int(logits.argmax())
    z = logits.astype(np.float64) / options.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if options.top_p < 1:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < options.top_p  # always keeps the top token
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0)
        p /= p.sum()
    return int(rng.choice(len(p), p=p))


class Generator:
    """The three graphs of one model, on one set of devices, as the calls the decode loop
    (edgemm/engine/decode.py) makes: encode, embed, one decoder step. Each row of a call may be a
    different request."""

    def __init__(self, encoder: Component, embed: Component, decoder: Component,
                 max_context: int, stop_ids: set[int], fed: GraphInputs | None = None):
        """`fed`: what the model's family feeds beyond the contract (its GraphInputs)."""
        self.encoder, self.embed, self.decoder = encoder, embed, decoder
        fed = fed or GraphInputs()
        # M-RoPE families: position_ids [axes, B, S], each row's from its prompt (BatchItem)
        self.position_axes = fed.position_axes
        self._encoder_feeds = fed.encoder_feeds
        self.max_context = max_context
        self.stop_ids = stop_ids
        self.layers = decoder_layers(decoder)
        spec = decoder.inputs["past_key_values.0.key"]
        heads, head_dim = spec.shape[1], spec.shape[3]
        if not isinstance(heads, int) or not isinstance(head_dim, int):
            raise ModelError("decoder past_key_values must declare fixed heads and head_dim axes")
        self.kv_shape = (heads, head_dim)
        self.kv_dtype = spec.dtype
        self.embed_dtype = decoder.inputs["inputs_embeds"].dtype
        # integer inputs in whatever width the graph declares (int64 by convention, int32 seen too)
        self.mask_dtype = decoder.inputs["attention_mask"].dtype
        # a graph without position_ids computes them from the mask (the contract allows it): the
        # loop's position tables are then kept in int64 and never fed
        self.feeds_positions = "position_ids" in decoder.inputs
        self.position_dtype = decoder.inputs["position_ids"].dtype if self.feeds_positions else np.dtype(np.int64)
        self.past_names = [f"past_key_values.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value")]
        self.present_names = [name.replace("past_key_values.", "present.") for name in self.past_names]
        self.pixel_dtype = encoder.inputs["pixel_values"].dtype  # e.g. float16 in _fp16 exports
        spec = encoder.inputs.get("pixel_attention_mask")
        self.pixel_mask_dtype = spec.dtype if spec is not None else None
        self._token_embeds: dict[int, np.ndarray] = {}  # token id → its embedding [1, 1, D] (see embed_next)
        # optional decoder inputs (optimum's merged exports), made once rather than every step
        self._cache_branch = "use_cache_branch" in decoder.inputs
        self._true, self._false = np.array([True]), np.array([False])
        self._logits_to_keep = np.array(1, np.int64) if "num_logits_to_keep" in decoder.inputs else None

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        """[B,3,H,W] → [B,N,D]; tiled [B,T,3,H,W] → [B,T*n,D], each image's tiles in order.

        A tiled encoder takes the tiles flattened into its batch (image_features
        [B*T,n,D], as transformers.js exports SmolVLM) and, if it declares it, a
        pixel_attention_mask: all ones, since edgemm never pads a tile."""
        if self._encoder_feeds is not None:  # the family lays out the inputs (Qwen2-VL: patches + grid)
            feeds = self._encoder_feeds(pixel_values)
            feeds = {name: value.astype(self.encoder.inputs[name].dtype, copy=False) for name, value in feeds.items()}
            features = self.encoder.run(feeds)["image_features"]  # [B·N, D] or [B, N, D]
            return features.reshape(pixel_values.shape[0], -1, features.shape[-1])
        feeds = {"pixel_values": pixel_values.astype(self.pixel_dtype, copy=False)}
        if self.pixel_mask_dtype is not None:
            mask_shape = pixel_values.shape[:-3] + pixel_values.shape[-2:]
            feeds["pixel_attention_mask"] = np.ones(mask_shape, self.pixel_mask_dtype)
        features = self.encoder.run(feeds)["image_features"]
        if pixel_values.ndim == 5:
            features = features.reshape(pixel_values.shape[0], -1, features.shape[-1])
        return features

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        empty = np.zeros((batch, self.kv_shape[0], 0, self.kv_shape[1]), self.kv_dtype)
        return dict.fromkeys(self.past_names, empty)

    def embed_prompt(self, input_ids: np.ndarray, features: np.ndarray, image: int | np.ndarray | slice) -> np.ndarray:
        """Token embeddings with the image placeholders replaced by `features` [1,N,D], in order.
        `image`: the first placeholder's index, all their indices, or their run as a slice
        (see image_positions)."""
        positions = image_positions(input_ids, image, features.shape[1])
        embeds = self.embed.run({"input_ids": input_ids})["inputs_embeds"]
        embeds[:, positions] = features.astype(embeds.dtype, copy=False)
        return embeds.astype(self.embed_dtype, copy=False)

    def embed_next(self, tokens: list[int]) -> np.ndarray:
        """Embeddings [B, 1, D] of one new token per row. A token's embedding never changes,
        so each is computed once: the decode loop then makes one model call per token, not
        two. Bounded: the table starts afresh past TOKEN_EMBED_BYTES."""
        table = self._token_embeds  # one table throughout, even if another thread starts a new one
        if len(tokens) == 1 and (known := table.get(tokens[0])) is not None:
            return known  # the common case: one row, a token seen before (kept as [1, 1, D]: no view to make)
        missing = [t for t in dict.fromkeys(tokens) if t not in table]
        if missing:
            out = self.embed.run({"input_ids": np.array(missing, np.int64)[:, None]})["inputs_embeds"]
            out = out.astype(self.embed_dtype, copy=False)  # [n, 1, D]
            if (len(table) + len(missing)) * out[0].nbytes > TOKEN_EMBED_BYTES:
                table = self._token_embeds = {}
            for i, token in enumerate(missing):
                table[token] = out[i:i + 1]
        return np.concatenate([table[t] for t in tokens])

    def step(self, embeds: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray],
             positions: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
        """One decoder call: logits of the last position and the new cache.
        `positions` defaults to cumsum(mask) - 1 for the new tokens (on every axis, for a
        graph with position_axes)."""
        if positions is None:
            positions = (np.cumsum(mask, axis=1) - 1)[:, -embeds.shape[1]:]
            if self.position_axes:
                positions = np.broadcast_to(positions, (self.position_axes, *positions.shape))
        feeds = self.step_feeds(past)
        feeds["inputs_embeds"] = embeds
        feeds["attention_mask"] = mask.astype(self.mask_dtype, copy=False)
        if self.feeds_positions:
            feeds["position_ids"] = np.ascontiguousarray(positions, self.position_dtype)
        out = self.decoder.run(feeds)
        present = {past: out[name] for past, name in zip(self.past_names, self.present_names)}
        return out["logits"][:, -1], present

    def step_feeds(self, past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The cache `past` plus the optional inputs the graph declares: the feeds of step(),
        and of a run of step_in_place() calls, which then keeps them up to date."""
        feeds = dict(past)
        if self._cache_branch:
            feeds["use_cache_branch"] = self._true if past["past_key_values.0.key"].shape[2] else self._false
        if self._logits_to_keep is not None:
            feeds["num_logits_to_keep"] = self._logits_to_keep
        return feeds

    def step_in_place(self, feeds: dict[str, np.ndarray], embeds: np.ndarray, mask: np.ndarray,
                      positions: np.ndarray) -> np.ndarray:
        """step() for the decode loop: one dict serves every step of a batch and takes
        the new cache in place. `mask` and `positions` must be in the graph's types. Per
        token this saves two dicts and a few conversions; the loop's Python is most of
        edgemm's own time in a request.

        The cache crosses steps without a copy: onnxruntime (1.19 on) hands each present
        back as a numpy array over its own buffer, freshly allocated every run (so the
        prefix cache's views of it stay valid), and takes it as the next past as it is.
        IOBinding with the cache kept as OrtValues was measured against this and kept out:
        it costs more Python per step and saves no copy (bench/bench_kv_binding.py,
        docs/BENCHMARKS.md). Below 1.19 session.run copied every output (the floor is 1.20)."""
        feeds["inputs_embeds"], feeds["attention_mask"] = embeds, mask
        if self.feeds_positions:
            feeds["position_ids"] = positions
        out = self.decoder.run(feeds)
        for past, present in zip(self.past_names, self.present_names):
            feeds[past] = out[present]
        return out["logits"][:, -1]

    def prefix_key(self, features: np.ndarray, input_ids: np.ndarray, image_start: int | np.ndarray | slice,
                   reuse: PrefixReuse | None) -> tuple[int, bytes | None]:
        """Where the question-independent prefix ends (after the last image placeholder)
        and its key in the store; no key without a store or without a question after it."""
        positions = image_positions(input_ids, image_start, features.shape[1])
        split = positions.stop if positions.__class__ is slice else int(positions[-1]) + 1
        if reuse is None or split >= input_ids.shape[1]:
            return split, None
        return split, reuse.image_key + b"\0prefix\0" + input_ids[0, :split].astype(np.int64, copy=False).tobytes()

    def from_stored_prefix(self, input_ids: np.ndarray, split: int, key: bytes | None,
                           reuse: PrefixReuse | None,
                           positions: np.ndarray | None = None) -> tuple[np.ndarray, dict] | None:
        """Logits and cache from a stored prefix plus the rest of the prompt (one row, no
        padding), if stored. `positions`: the whole prompt's, if the family gives them
        (Prompt.position_ids). The mask is made here, only for a prefix found: on a miss,
        right after the encoder call, even a view of a shared one cost ~15 µs."""
        stored = reuse.store.get(key) if key is not None else None
        if stored is None:
            return None
        past = {name: np.ascontiguousarray(kv) for name, kv in zip(self.past_names, stored)}
        rest = self.embed.run({"input_ids": input_ids[:, split:]})["inputs_embeds"]
        mask = np.ones((1, input_ids.shape[1]), self.mask_dtype)
        return self.step(rest.astype(self.embed_dtype, copy=False), mask, past,
                         positions[..., split:] if positions is not None else None)

    def store_prefix(self, past: dict[str, np.ndarray], split: int, key: bytes | None,
                     reuse: PrefixReuse | None) -> None:
        """Keep the prefix's KV cache, handing the store views of the decoder's own outputs
        (copying 0.4 MB per request cost 0.4 ms of a 25 ms answer; the store copies a view
        only where it would keep much more alive, such as one row of a batch)."""
        if key is not None:
            reuse.store.put(key, tuple(past[name][:, :, :split] for name in self.past_names), copy=False)
