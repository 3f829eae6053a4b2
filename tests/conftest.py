"""Shared fixtures: the built-in model folder, one loaded runtime, and throwaway copies."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from edgemm.config import load_config
from edgemm.engine.runtime import Runtime

# the clone's symlink to edgemm/builtin/tiny-vlm (tests/test_packaging.py checks it): unresolved,
# so model_dir.parent.parent is the repository
MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "tiny-vlm"


@pytest.fixture(scope="session", autouse=True)
def _no_precision_measurements(tmp_path_factory):
    """`precision: auto` reads tools/choose_precisions.py's measurements from the user's cache:
    the suite reads an empty folder of its own instead (session-wide, so that the session's
    runtimes, made before any function fixture, see it too; subprocesses inherit it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGEMM_PRECISIONS", str(tmp_path_factory.mktemp("precisions")))
        yield


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """Tests must not pick up the developer's EDGEMM_* settings."""
    for name in ("EDGEMM_CONFIG", "EDGEMM_MODEL", "EDGEMM_DEBUG", "EDGEMM_ENGINES"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return MODEL_DIR


@pytest.fixture(scope="session")
def ground_truth(model_dir) -> dict:
    """samples/ground_truth.json: {file name: {"seed", "questions": [{task, prompt, answer}]}}."""
    return json.loads((model_dir / "samples" / "ground_truth.json").read_text())


@pytest.fixture(scope="session")
def runtime(model_dir) -> Runtime:
    """The built-in model as a user gets it (precision auto: its q4 on a CPU), on one CPU thread, loaded once."""
    return Runtime(load_config({"model": {"path": str(model_dir)},
                                "backend": {"intra_op_threads": 1}}))


@pytest.fixture(scope="session")
def make_runtime(model_dir):
    """make_runtime(limits={...}, model={...}) → a fresh Runtime (one thread, no warm-up)."""
    def make(**sections) -> Runtime:
        cfg = {"model": {"path": str(model_dir)},
               "backend": {"intra_op_threads": 1, "warmup": False}}
        for key, values in sections.items():
            cfg[key] = {**cfg.get(key, {}), **values}
        return Runtime(load_config(cfg))
    return make


@pytest.fixture
def tmp_model(model_dir, tmp_path) -> Path:
    """A private copy of the model folder, free to break."""
    return Path(shutil.copytree(model_dir, tmp_path / "tiny-vlm"))
