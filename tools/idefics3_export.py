"""Idefics3 (SmolVLM) → a model folder edgemm loads: the Hugging Face ONNX layout.

Shared by tools/make_idefics3_fixture.py (the tiny conformance fixture) and
tools/make_sized_model.py (random models of real sizes). Needs the `fixture` extra.

The export itself is tools/export_hf_vlm.py's, shared by every family: vision_encoder
(pixel_values [B,T,3,H,W] and pixel_attention_mask [B,T,H,W] → image_features [B*T,n,D]),
embed_tokens, and decoder_model_merged with past_key_values.N.key/value →
present.N.key/value. What stays here is SmolVLM's own chat template.
"""
from __future__ import annotations

from export_hf_vlm import export_graphs  # (tools/, beside this file)
from hf_fixture import OPSET, save_folder

__all__ = ["CHAT_TEMPLATE", "OPSET", "export_graphs", "save_folder"]

# SmolVLM's chat template (HuggingFaceTB/SmolVLM-*-Instruct)
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
