"""The documentation (issue 31): a README for the first hour, the reference in docs/, every
relative link resolving (to a file of the repository, and to a heading's anchor as GitHub makes
it), and docs/configuration.md exactly what tools/dev/make_configuration_doc.py renders from the
configuration schema, so CI fails when a key changes and the page does not."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
MEASURED_ELSEWHERE = {"ARCHITECTURE.md", "BENCHMARKS.md"}  # pages that are not the reference moved out of the README

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the text may hold one level of brackets ([`streams[]`](#streams))
LINK = re.compile(r"!?\[(?:[^\[\]\n]|\[[^\]\n]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:


@pytest.fixture(scope="module")
def generator():
    path = REPO / "tools" / "dev" / "make_configuration_doc.py"
    spec = importlib.util.spec_from_file_location("make_configuration_doc", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors_of(page: Path, anchor) -> set[str]:
    """Every heading's anchor, a repeated one numbered -1, -2 … as GitHub numbers them."""
    seen: dict[str, int] = {}
    for line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            slug = anchor(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            yield slug if count == 0 else f"{slug}-{count}"


def links_of(page: Path) -> list[str]:
    """The targets of the page's links, code (fenced blocks and `spans`) left out."""
    text = "\n".join(CODE_SPAN.sub("``", line) for line in prose_lines(page.read_text(encoding="utf-8")))
    return LINK.findall(text)


# ---- the README --------------------------------------------------------------------------

def test_the_readme_is_a_landing_page_of_at_most_250_lines():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def test_the_readmes_first_screen_says_what_edgemm_is_that_the_built_in_model_is_a_toy_and_how_to_start():
    first_screen = "\n".join(README.read_text(encoding="utf-8").splitlines()[:40])
    assert "vision-language models" in first_screen and "Jetson" in first_screen
    assert "2.5 M-parameter demo" in first_screen and "4 questions" in first_screen
    assert "## Set-up: two commands" in first_screen


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / target.split("#")[0]).resolve() for target in links_of(README)}
    assert [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked] == []


def test_the_reference_has_at_least_7_pages_in_docs():
    pages = [page.name for page in DOCS.glob("*.md") if page.name not in MEASURED_ELSEWHERE]
    assert len(pages) >= 7, pages


def test_the_benchmarks_page_is_at_most_400_lines():
    assert len((DOCS / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()) <= 400


# ---- links -----------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_resolves_to_a_file_of_the_repository_and_its_anchor(page, generator):
    broken = []
    for target in links_of(page):
        if EXTERNAL.match(target):
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page.resolve()
        if not resolved.is_relative_to(REPO.resolve()) or not resolved.exists():
            broken.append(f"{target}: no such file in the repository")
        elif fragment and resolved.suffix == ".md" and fragment not in set(anchors_of(resolved, generator.anchor)):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == []


def test_anchors_are_made_as_github_makes_them(generator):
    assert generator.anchor("`--view OUT`: what the stream sees and says") == "--view-out-what-the-stream-sees-and-says"
    assert generator.anchor("Real models: Qwen2-VL and Qwen2.5-VL") == "real-models-qwen2-vl-and-qwen25-vl"
    assert generator.anchor("The daemon's streams") == "the-daemons-streams"
    assert generator.anchor("`streams[].alerts.<name>`") == "streamsalertsname"
    assert generator.anchor("See [the API](api.md)") == "see-the-api"


def test_a_link_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path, generator):
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section) [gone](missing.md) `[code](missing.md)`\n\n"
                    "```\n[fenced](missing.md)\n```\n[no anchor](other.md#nowhere)\n")
    assert links_of(page) == ["other.md#a-section", "missing.md", "other.md#nowhere"]
    assert set(anchors_of(tmp_path / "other.md", generator.anchor)) == {"other", "a-section"}


# ---- docs/configuration.md ------------------------------------------------------------------

def test_the_configuration_page_is_what_the_generator_renders_from_the_schema(generator):
    assert (DOCS / "configuration.md").read_text(encoding="utf-8") == generator.render(), \
        "docs/configuration.md is stale: run python tools/dev/make_configuration_doc.py"


def test_the_generators_check_exits_1_on_a_stale_page_and_0_on_a_fresh_one(tmp_path, generator, capsys):
    page = tmp_path / "configuration.md"
    page.write_text(generator.render().replace("| `max_pixels` |", "| `max_pixel` |"))
    assert generator.main(["--check", "--page", str(page)]) == 1
    assert "stale" in capsys.readouterr().err
    assert generator.main(["--page", str(page)]) == 0
    assert generator.main(["--check", "--page", str(page)]) == 0


def test_the_configuration_page_has_every_key_of_the_schema_with_its_default(generator):
    from edgemm.config import Config
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    pending = [Config]
    while pending:
        cls = pending.pop()
        for item in dataclasses.fields(cls):
            nested = generator._inner(typing.get_type_hints(cls)[item.name])
            if dataclasses.is_dataclass(nested):
                pending.append(nested)
            elif cls is not Config:
                assert f"| `{item.name}` |" in text, f"{cls.__name__}.{item.name}"
    assert "| `max_bytes` | integer | `67108864 (64 MiB)` |" in text
    assert '| `socket_mode` | string | `"0660"` |' in text  # YAML would read a bare 0660 as a number


@dataclass
class Webhook:
    """Where events go."""
    url: str = ""  # the endpoint
    # tried again this often,
    # at most
    retries: int = 3


@dataclass
class Alert:
    every: int = 1  # ask on every Nth frame
    webhook: Webhook | None = None  # this alert's own


@dataclass
class Stream:
    alerts: dict[str, Alert] = field(default_factory=dict)  # name → question
    webhook: Webhook | None = None  # the stream's


@dataclass
class Root:
    streams: list[Stream] = field(default_factory=list)  # the streams


@dataclass
class Undocumented:
    size: int = 1


@dataclass
class RootOfUndocumented:
    part: Undocumented = field(default_factory=Undocumented)  # a part


def test_sections_are_read_from_the_module_that_defines_them_with_the_comments_above_and_beside(generator):
    """The schema's classes may live in any module: here, this test's."""
    found = {section.cls: section for section in generator.sections(Root)}
    assert [found[cls].paths for cls in (Stream, Alert, Webhook)] == [
        ["streams[]"], ["streams[].alerts.<name>"], ["streams[].webhook", "streams[].alerts.<name>.webhook"]]
    assert found[Stream].text == "the streams"
    assert found[Webhook].text == "Where events go."
    keys = {key.name: key for key in found[Webhook].keys}
    assert keys["retries"].text == "tried again this often, at most" and keys["retries"].default == "3"
    assert keys["url"].text == "the endpoint" and keys["url"].default == '""'
    assert [key.section for key in found[Stream].keys] == [Alert, Webhook]


def test_a_key_without_a_comment_stops_the_generator(generator):
    with pytest.raises(SystemExit, match="Undocumented.size has no"):
        generator.sections(RootOfUndocumented)


# ---- docs/cli.md's option tables ------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_doc():
    path = REPO / "tools" / "dev" / "make_cli_doc.py"
    spec = importlib.util.spec_from_file_location("make_cli_doc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_pages_option_tables_are_what_the_command_defines(cli_doc):
    """Regenerate with `python tools/dev/make_cli_doc.py` when an option changes."""
    page = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert cli_doc.rewritten(page) == page, "docs/cli.md's option tables are stale: run python tools/dev/make_cli_doc.py"


def test_the_option_tables_hold_every_command_and_option(cli_doc):
    tables = cli_doc.render()
    for command in ("edgemm infer", "edgemm stream", "edgemm serve", "edgemm status", "edgemm doctor",
                    "edgemm engines build"):
        assert f"### `{command}`" in tables
    assert "`--json`" in tables and "`--max-new-tokens INTEGER" in tables and "`--dry-run`" in tables
    assert "`--help`" not in tables


def test_a_stale_option_table_is_found(cli_doc, tmp_path, monkeypatch):
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    head, tables = text.split(cli_doc.BEGIN)
    page = tmp_path / "cli.md"
    page.write_text(head + cli_doc.BEGIN + tables.replace("`--json`", "`--jsn`", 1), encoding="utf-8")
    monkeypatch.setattr(cli_doc, "PAGE", page)
    monkeypatch.setattr(cli_doc, "REPO", tmp_path)
    assert cli_doc.main(["--check"]) == 1
    assert cli_doc.main([]) == 0 and cli_doc.main(["--check"]) == 0
