"""edgemm/model/chat_template.py: what the Hugging Face families' prompts are built with. Each
family's own tests check the exact text of its folder's template; these check the errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from edgemm.errors import InputError, ModelError
from edgemm.model.chat_template import ChatTemplate

WHERE = Path("models/some-vlm")
TEMPLATE = ("{% for m in messages %}{{ bos_token }}{% for c in m.content %}"
            "{% if c.type == 'image' %}<image>{% else %}{{ c.text }}{% endif %}{% endfor %}{% endfor %}"
            "{% if add_generation_prompt %}|answer:{% endif %}")


def test_one_image_renders_the_users_text_after_the_image_with_the_generation_prompt():
    template = ChatTemplate.compile(TEMPLATE, WHERE)
    assert template.one_image("what is it?", "<image>", reserved=("<image>",), bos_token="<s>") == \
        "<s><image>what is it?|answer:"


@pytest.mark.parametrize("prompt, name", [("look <image>", "image token"), ("a <|pad|> b", "vision token")])
def test_a_prompt_holding_a_reserved_token_is_the_users_error(prompt, name):
    template = ChatTemplate.compile(TEMPLATE, WHERE)
    with pytest.raises(InputError, match=f"must not contain the {name} "):
        template.one_image(prompt, "<image>", reserved=("<image>", "<|pad|>"), reserved_name=name)


def test_a_template_without_one_image_marker_is_the_folders_error():
    no_image = ChatTemplate.compile("{% for m in messages %}{{ m.role }}{% endfor %}", WHERE)
    with pytest.raises(ModelError, match=r"models/some-vlm: the chat template gave 0 <image> tokens for one image"):
        no_image.one_image("hi", "<image>", reserved=())


def test_the_template_runs_sandboxed_with_transformers_helpers():
    with pytest.raises(ModelError, match="models/some-vlm: chat template does not compile"):
        ChatTemplate.compile("{% if %}", WHERE)
    refusing = ChatTemplate.compile("{{ raise_exception('only one image, please') }}", WHERE)
    with pytest.raises(InputError, match="chat template: only one image, please"):
        refusing.one_image("hi", "<image>", reserved=())
    dated = ChatTemplate.compile("<image>{{ strftime_now('%Y') }}", WHERE)
    assert dated.one_image("hi", "<image>", reserved=())[len("<image>"):].isdigit()
    from jinja2.exceptions import SecurityError
    with pytest.raises(SecurityError, match="unsafe"):
        ChatTemplate.compile("<image>{{ ''.__class__.__mro__ }}", WHERE).one_image("hi", "<image>", reserved=())
