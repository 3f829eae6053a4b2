"""A model folder's chat template, compiled and rendered as transformers renders it.

The families whose folders are Hugging Face folders (idefics3, qwen2_vl, gemma3, llava,
internvl) build their prompts the same way: the folder's Jinja chat template, given one
user message of an image and the user's text, with the generation prompt after it. What
differs per family is which token marks the image, which tokens a user's text may not
hold, and what else the template reads (`bos_token`, `eos_token`): `ChatTemplate.one_image`
takes those.

The template is the model folder's code, run in Jinja's sandbox: it cannot reach Python's
internals, and what the sandbox lets through but would exhaust memory (`'x' * 10**9`, a huge
power) is refused by size. Its running time has no bound that is sound (loops nest: two
loops over 100 000 items are 10**10 steps, each allowed alone), so like the folder's ONNX
graphs it is code the operator trusts (docs/limits.md, "Model folders are trusted code"); it is rendered once
at load (edgemm.model.family.family_for), so a template that fails or hangs does so there.
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

# The most characters or items one `*` in a template may make, and the most bits one `**` may:
# a prompt is a few KB, so 1 MB is far beyond any real template's need and far below harm.
MAX_REPEAT = 1_000_000
MAX_POWER_BITS = 64 * 1024


def bounded_binop(operator: str, left, right):
    """`left operator right` as Python computes it, unless its result would be bigger than
    the bounds above: checked before the operation, which would allocate it first."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                    and len(seq) * times > MAX_REPEAT:
                raise OverflowError(f"a repetition of {len(seq) * times} items (at most {MAX_REPEAT})")
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
            and left.bit_length() * right > MAX_POWER_BITS:
        raise OverflowError(f"a power of about {left.bit_length() * right} bits (at most {MAX_POWER_BITS})")


@dataclass(frozen=True)
class ChatTemplate:
    template: Template  # compiled in compile's sandbox
    where: Path  # the model folder, for the error messages

    @classmethod
    def compile(cls, source: str, where: Path) -> ChatTemplate:
        """The chat template in a sandbox, with the settings transformers renders it with."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class BoundedSandbox(ImmutableSandboxedEnvironment):
            intercepted_binops = frozenset({"*", "**"})

            def call_binop(self, context, operator, left, right):
                bounded_binop(operator, left, right)
                return super().call_binop(context, operator, left, right)

        def raise_exception(message):
            raise InputError(f"chat template: {message}")

        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
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
        try:
            text = self.template.render(messages=messages, add_generation_prompt=True, **variables)
        except InputError:  # the template's own raise_exception: its refusal of this request
            raise
        except Exception as e:  # noqa: BLE001 - whatever the folder's code raises is the folder's error
            raise ModelError(f"{self.where}: the chat template fails: {type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}") from None
        if text.count(image_marker) != 1:
            raise ModelError(f"{self.where}: the chat template gave {text.count(image_marker)} "
                             f"{image_marker} tokens for one image")
        return text
