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
    with pytest.raises(ModelError, match=r"^models/some-vlm: the chat template fails: SecurityError: .*unsafe"):
        ChatTemplate.compile("<image>{{ ''.__class__.__mro__ }}", WHERE).one_image("hi", "<image>", reserved=())


@pytest.mark.parametrize("expression", ["'x' * 1000000000", "1000000000 * 'ab'", "[0] * 2000000", "10 ** 1000000",
                                        "('x' * 1000) * 1001"])
def test_a_repetition_or_power_too_big_is_refused_before_it_is_made(expression):
    bomb = ChatTemplate.compile("<image>{{ " + expression + " }}", WHERE)
    with pytest.raises(ModelError, match=r"^models/some-vlm: the chat template fails: OverflowError: a (repeti|pow)"):
        bomb.one_image("hi", "<image>", reserved=())


def test_repetitions_and_powers_within_the_bound_are_what_python_makes():
    fine = ChatTemplate.compile("<image>{{ '-' * 3 }}{{ ([1] * 2) | length }}{{ 2 ** 10 }}{{ 3 * 4 }}{{ 2.5 * 2 }}",
                                WHERE)
    assert fine.one_image("hi", "<image>", reserved=()) == "<image>---21024125.0"


@pytest.mark.parametrize("template, error", [("<image>{{ 1 / 0 }}", "ZeroDivisionError"),
                                             ("<image>{{ messages[5].content }}", "UndefinedError"),
                                             ("<image>{{ 'a' + 1 }}", "TypeError")])
def test_any_error_while_rendering_is_one_line_naming_the_template(template, error):
    with pytest.raises(ModelError, match=rf"^models/some-vlm: the chat template fails: {error}: [^\n]*$"):
        ChatTemplate.compile(template, WHERE).one_image("hi", "<image>", reserved=())


def folder_with_template(tmp_path: Path, template: str) -> Path:
    """The idefics3 fixture's files, linked, with `template` as its chat_template.jinja."""
    from tests.support.family_conformance import IDEFICS3
    folder = tmp_path / "ct"
    folder.mkdir()
    for entry in IDEFICS3.path.iterdir():
        (folder / entry.name).symlink_to(entry)
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.mark.parametrize("template, said", [
    ("{% if messages[0].content[1].text %}{{ 1 / 0 }}{% endif %}<image>",
     "the chat template fails: ZeroDivisionError: division by zero"),
    ("{{ raise_exception('no images') }}", "the chat template refuses the prompt 'describe the image': chat "
                                           "template: no images"),
])
def test_the_folders_template_is_rendered_once_when_the_family_loads(tmp_path, template, said):
    # so that serve refuses to start with that line even under backend.warmup: none, which renders nothing
    from edgemm.model.family import adapter_for
    from edgemm.model.manifest import load_manifest
    folder = folder_with_template(tmp_path, template)
    with pytest.raises(ModelError) as refused:
        adapter_for(load_manifest(folder))
    assert str(refused.value) == f"{folder / 'chat_template.jinja'}: {said}"


@pytest.mark.parametrize("template, said", [("{{ 'x' * 1000000000 }}<image>", "OverflowError: a repetition"),
                                            ("{{ ''.__class__.__mro__ }}<image>", "SecurityError: access to")])
def test_a_hostile_folder_template_is_exit_2_naming_its_file(tmp_path, template, said):
    from click.testing import CliRunner

    from edgemm.cli.main import main
    folder = folder_with_template(tmp_path, template)
    result = CliRunner().invoke(main, ["infer", str(folder / "wide.png"), "--prompt", "What is in the image?",
                                       "--model", str(folder)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and f"{folder / 'chat_template.jinja'}: the chat template fails: {said}" in errors[0]
