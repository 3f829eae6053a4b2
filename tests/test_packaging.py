"""How edgemm installs: the built-in model in a wheel, whichever OpenCV the environment has
(or one line saying what to install), an onnx that onnxruntime can read, and the tools that
need the train extra saying so."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgemm.engine.loading import default_engines_dir, default_engines_root
from edgemm.engine.runtime import BUILTIN_MODEL

REPO = Path(__file__).resolve().parent.parent
COUNT_PROMPT = "how many shapes are there ?"


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEMM_") and k != "PYTHONPATH"}
    return {**env, **extra}


# ---- the built-in model ships in the package -------------------------------------------

def test_the_built_in_model_is_package_data_and_the_clone_links_to_it():
    assert BUILTIN_MODEL == Path(__file__).resolve().parent.parent / "edgemm" / "builtin" / "tiny-vlm"
    assert (BUILTIN_MODEL / "model.yaml").is_file() and (BUILTIN_MODEL / "vision_encoder.onnx").is_file()
    # the clone's models/tiny-vlm, which the README's commands and the tools name
    assert (REPO / "models" / "tiny-vlm").resolve() == BUILTIN_MODEL.resolve()


@pytest.mark.slow
def test_a_wheel_installed_outside_the_clone_answers(tmp_path, ground_truth):
    """pip wheel → a fresh venv elsewhere → `edgemm infer IMAGE` answers from the model inside the wheel.

    The venv gets edgemm from the wheel alone (--no-deps); its dependencies are this test
    environment's, through a .pth file, so nothing is downloaded but the build backend."""
    source = tmp_path / "src"  # a copy, so the build leaves nothing in the clone
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "edgemm", source / "edgemm", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("edgemm-*.whl"))

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # this environment's dependencies (its site-packages, and the system's where it sees them), after
    # the venv's own site-packages, so edgemm is the wheel's; no folder that holds an edgemm package
    paths = [p for p in sys.path if p and Path(p).is_dir() and not (Path(p) / "edgemm").exists()]
    (site / "test_dependencies.pth").write_text("\n".join(paths) + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]

    where = subprocess.run([str(python), "-c", "import edgemm.engine.runtime as r; print(r.BUILTIN_MODEL)"],
                           capture_output=True, text=True, cwd=tmp_path, env=clean_env(), timeout=60)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout  # not the clone's copy
    # the live view's page is package data too (GET / reads it from the installed package)
    page = subprocess.run([str(python), "-c", "from edgemm.server.liveview import page; print(page()[:15].decode())"],
                          capture_output=True, text=True, cwd=tmp_path, env=clean_env(), timeout=60)
    assert page.returncode == 0 and page.stdout.strip() == "<!doctype html>", page.stderr

    name, entry = next((n, e) for n, e in ground_truth.items()
                       if any(q["prompt"] == COUNT_PROMPT for q in e["questions"]))
    answer = next(q["answer"] for q in entry["questions"] if q["prompt"] == COUNT_PROMPT)
    image = shutil.copy(BUILTIN_MODEL / "samples" / name, tmp_path / name)
    done = subprocess.run([str(venv / "bin" / "edgemm"), "infer", str(image), "--prompt", COUNT_PROMPT,
                           "--threads", "1", "--json"], capture_output=True, text=True, cwd=tmp_path,
                          env=clean_env(HOME=str(tmp_path)), timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["answer"] == answer and result["model"] == "tiny-vlm"


# ---- engines default to a writable place, never site-packages -------------------------

def test_engines_default_to_the_users_cache_or_the_system_for_root(monkeypatch, tmp_path):
    monkeypatch.delenv("EDGEMM_ENGINES", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert default_engines_dir("tiny-vlm") == tmp_path / "cache" / "edgemm" / "engines" / "tiny-vlm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_engines_root() == tmp_path / "home" / ".cache" / "edgemm" / "engines"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_engines_root() == Path("/var/lib/edgemm/engines")
    monkeypatch.setenv("EDGEMM_ENGINES", str(tmp_path / "mine"))  # edgemm.service sets it
    assert default_engines_dir("tiny-vlm") == tmp_path / "mine" / "tiny-vlm"


def test_the_service_reads_engines_from_var_lib():
    unit = (REPO / "systemd" / "edgemm.service").read_text()
    assert "Environment=EDGEMM_ENGINES=/var/lib/edgemm/engines" in unit.splitlines()


# ---- OpenCV: whichever the environment has, or one line --------------------------------

def run_cli(args: list[str], python_prelude: str = "", **env: str) -> subprocess.CompletedProcess:
    code = f"import sys\n{python_prelude}\nfrom edgemm.cli.main import main\nsys.argv = ['edgemm', *{args!r}]\nmain()\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=clean_env(**env), cwd=REPO)


def test_without_opencv_commands_say_what_to_install_in_one_line():
    image = str(BUILTIN_MODEL / "samples" / "scene_11.png")
    done = run_cli(["infer", image], "sys.modules['cv2'] = None  # as if no cv2 were installed")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("edgemm: error: OpenCV (cv2) is not installed: install it with: "
                                  "pip install 'edgemm[opencv]'")
    assert "--system-site-packages" in done.stderr and "edgemm[jetson]" in done.stderr
    # doctor does not stop there: OpenCV is one failed check among the others (exit 3)
    doctor = run_cli(["doctor"], "sys.modules['cv2'] = None")
    assert (doctor.returncode, doctor.stderr) == (3, "")
    assert f"fail  opencv: {done.stderr.removeprefix('edgemm: error: ')}" in doctor.stdout
    assert "python: " in doctor.stdout.splitlines()[0] and "engines: " in doctor.stdout


def test_a_cv2_built_for_numpy_1_under_numpy_2_is_one_line_not_numpys_page(tmp_path):
    # What JetPack's cv2 does under NumPy 2: NumPy prints a page with a stack trace, then the import fails.
    fake = tmp_path / "cv2"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import sys\n"
        "sys.stderr.write('A module that was compiled using NumPy 1.x cannot be run in NumPy 2\\n'\n"
        "                 'Traceback (most recent call last):\\n  ...\\nAttributeError: _ARRAY_API not found\\n')\n"
        "raise ImportError('numpy.core.multiarray failed to import')\n")
    done = run_cli(["infer", str(BUILTIN_MODEL / "samples" / "scene_11.png")], PYTHONPATH=str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr and "_ARRAY_API" not in done.stderr
    assert "numpy.core.multiarray failed to import" in done.stderr and "pip install 'numpy<2'" in done.stderr


def _system_gstreamer() -> bool:
    from edgemm.streams.sources.gstreamer import gstreamer_available
    return gstreamer_available()


@pytest.mark.skipif(not _system_gstreamer(), reason="this OpenCV has no GStreamer (PyPI's wheel); the Jetson "
                    "install's, e.g. Debian's or JetPack's python3-opencv, has")
def test_with_a_gstreamer_opencv_a_csi_pipeline_gets_past_the_check_and_runs():
    """Run where cv2 is the system's GStreamer-enabled python3-opencv (.ci/run's Jetson stand-in):
    csi:// passes edgemm's GStreamer check, and its pipeline runs in this OpenCV's GStreamer once
    the Argus camera and NVIDIA's converter (absent off a Jetson) are replaced by a test source."""
    from edgemm.util.opencv import cv2
    from edgemm.streams.errors import SourceUnusable
    from edgemm.streams.sources import open_source
    from edgemm.streams.sources.capture import CsiSource
    from edgemm.streams.sources.gstreamer import csi_pipeline

    source = open_source("csi://0")
    assert isinstance(source, CsiSource)
    try:  # with the pip wheel: SourceUnusable "needs OpenCV built with GStreamer"
        source._preflight()
    except SourceUnusable as e:  # past OpenCV's GStreamer check: off a Jetson, NVIDIA's elements are missing
        assert "GStreamer has no element nvarguscamerasrc" in str(e), e
    elements = csi_pipeline(0, width=160, height=120, fps=10).split(" ! ")
    assert elements[0].startswith("nvarguscamerasrc") and elements[2] == "nvvidconv"
    elements[0] = "videotestsrc num-buffers=3"
    elements[1] = elements[1].replace("(memory:NVMM)", "")
    elements[2] = "videoconvert"
    capture = cv2.VideoCapture(" ! ".join(elements), cv2.CAP_GSTREAMER)
    try:
        assert capture.isOpened()
        ok, frame = capture.read()
    finally:
        capture.release()
    assert ok and frame.shape == (120, 160, 3) and frame.dtype == np.uint8


# ---- onnx and onnxruntime agree on the IR version --------------------------------------

@pytest.mark.parametrize("extras, admitted, refused", [
    (("jetson", "tensorrt"), "12.9.0", "13.0.0"),  # JetPack 6: cuda-bindings 13 needs a CUDA 13 driver
    (("jetpack7", "tensorrt"), "13.0.0", "12.9.0")])
def test_each_jetpacks_install_gets_the_cuda_bindings_of_its_driver(extras, admitted, refused):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement
    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    specifiers = [Requirement(r).specifier for extra in extras for r in optional[extra]
                  if Requirement(r).name == "cuda-bindings"]
    assert specifiers and all(s.contains(admitted) for s in specifiers)
    assert not all(s.contains(refused) for s in specifiers)
    assert f"[{','.join(extras)}]" in (REPO / "docs" / "jetson.md").read_text()  # the install steps name these extras


def test_the_installed_onnx_writes_an_ir_version_the_installed_onnxruntime_reads(tmp_path):
    """The tools save graphs with this onnx; onnxruntime must load them. pyproject.toml bounds onnx
    where the newest onnxruntime is older (Python 3.10: onnxruntime 1.23 reads IR <= 11)."""
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert model.ir_version == onnx.IR_VERSION  # what a graph made with this onnx gets by default
    onnx.save(model, str(tmp_path / "identity.onnx"))
    session = ort.InferenceSession(str(tmp_path / "identity.onnx"), providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": np.array([3.0], np.float32)})[0].tolist() == [3.0]


# ---- the tools that need torch say which extra --------------------------------------------

@pytest.mark.parametrize("tool", ["train_tiny_vlm.py", "export_tiny_vlm.py"])
def test_training_tools_without_torch_name_the_extra(tool):
    path = str(REPO / "tools" / tool)
    code = ("import runpy, sys\nsys.modules['torch'] = None  # as if torch were not installed\n"
            f"sys.argv = [{path!r}, '--help']\nrunpy.run_path({path!r}, run_name='__main__')\n")
    # cwd tools/: first on the path (-c), as a script's own folder is; the tool imports extras from it
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=clean_env(), cwd=REPO / "tools")
    assert done.returncode == 2
    assert done.stderr == f"error: tools/{tool} needs torch, which the train extra installs: pip install -e '.[train]'\n"
