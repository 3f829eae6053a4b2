"""What the tools that write Hugging Face model folders share.

Used by the make_*_fixture.py tools (the families' conformance fixtures), onnx_layout.py and
export_hf_vlm.py (the exports). Needs the `fixture` extra (torch, transformers):

- `save_folder`: config.json, generation_config.json, the processor's and tokenizer's files;
- the text side of the Hugging Face ONNX layout, the same for every family: `EmbedTokens`,
  `MergedDecoder` (the text model + its head, the cache as flat past/present tensors) and
  `export_text_graphs` (embed_tokens.onnx, decoder_model_merged.onnx);
- `train_bpe`, a small byte-level BPE tokenizer; `make_images`, seeded pictures; the
  pictures, questions and corpus sentences the fixtures share;
- `chat_inputs`, `greedy_reference`, `write_reference`: transformers' own greedy answer to
  one case, recorded as the fixtures' reference.json has it;
- `output_folder` and `write_fixture`: a fixture tool's --out and its whole folder.
"""
from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers.cache_utils import DynamicCache

OPSET = 17

# what the fixtures show their models: two aspects, (h, w) 4:3 and 2:5 ...
WIDE_AND_TALL = {"wide.png": (120, 160), "tall.png": (150, 64)}
# ... and ask about them, (image file, prompt): both aspects, and a second question about the
# first image (the cached-prefix case)
QUESTIONS = [
    ("wide.png", "What is in the image?"),
    ("tall.png", "Describe the picture."),
    ("wide.png", "How many objects are there?"),
    ("tall.png", "Read the text."),
]
# what every fixture's tokenizer learns besides a sentence in its own chat format
SHARED_SENTENCES = [
    "Describe the picture in one sentence. There are shapes, lines and colours.",
    "How many objects are there? Three objects: two circles and a triangle.",
    "Read the text in the image. The sign says hello world.",
]


def save_folder(model, processor, out: Path, *, processor_files: bool = True) -> None:
    """config.json, generation_config.json, the processor's files and tokenizer.json.

    processor_files=False saves the tokenizer's files alone, for a processor built without
    the video processor its own save_pretrained wants."""
    (processor if processor_files else processor.tokenizer).save_pretrained(out)
    # transformers 5 nests the image processor's settings in processor_config.json; published
    # folders (and edgemm) have them in preprocessor_config.json
    processor.image_processor.save_pretrained(out)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)


# ---- the text side of the ONNX layout ---------------------------------------------------------

class EmbedTokens(torch.nn.Module):
    """input_ids [B,S] → inputs_embeds [B,S,D]: the model's own embedding."""

    def __init__(self, embedding: torch.nn.Module):
        super().__init__()
        self.embed = embedding

    def forward(self, input_ids):
        return self.embed(input_ids)


class MergedDecoder(torch.nn.Module):
    """A transformers text model + its head, with the cache as flat past/present tensors.

    The cache keeps every position, sliding-window layers too: the window is the attention
    mask the text model builds from the positions, not a shorter cache, so every present.N
    has past + S positions (the model contract). `logits` is applied to the head's output
    (Gemma 3's soft cap)."""

    def __init__(self, text_model: torch.nn.Module, head: torch.nn.Module, layers: int,
                 logits: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.text, self.head, self.layers, self.logits = text_model, head, layers, logits

    def forward(self, inputs_embeds, attention_mask, position_ids, *past):
        cache = DynamicCache()  # full layers only: no sliding-window cache that drops positions
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        # transformers 5 names the cache argument `cache` (past_key_values, deprecated, is mapped to it)
        out = self.text(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                        cache=cache, use_cache=True)
        presents = []
        for i in range(self.layers):
            presents += [cache.layers[i].keys, cache.layers[i].values]
        logits = self.head(out.last_hidden_state)
        return (logits if self.logits is None else self.logits(logits), *presents)


def export_text_graphs(onnx_dir: Path, embed: EmbedTokens, decoder: MergedDecoder, hidden: int, kv_heads: int,
                       head_dim: int, position_axes: int = 1) -> None:
    """embed_tokens.onnx and decoder_model_merged.onnx under onnx_dir. position_axes 3 is
    M-RoPE's position_ids [3, B, S] (Qwen2-VL); 1 is [B, S]."""
    layers = decoder.layers
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python values
        torch.onnx.export(
            embed, (torch.zeros(1, 5, dtype=torch.long),), onnx_dir / "embed_tokens.onnx",
            input_names=["input_ids"], output_names=["inputs_embeds"],
            dynamic_axes={"input_ids": {0: "batch_size", 1: "sequence_length"},
                          "inputs_embeds": {0: "batch_size", 1: "sequence_length"}},
            opset_version=OPSET, dynamo=False)
        # trace with a non-empty past so nothing specialises on past length 0
        b, s, p = 2, 3, 4
        past = [torch.randn(b, kv_heads, p, head_dim) for _ in range(2 * layers)]
        names_in = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
        names_out = [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
        if position_axes == 3:  # three position streams, offset so none is another's copy
            streams = torch.stack([torch.arange(p + a, p + s + a) for a in range(3)])
            positions = streams[:, None].expand(3, b, s).contiguous()
            position_dims = {1: "batch_size", 2: "sequence_length"}
        else:
            positions = torch.arange(p, p + s).repeat(b, 1)
            position_dims = {0: "batch_size", 1: "sequence_length"}
        axes = {"inputs_embeds": {0: "batch_size", 1: "sequence_length"},
                "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
                "position_ids": position_dims,
                "logits": {0: "batch_size", 1: "sequence_length"},
                **{n: {0: "batch_size", 2: "past_sequence_length"} for n in names_in},
                **{n: {0: "batch_size", 2: "total_sequence_length"} for n in names_out}}
        torch.onnx.export(
            decoder, (torch.randn(b, s, hidden), torch.ones(b, p + s, dtype=torch.long), positions, *past),
            onnx_dir / "decoder_model_merged.onnx",
            input_names=["inputs_embeds", "attention_mask", "position_ids", *names_in],
            output_names=["logits", *names_out], dynamic_axes=axes, opset_version=OPSET, dynamo=False)


# ---- tokenizer and pictures -------------------------------------------------------------------

def train_bpe(special: Sequence[str], corpus: Sequence[str], vocab_size: int = 320, bos: str | None = None):
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) trained on `corpus`, `special` first.
    With `bos` (one of `special`) it puts that token in front of what it encodes, as Llama's
    and Gemma's tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def make_images(out: Path, seed: int, sizes: dict[str, tuple[int, int]], discs: int = 5,
                radii: tuple[int, int] = (6, 24)) -> None:
    """Small procedural pictures (seeded), one per name and (h, w): gradients and `discs`
    discs of a radius in [radii)."""
    import cv2
    rng = np.random.default_rng(seed)
    for name, (h, w) in sizes.items():
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 127 // (h + w)], -1).astype(np.uint8)
        for _ in range(discs):
            cy, cx, r = rng.integers(0, h), rng.integers(0, w), rng.integers(*radii)
            img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.integers(0, 256, 3)
        cv2.imwrite(str(out / name), img[:, :, ::-1])


# ---- the reference ----------------------------------------------------------------------------

def chat_inputs(processor, image_path: Path, prompt: str) -> tuple[str, dict]:
    """The chat text and the model's inputs the processor makes of one picture and question,
    tokenized by its own apply_chat_template (as transformers' model docs run it)."""
    image = Image.open(image_path).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": prompt}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    return processor.apply_chat_template(messages, add_generation_prompt=True), inputs


def without_stop(tokens: list[int], model) -> list[int]:
    """The tokens without a final stop token (one of the generation config's eos_token_id)."""
    stops = model.generation_config.eos_token_id
    stops = set(stops) if isinstance(stops, (list, tuple)) else {stops}
    return tokens[:-1] if tokens and tokens[-1] in stops else tokens


def greedy_reference(model, inputs, tokenizer, max_new_tokens: int) -> dict:
    """transformers' greedy `generate` on the processor's `inputs`, as a reference case records
    it: the new tokens without the stop token, why it ended, the text, and how decisive the
    least decisive step was (a tiny top-2 gap could flip under float noise)."""
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True)
    tokens = generated.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    answer = without_stop(tokens, model)
    margins = [float(torch.topk(s[0], 2).values.diff().abs()) for s in generated.scores]
    return {"tokens": answer, "finish_reason": "stop" if answer != tokens else "length",
            "answer": tokenizer.decode(tokens, skip_special_tokens=True), "min_top2_margin": round(min(margins), 4)}


def write_reference(out: Path, reference: dict, arrays: dict[str, np.ndarray],
                    arrays_file: str = "reference_pixels.npz") -> None:
    """reference.json (max_new_tokens, cases, ...) and the arrays the cases name."""
    np.savez_compressed(out / arrays_file, **arrays)
    (out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


def summary(case: dict) -> str:
    """One line on a recorded case, for the tool's output."""
    return (f"{case['image']} prompt={len(case['input_ids'])} tokens={case['tokens']} "
            f"({case['finish_reason']}, min margin {case['min_top2_margin']})")


# ---- a fixture tool ---------------------------------------------------------------------------

def output_folder(doc: str, default: Path) -> Path:
    """The tool's --out (made), from its command line; one torch thread (other jobs share the machine)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=default)
    out = ap.parse_args().out
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_fixture(out: Path, model, processor, *, seed: int, images: dict[str, tuple[int, int]],
                  export: Callable[[object, Path], None],
                  reference_cases: Callable[[object, object, Path], tuple[list[dict], dict[str, np.ndarray]]],
                  max_new_tokens: int, **fields) -> list[dict]:
    """A fixture folder: the model's files, the pictures, the three graphs (`export`), then
    reference.json (max_new_tokens, `fields`, the cases) and its arrays. Gives the cases."""
    save_folder(model, processor, out)
    make_images(out, seed, images)
    export(model, out)
    cases, arrays = reference_cases(model, processor, out)
    write_reference(out, {"max_new_tokens": max_new_tokens, **fields, "cases": cases}, arrays)
    return cases
