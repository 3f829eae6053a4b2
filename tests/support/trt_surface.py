#!/usr/bin/env python3
"""The TensorRT Python API surface edgemm relies on, checked against the real bindings.

    python tests/support/trt_surface.py check            # 8.6.1, 10.3.0, the newest 10.x and 11.x from PyPI
    python tests/support/trt_surface.py dump tensorrt    # the installed module's surface as JSON (on a Jetson)

The bindings (`tensorrt-bindings`, `tensorrt-cu12-bindings`: about 1 MB each) are fetched with
`pip download` into a cache folder. Their libraries (libnvinfer …) are not on PyPI, but the
module imports once the few entry points it resolves at load exist: a stub library with
those symbols is compiled with the C compiler. Nothing is ever called on it.

The surface of a module: for every public class, its members; for every method, its
parameter names (from the pybind11 signature line of its docstring: keyword calls must
keep working); for every enum, its members and values. tests/support/fake_tensorrt.py is compared
with it: tests/test_trt_surface.py.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# the releases the check covers: JetPack 6.0 (8.6), JetPack 6.1/6.2 (10.3), the newest 10.x and 11.x
VERSIONS = {"8.6.1": "tensorrt-bindings==8.6.1", "10.3.0": "tensorrt-cu12-bindings==10.3.0",
            "10.16.1.11": "tensorrt-cu12-bindings==10.16.1.11", "11.4.0.106": "tensorrt-cu12-bindings==11.4.0.106"}
# what the bindings resolve from libnvinfer, libnvonnxparser, libnvinfer_plugin (and libnvparsers on 8.6)
STUB_SYMBOLS = ("createInferBuilder_INTERNAL", "createInferRefitter_INTERNAL", "createInferRuntime_INTERNAL",
                "createNvOnnxParserRefitter_INTERNAL", "createNvOnnxParser_INTERNAL", "getBuilderPluginRegistry",
                "getNvOnnxParserVersion", "getPluginRegistry", "initLibNvInferPlugins",
                "_ZN11nvuffparser15createUffParserEv", "_ZN11nvuffparser8FieldMapC1EPKcPKvNS_9FieldTypeEi",
                "_ZN14nvcaffeparser117createCaffeParserEv", "_ZN14nvcaffeparser123shutdownProtobufLibraryEv")
STUB_LIBRARIES = ("nvinfer", "nvonnxparser", "nvinfer_plugin", "nvparsers")
_SIGNATURE = re.compile(r"^(?:\d+\.\s*)?(\w+)\((.*)\)(?:\s*->.*)?$")


class Unavailable(Exception):
    """The bindings could not be fetched or loaded here (no network, no C compiler)."""


# ---- a module's surface ------------------------------------------------------------------------

def _parameters(member) -> list[list[str]] | None:
    """Each overload's parameter names, without self; None when it is not a callable."""
    if isinstance(member, property):
        return None
    if not callable(member):
        return None
    doc = getattr(member, "__doc__", None) or ""
    overloads = []
    for line in doc.splitlines():
        match = _SIGNATURE.match(line.strip())
        if match and match.group(1) == getattr(member, "__name__", match.group(1)):
            names = [p.split(":")[0].split("=")[0].strip() for p in _split(match.group(2))]
            overloads.append([n for n in names if n and n not in ("self", "*args", "**kwargs")])
    if overloads:
        return overloads
    try:
        signature = inspect.signature(member)
    except (TypeError, ValueError):
        return [[]]
    return [[n for n, p in signature.parameters.items() if n != "self"
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]]


def _split(params: str) -> list[str]:
    """Top-level commas only: 'a: List[int], b: Dict[str, int] = {}' → two parameters."""
    parts, depth, current = [], 0, ""
    for ch in params:
        depth += ch in "[(<{"
        depth -= ch in "])>}"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return parts + [current] if current.strip() else parts


def surface(module) -> dict:
    """{"version", "names": {name: kind}, "classes": {cls: {"members": {m: params|None}, "enum": {m: value}}}}."""
    out = {"version": str(getattr(module, "__version__", "?")), "names": {}, "classes": {}}
    for name in dir(module):
        if name.startswith("_"):
            continue
        value = getattr(module, name)
        if inspect.isclass(value):
            out["names"][name] = "class"
            members, enum = {}, {}
            entries = getattr(value, "__members__", None)
            if isinstance(entries, dict) or hasattr(entries, "items"):
                enum = {k: int(v) for k, v in dict(entries).items()}
            for member_name in dir(value):
                if (member_name.startswith("_") and member_name != "__init__") or member_name in enum:
                    continue
                try:
                    member = inspect.getattr_static(value, member_name)
                except AttributeError:
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = getattr(value, member_name)
                members[member_name] = _parameters(member)
            out["classes"][name] = {"members": members, "enum": enum}
        else:
            out["names"][name] = "function" if callable(value) else "value"
            if callable(value):
                out["classes"].setdefault("", {"members": {}, "enum": {}})["members"][name] = _parameters(value)
    return out


# ---- fetching the real bindings ----------------------------------------------------------------

def stub_library(folder: Path) -> Path:
    """A shared library that defines the entry points, under every name the bindings link."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise Unavailable("no C compiler (cc/gcc) to build the libnvinfer stub")
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / "libnvinfer_stub.so"
    if not library.is_file():
        source = folder / "stub.c"
        source.write_text("".join(f"void *{symbol}(void) {{ return 0; }}\n" for symbol in STUB_SYMBOLS))
        built = subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            raise Unavailable(f"the libnvinfer stub did not compile: {built.stderr.strip()[:200]}")
    for major in (8, 10, 11):
        for name in STUB_LIBRARIES:
            link = folder / f"lib{name}.so.{major}"
            if not link.exists():
                link.symlink_to(library.name)
    return folder


def fetch(version: str, cache: Path) -> Path:
    """The bindings of `version` unpacked in the cache: the folder that holds tensorrt_bindings/."""
    target = cache / f"tensorrt-{version}"
    if (target / "tensorrt_bindings").is_dir():
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    package, _, _ = VERSIONS[version].partition("==")
    prefix = package.replace("-", "_") + "-" + version
    wheel = next((w for w in wheels.glob(f"{prefix}-*.whl")), None)
    if wheel is None:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--timeout", "20", "--retries", "1",
                   "--dest", str(wheels), VERSIONS[version]]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"pip download {VERSIONS[version]} timed out (no network?)") from None
        wheel = next((w for w in wheels.glob(f"{prefix}-*.whl")), None)
        if done.returncode != 0 or wheel is None:
            last = (done.stderr.strip().splitlines() or ["no wheel for this Python"])[-1]
            raise Unavailable(f"pip download {VERSIONS[version]} failed: {last[:200]}")
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(tmp)
        shutil.rmtree(target, ignore_errors=True)
        Path(tmp).rename(target)
        target.mkdir(exist_ok=True)  # TemporaryDirectory's cleanup finds nothing to remove
    return target


def real_surface(version: str, cache: Path) -> dict:
    """The surface of the real bindings of `version`, read in a subprocess that loads the stub."""
    folder = fetch(version, cache)
    stubs = stub_library(cache / "stub")
    env = {**os.environ, "LD_LIBRARY_PATH": f"{stubs}:{os.environ.get('LD_LIBRARY_PATH', '')}",
           "PYTHONPATH": f"{folder}{os.pathsep}{Path(__file__).resolve().parent}"}
    done = subprocess.run([sys.executable, __file__, "dump", "tensorrt_bindings"], capture_output=True, text=True,
                          env=env, timeout=120)
    if done.returncode != 0:
        raise Unavailable(f"TensorRT {version} bindings did not import: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout)


# ---- the comparison ------------------------------------------------------------------------------

def missing(used: set[tuple[str, str]], real: dict, fake: dict | None = None) -> list[str]:
    """What `used` names that `real` lacks: ('', 'Runtime') is a module name, ('Runtime', 'DLA_core') a
    member or enum member; with `fake`, methods whose parameter names differ from the real ones too."""
    errors = []
    for owner, name in sorted(used):
        if owner == "":
            if name not in real["names"] and name != "__version__":
                errors.append(f"tensorrt.{name} does not exist")
            continue
        cls = real["classes"].get(owner)
        if cls is None:
            errors.append(f"tensorrt.{owner} does not exist")
            continue
        if name in cls["enum"]:
            if fake is not None and fake["classes"].get(owner, {}).get("enum", {}).get(name, cls["enum"][name]) \
                    != cls["enum"][name]:
                errors.append(f"tensorrt.{owner}.{name} is {cls['enum'][name]}, the fake says "
                              f"{fake['classes'][owner]['enum'][name]}")
            continue
        if name not in cls["members"]:
            errors.append(f"tensorrt.{owner}.{name} does not exist")
            continue
        fake_params = (fake or {}).get("classes", {}).get(owner, {}).get("members", {}).get(name)
        real_params = cls["members"][name]
        # the fake's parameters must begin one real overload (it may leave out trailing defaulted ones)
        if fake_params and real_params and not any(p[:len(fake_params[0])] == fake_params[0] for p in real_params):
            errors.append(f"tensorrt.{owner}.{name}({', '.join(fake_params[0])}): the real one takes "
                          + " or ".join(f"({', '.join(p)})" for p in real_params))
    return errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", help="print a module's surface as JSON")
    dump.add_argument("module", nargs="?", default="tensorrt")
    check = sub.add_parser("check", help="the fake's recorded use against the real bindings (runs the tests)")
    check.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "edgemm-trt-bindings")
    args = ap.parse_args(argv)
    if args.command == "dump":
        import importlib
        print(json.dumps(surface(importlib.import_module(args.module))))
        return 0
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "EDGEMM_TRT_BINDINGS": str(args.cache)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", str(root / "tests" / "test_trt_surface.py")],
                          env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
