"""How edgemm's packages and modules depend on each other, and how model families are found.

The import graph is read from the source with `ast`, not by importing. Every import counts:
at module level (including class bodies, module-level try/if and `if TYPE_CHECKING:`
blocks, whose imports are edges a type checker follows even if Python does not) and inside
functions, since deferring an import hides a cycle without removing it.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import edgemm
from edgemm.errors import ModelError
from edgemm.model import family
from edgemm.model.families.gemma3 import Gemma3Adapter
from edgemm.model.families.idefics3 import Idefics3Adapter
from edgemm.model.families.llava import LlavaAdapter
from edgemm.model.families.tiny_vlm import TinyVLMAdapter
from edgemm.model.family import Family, family_entry, family_for, register, registered
from edgemm.model.manifest import load_manifest

PACKAGE = Path(edgemm.__file__).resolve().parent
IDEFICS3_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "idefics3-tiny"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement may load (`from a import b` may load a.b)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package, up level - 1
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _imports(node: ast.AST, in_function: bool = False):
    """(import statement, inside a function?) for every import under `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        else:
            yield from _imports(child, in_function or isinstance(child, FUNCTIONS))


def import_graph(with_function_imports: bool = False) -> dict[str, set[str]]:
    """edgemm module → the edgemm modules it imports (at module level, or anywhere)."""
    known = modules()

    def owner(name: str) -> str | None:  # `edgemm.model.family.Prompt` → `edgemm.model.family`
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets: set[str] = set()
        for node, in_function in _imports(tree):
            if in_function and not with_function_imports:
                continue
            for name in _imported(node, module, path.name == "__init__.py"):
                target = owner(name) if name.startswith("edgemm") else None
                if target is not None and target != module and not module.startswith(target + "."):
                    targets.add(target)  # a module's own package is imported first anyway: not an edge
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first search meets, as a path that starts and ends at one module."""
    found, state, path = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


# ---- the import graph ---------------------------------------------------------------------

def test_the_graph_reader_sees_imports_and_cycles():
    """The checks below are only worth something if the reader finds real edges and cycles."""
    graph = import_graph()
    assert "edgemm.model.family" in graph["edgemm.engine.runtime"]
    assert "edgemm.model.manifest_types" in graph["edgemm.model.hf_folder"]
    assert "edgemm.model.families.tiny_vlm" not in graph["edgemm.model.family"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_edgemm_modules():
    assert cycles(import_graph()) == []


def test_model_package_has_no_cycles_even_through_function_level_imports():
    """Deferring an import into a function hides a cycle, it doesn't remove it: the model
    package (families, manifests, folders) has none at all."""
    graph = import_graph(with_function_imports=True)
    model = {m: {t for t in targets if t.startswith("edgemm.model")}
             for m, targets in graph.items() if m.startswith("edgemm.model")}
    assert cycles(model) == []


def test_family_module_imports_no_family():
    """The registry finds the families; it never names one."""
    graph = import_graph(with_function_imports=True)
    assert not any(t.startswith("edgemm.model.families") for t in graph["edgemm.model.family"])
    assert "edgemm.model.hf_folder" not in graph["edgemm.model.manifest_types"]


def test_a_family_is_imported_by_no_other_module():
    """What families share lives below them (model.family, model.chat_template, model.hf_folder …):
    no family imports another, and nothing outside the families package names one (the engine
    builder asks the registry), so a family's file is all there is of it."""
    graph = import_graph(with_function_imports=True)
    families = {m for m in graph if m.startswith("edgemm.model.families.")}
    assert {"edgemm.model.families.qwen2_vl", "edgemm.model.families.llava"} <= families
    importers = {m: sorted(graph[m] & families) for m in graph if graph[m] & families}
    assert importers == {}


# ---- the family registry ----------------------------------------------------------------

def test_built_in_families_are_registered_by_model_type():
    known = registered()
    assert known["tiny-vlm"].adapter is TinyVLMAdapter
    assert known["idefics3"].adapter is known["smolvlm"].adapter is Idefics3Adapter
    assert known["smolvlm"].name == "idefics3"  # what ModelManifest.family says for either
    assert known["tiny-vlm"].hf_folder is None and known["idefics3"].hf_folder is not None


@pytest.mark.parametrize("folder, cls", [(PACKAGE.parent / "models" / "tiny-vlm", TinyVLMAdapter),
                                         (IDEFICS3_FIXTURE, Idefics3Adapter),
                                         (IDEFICS3_FIXTURE.parent / "gemma3-tiny", Gemma3Adapter),
                                         (IDEFICS3_FIXTURE.parent / "llava-tiny", LlavaAdapter)])
def test_each_family_is_what_the_runtime_expects(folder, cls):
    adapter = family_for(load_manifest(folder))
    assert type(adapter) is cls and isinstance(adapter, Family)


def test_unknown_model_type_is_one_line_naming_the_known_ones():
    with pytest.raises(ModelError) as info:
        family_entry("no_such_vlm", "models/x/config.json: unknown model_type")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("models/x/config.json: unknown model_type 'no_such_vlm' (known: ")
    assert all(name in message for name in ("idefics3", "smolvlm", "tiny-vlm"))


def test_a_new_family_is_one_new_module(tmp_path, monkeypatch):
    """A module dropped into the families package is found and registered, with no other edit."""
    registered()  # the real built-ins, before the package is swapped
    package = tmp_path / "more_families"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_helpers.py").write_text("raise AssertionError('modules starting with _ are skipped')\n")
    (package / "florence2.py").write_text(
        "from edgemm.model.family import register\n\n\n"
        "@register('florence2', 'florence2_large')\n"
        "class Florence2:\n"
        "    def __init__(self, manifest):\n"
        "        self.manifest = manifest\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(family, "BUILTIN_FAMILIES", "more_families")
    monkeypatch.setattr(family, "_registry", dict(family._registry))  # restored afterwards
    monkeypatch.setattr(family, "_discovered", False)
    monkeypatch.delitem(sys.modules, "more_families", raising=False)
    entry = family_entry("florence2_large", "unknown model_type")
    assert entry.name == "florence2" and entry.adapter.__module__ == "more_families.florence2"
    assert "tiny-vlm" in registered()  # the built-ins are still there


def test_two_families_cannot_claim_one_model_type(monkeypatch):
    monkeypatch.setattr(family, "_registry", dict(registered()))

    class Impostor:
        pass

    with pytest.raises(ValueError, match="'smolvlm' is already the family idefics3"):
        register("impostor", "smolvlm")(Impostor)
    assert "impostor" not in family._registry  # refused whole, not half-registered


# ---- the packages of docs/ARCHITECTURE.md -------------------------------------------------

ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"


def documented_layers() -> dict[str, int]:
    """package (`util`, `engine` …; a top-level module such as `config`; `edgemm` for the
    package's own __init__) → its layer, read from the table under "## Layers" in
    docs/ARCHITECTURE.md."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for name in cells[1].replace("`", " ").split():
                layers[name] = int(cells[0])
    return layers


def package_of(module: str) -> str:
    """`edgemm.engine.decode` → `engine`, `edgemm.config` → `config`, `edgemm` → `edgemm`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "edgemm"


def test_package_of_names_the_first_folder_below_edgemm():
    assert package_of("edgemm.backends.tensorrt.build") == "backends"
    assert package_of("edgemm.errors") == "errors" and package_of("edgemm") == "edgemm"


def test_every_package_has_a_documented_layer():
    layers = documented_layers()
    assert len(layers) >= 10, "the layer table was not found"
    packages = {package_of(m) for m in modules()}
    missing = sorted(packages - set(layers))
    assert not missing, f"add these packages to the layer table of docs/ARCHITECTURE.md: {missing}"
    gone = sorted(set(layers) - packages)
    assert not gone, f"docs/ARCHITECTURE.md lists packages that do not exist: {gone}"
    assert len(set(layers.values())) == len(layers), "one package a layer: the order is total"


def test_imports_point_down_the_documented_layers():
    """A module imports modules of its own package or of lower ones only, in functions and
    under TYPE_CHECKING too."""
    layers = documented_layers()
    upward = [f"{m} ({package_of(m)}, layer {layers[package_of(m)]}) imports {t} (layer {layers[package_of(t)]})"
              for m, targets in import_graph(with_function_imports=True).items()
              for t in targets if layers[package_of(t)] > layers[package_of(m)]]
    assert not upward, upward


def test_the_graph_reader_counts_type_checking_and_function_imports(tmp_path):
    tree = ast.parse("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from edgemm.server import service\n"
                     "def f():\n    import edgemm.cli.main\n")
    found = [(ast.unparse(node), inside) for node, inside in _imports(tree)]
    assert ("from edgemm.server import service", False) in found
    assert ("import edgemm.cli.main", True) in found


def test_no_import_cycles_even_through_function_level_imports():
    assert cycles(import_graph(with_function_imports=True)) == []


def test_the_top_level_holds_few_modules_and_no_module_is_long():
    """The folders tell the architecture: at most 10 modules directly in edgemm/, and no
    module over 600 lines (split by job, not by size alone)."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top
    long = sorted(f"{m} ({n} lines)" for m, path in modules().items()
                  if (n := len(path.read_text(encoding="utf-8").splitlines())) > 600)
    assert not long, long


def test_error_classes_live_in_one_module_per_package():
    """Every exception class edgemm defines is in edgemm/errors.py (the base classes, and those
    several packages raise) or in its own package's errors.py, so a package's failures are
    read in one place."""
    import importlib
    import inspect

    found = {}
    for module in modules():
        for name, obj in vars(importlib.import_module(module)).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module:
                found[f"{module}.{name}"] = module
    assert {"edgemm.errors.EdgemmError", "edgemm.server.errors.ApiError"} <= set(found)  # the reader finds them
    elsewhere = sorted(name for name, module in found.items()
                       if module != "edgemm.errors" and module != f"edgemm.{package_of(module)}.errors")
    assert not elsewhere, elsewhere


OUTSIDE = re.compile(r"\.\./(\.\./)*" + "shared" + r"|" + "shared" + r"/DESIGN")  # spelled apart: not a match itself


def test_the_repository_links_nothing_outside_it():
    """Docs, code and tools point inside the repository (a clone has nothing beside it)."""
    root = PACKAGE.parent
    tracked = [p for p in root.rglob("*") if p.is_file() and p.suffix in (".md", ".py", ".yaml", ".jinja")
               and not any(part.startswith(".") or part in ("build", "node_modules") for part in p.relative_to(root).parts)]
    outside = [f"{p.relative_to(root)}: {line.strip()[:80]}" for p in tracked
               for line in p.read_text(encoding="utf-8", errors="replace").splitlines()
               if OUTSIDE.search(line)]
    assert not outside, outside


# ---- the repository's scripts: tools/ for users, bench/ for benchmarks, tests/support/ for tests ----

REPO = Path(__file__).resolve().parent.parent
# spelled apart so this file is not a match itself
PATH_EDIT = re.compile(r"sys\.path\s*(\.\s*(" + "insert|append|extend" + r")\b|\[[^\]]*\]\s*=|\+=)")
IMPORT_MODULE = re.compile(r"import_module\(\s*[\"']([\w.]+)")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any level, by absolute dotted name (with `from m import
    n`, both m and m.n), and the modules it names to importlib.import_module."""
    text = path.read_text(encoding="utf-8")
    names = set(IMPORT_MODULE.findall(text))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def test_no_test_imports_a_benchmark():
    """What a test and a benchmark share (fakes, harnesses, reference decoders) lives in
    tests/support/; a test never reaches into bench/, by package or by a benchmark's bare name."""
    benchmarks = {path.stem for path in (REPO / "bench").glob("*.py")}
    assert "bench_faults" in benchmarks  # the folder this guards is where it is
    found = sorted(f"{path.relative_to(REPO)}: {name}" for path in (REPO / "tests").rglob("*.py")
                   for name in imported_modules(path)
                   if name.split(".")[0] in {"bench", *benchmarks})
    assert not found, found


def test_no_test_edits_the_import_path():
    """pytest's `pythonpath` (pyproject.toml) puts the repository root on the path; nothing
    under tests/ edits sys.path itself."""
    found = sorted(f"{path.relative_to(REPO)}:{n}: {line.strip()[:80]}" for path in (REPO / "tests").rglob("*.py")
                   for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                   if PATH_EDIT.search(line))
    assert not found, found


def test_the_path_edit_pattern_finds_what_it_forbids():
    path = "sys." + "path"  # spelled apart: these lines are not matches themselves
    for line in [f"{path}.insert(0, str(ROOT))", f"{path}.append('tools')", f'{path}[:0] = ["tools"]', f"{path} += [x]"]:
        assert PATH_EDIT.search(line), line
    assert not PATH_EDIT.search("paths = [p for p in sys.path if p]")


def test_tools_holds_only_what_users_run():
    """tools/ top level: the user commands and the helpers only they need, at most 15; every
    one of them in tools/README.md's table."""
    top = sorted(path.name for path in (REPO / "tools").glob("*.py"))
    assert len(top) <= 15, top
    table = (REPO / "tools" / "README.md").read_text(encoding="utf-8")
    assert not [name for name in top if name not in table]
