"""The command line on a full disk: results that cannot be written are one line and exit 2.

Each case runs the real `edgemm` in a process of its own with its output on /dev/full
(every write fails with ENOSPC): what is checked is the exit code, stderr, and that the
process ends cleanly — the stream case once aborted at interpreter exit ("terminate called
without an active exception", exit 134) when its reader thread was left inside OpenCV.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLE = Path(__file__).resolve().parents[1] / "models" / "tiny-vlm" / "samples" / "scene_11.png"
FULL = "/dev/full"
STREAM = ["stream", "synthetic://?count=3&size=64", "--tier", "low", "--max-new-tokens", "1"]

pytestmark = pytest.mark.skipif(not os.path.exists(FULL), reason="needs /dev/full (Linux)")


@pytest.fixture
def config(tmp_path) -> Path:
    """One thread and no warm-up: fast, and no progress lines besides the error on stderr."""
    path = tmp_path / "edgemm.yaml"
    path.write_text("backend:\n  intra_op_threads: 1\n  warmup: false\n")
    return path


def start(args: list[str], stdout_to_full: bool, prelude: str = "") -> subprocess.Popen:
    """`edgemm ARGS` (with `prelude` run first in the process), stdout to /dev/full or discarded."""
    code = f"{prelude}\nimport sys\nfrom edgemm.cli.main import main\nsys.argv[0] = 'edgemm'\nmain()"
    with open(FULL if stdout_to_full else os.devnull, "wb") as out:
        return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=out,
                                stderr=subprocess.PIPE, env={**os.environ, "EDGEMM_DEBUG": ""})


def finish(process: subprocess.Popen) -> tuple[int, list[str]]:
    try:
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    return process.returncode, stderr.decode(errors="replace").splitlines()


def run(args: list[str], stdout_to_full: bool = False, prelude: str = "") -> tuple[int, list[str]]:
    return finish(start(args, stdout_to_full, prelude))


@pytest.mark.parametrize("args", [
    ["infer", SAMPLE, "-q", "--config"],
    ["infer", SAMPLE, "-q", "--json", "--config"],
    ["status", "--json", "--config"],
    ["status", "--config"],
    ["doctor", "--json", "--config"],
    ["engines", "build", SAMPLE.parents[1], "--dry-run", "--tensorrt", "10.3"],
], ids=["infer", "infer-json", "status-json", "status", "doctor-json", "engines-build-dry-run"])
def test_a_result_on_a_full_stdout_is_one_line_and_exit_2(args, config):
    code, stderr = run([*args, config] if args[-1] == "--config" else args, stdout_to_full=True)
    assert (code, stderr) == (2, ["edgemm: error: cannot write standard output: No space left on device"])


def test_a_stream_on_a_full_disk_ends_cleanly_every_time(config):
    """20 runs (the abort at exit was intermittent), two at a time, one with --out /dev/full
    and one with stdout on it: exit 2 and the one line each, never "Fatal Python error" / 134."""
    args = [*STREAM, "--config", config]
    expected = [["edgemm: error: cannot write --out /dev/full: No space left on device"],
                ["edgemm: error: cannot write standard output: No space left on device"]]
    outcomes = []
    for _ in range(10):
        pair = [start([*args, "--out", FULL], stdout_to_full=False), start(args, stdout_to_full=True)]
        outcomes.append([finish(p) for p in pair])
    assert all([code for code, _ in pair] == [2, 2] for pair in outcomes), outcomes
    assert all([stderr for _, stderr in pair] == expected for pair in outcomes), outcomes


@pytest.mark.parametrize("source", ["synthetic://?count=3&size=64", "synthetic://?count=3&size=64&fps=10"],
                         ids=["files", "live"])  # paced synthetic is live: its frames go to the view in the reader
def test_a_stream_view_folder_on_a_full_disk_is_one_line_and_exit_2(source, config, tmp_path):
    """A folder cannot be /dev/full: cv2.imwrite is made to fail as it does on a full disk
    (it returns False)."""
    folder = tmp_path / "frames"
    folder.mkdir()
    out = tmp_path / "answers.jsonl"
    code, stderr = run(["stream", source, "--tier", "low", "--max-new-tokens", "1", "--config", config,
                        "--view", f"{folder}/", "--out", out],
                       prelude="import cv2\ncv2.imwrite = lambda *args, **kwargs: False")
    assert (code, stderr) == (2, [f"edgemm: error: --view {folder}/: could not write frame_000000.jpg"])
    assert not list(folder.iterdir()) and "error" not in out.read_text()  # not a source's failure


def test_a_stream_that_can_write_still_ends_with_its_summary(config, tmp_path):
    """The wind-down of the stream's threads does not change a normal end."""
    out = tmp_path / "answers.jsonl"
    code, stderr = run([*STREAM, "--config", config, "--out", out])
    assert code == 0, stderr
    assert len(out.read_text().splitlines()) == 3
    assert len(stderr) == 1 and stderr[0].startswith("edgemm: summary: ")


def run_with(args: list[str], close: int | None = None, stderr_to_full: bool = False,
             prelude: str = "") -> tuple[int, str, list[str]]:
    """`edgemm ARGS` with descriptor `close` (1 or 2) closed when it starts (a shell's `>&-`),
    or its stderr on /dev/full: (exit code, stdout, stderr lines; [] for a stderr closed or full)."""
    code = f"{prelude}\nimport sys\nfrom edgemm.cli.main import main\nsys.argv[0] = 'edgemm'\nmain()"
    with open(FULL, "wb") as full:
        process = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                                   stderr=full if stderr_to_full else subprocess.PIPE,
                                   preexec_fn=(lambda: os.close(close)) if close else None,
                                   env={**os.environ, "EDGEMM_DEBUG": ""})
    try:
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    return process.returncode, (stdout or b"").decode(), (stderr or b"").decode(errors="replace").splitlines()


@pytest.mark.parametrize("args", [["infer", SAMPLE, "--config"], [*STREAM, "--config"]], ids=["infer", "stream"])
def test_a_closed_stdout_is_one_line_and_exit_2_before_the_model_loads(args, config):
    # the stream exited 0 with "frames: 3" and every line dropped; infer exited 1 (an AttributeError)
    prelude = "import edgemm.engine.runtime\nedgemm.engine.runtime.Runtime = None  # loading the model would be a TypeError"
    assert run_with([*args, config], close=1, prelude=prelude) == (
        2, "", ["edgemm: error: cannot write standard output: it is closed"])


def test_a_stream_with_stdout_closed_still_writes_its_out_file_and_nothing_takes_descriptor_1(config, tmp_path):
    out = tmp_path / "answers.jsonl"
    prelude = "import os, atexit\natexit.register(lambda: os.write(1, b'on fd 1\\n'))  # a library's own print"
    code, _, stderr = run_with([*STREAM, "--config", config, "--out", out], close=1, prelude=prelude)
    assert code == 0 and stderr[-1].startswith("edgemm: summary: "), stderr
    assert len(out.read_text().splitlines()) == 3 and "on fd 1" not in out.read_text()


@pytest.mark.parametrize("args", [["infer", SAMPLE, "--config"], [*STREAM, "--config"]], ids=["infer", "stream"])
def test_stderr_on_a_full_disk_is_exit_2(args, config):
    # exit 1 before: the progress or summary line's ENOSPC was taken for an internal error
    code, _, _ = run_with([*args, config], stderr_to_full=True)
    assert code == 2


def test_a_closed_stderr_is_no_error_the_answer_is_still_given(config):
    # exit 1 before: progress() asked None whether it was a terminal
    code, stdout, _ = run_with(["infer", SAMPLE, "--config", config], close=2)
    assert code == 0 and stdout.strip() != ""


def test_a_view_video_cut_short_by_the_disk_is_one_line_and_exit_2(config, tmp_path):
    """OpenCV's VideoWriter says nothing when its writes fail: a file size limit (RLIMIT_FSIZE,
    EFBIG past it; Python ignores SIGXFSZ) cuts the file short as a full disk does."""
    for name in ("clip.avi", "clip.mp4"):
        view = tmp_path / name
        prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, ({64 * 1024}, {64 * 1024}))"
        code, _, stderr = run_with(["stream", "synthetic://?count=40", "--tier", "low", "--max-new-tokens", "1",
                                    "--config", config, "--view", view, "--out", tmp_path / "a.jsonl"],
                                   prelude=prelude)
        assert (code, stderr) == (2, [f"edgemm: error: cannot write --view {view}: it does not hold the 40 frames "
                                      "written to it (a full disk, or a file size limit?)"]), name
        assert view.stat().st_size == 64 * 1024  # cut short, as it was with exit 0


@pytest.mark.parametrize("source", ["synthetic://?count=40", "synthetic://?count=40&fps=10"],
                         ids=["files", "live"])  # live: the reader thread writes the view
def test_a_view_video_on_a_disk_with_no_space_left_stops_the_stream(source, config, tmp_path):
    """statvfs says the disk is full after the fourth frame (a tmpfs of 64 KB needs root to mount)."""
    view = tmp_path / "clip.avi"
    prelude = ("import os, edgemm.streams.view\ncalls = []\nreal = os.statvfs\n"
               "def statvfs(path):\n    calls.append(path)\n    s = real(path)\n"
               "    return os.statvfs_result((*s[:4], 0 if len(calls) >= 4 else s[4], *s[5:]))\n"
               "edgemm.streams.view.os.statvfs = statvfs")
    code, _, stderr = run_with(["stream", source, "--tier", "low", "--max-new-tokens", "1",
                                "--config", config, "--view", view, "--out", tmp_path / "a.jsonl"], prelude=prelude)
    assert (code, stderr) == (2, [f"edgemm: error: cannot write --view {view}: No space left on device "
                                  "(after 3 frames)"])
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) < 40
