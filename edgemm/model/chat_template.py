"""A model folder's chat template, compiled and rendered as transformers renders it.

The families whose folders are Hugging Face folders (idefics3, qwen2_vl, gemma3, llava,
internvl) build their prompts the same way: the folder's Jinja chat template, given one
user message of an image and the user's text, with the generation prompt after it. What
differs per family is which token marks the image, which tokens a user's text may not
hold, and what else the template reads (`bos_token`, `eos_token`): `ChatTemplate.one_image`
takes those.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from edgemm.errors import InputError, ModelError

if TYPE_CHECKING:
    from jinja2 import Template


@dataclass(frozen=True)
class ChatTemplate:
    template: Template  # compiled in compile's sandbox
    where: Path  # the model folder, for the error messages

    @classmethod
    def compile(cls, source: str, where: Path) -> ChatTemplate:
        """The chat template in a sandbox, with the settings transformers renders it with."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise InputError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            return cls(env.from_string(source), where)
        except jinja2.TemplateError as e:
            raise ModelError(f"{where}: chat template does not compile ({e})") from None

    def one_image(self, prompt: str, image_marker: str, reserved: Iterable[str], reserved_name: str = "image token",
                  **variables: str) -> str:
        """The template around one image and the user's `prompt`, ready for the answer.

        A prompt holding one of the `reserved` tokens is the user's error; a template that
        gives other than one `image_marker` for the image is the model folder's."""
        for token in reserved:
            if token in prompt:
                raise InputError(f"the prompt must not contain the {reserved_name} {token}")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = self.template.render(messages=messages, add_generation_prompt=True, **variables)
        if text.count(image_marker) != 1:
            raise ModelError(f"{self.where}: the chat template gave {text.count(image_marker)} "
                             f"{image_marker} tokens for one image")
        return text
