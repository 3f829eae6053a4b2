"""Hostile images and paths (issue 17): refused before the work they would cost, with one
line and the documented status; a slow image does not hold up another request; no
library noise on stderr; EXIF orientation from PNG eXIf and WebP EXIF.

Every file is made here (tests/support/hostile_images.py). Each kind is tried against
load_image, the CLI (`edgemm infer`, exit 2) and a real daemon on a temporary socket
(400 in OpenAI's error shape).
"""
from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tests.support import hostile_images as hostile  # the benchmark makes the same files
from test_server import (assert_error, child_env, in_background, raw_client, running, short_dir,
                         sock_path, wait_ready, write_config)

from edgemm.cli.main import main
from edgemm.model.errors import DecodeBusy, ImageError
from edgemm.model.image import DecodeBudget, load_image
from edgemm.model.image_header import MAX_JPEG_SCANS

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 60

# kind → (the file's bytes, what the refusal says)
REFUSED = {
    "TIFF listing its size twice": (lambda: hostile.tiff_with_repeated_size(),
                                    r"image is 12000x12000 = 144\.0 MP, above the 25\.0 MP limit"),
    "progressive JPEG with a repeated scan": (lambda: hostile.progressive_jpeg(repeats=400),
                                              rf"JPEG has more than {MAX_JPEG_SCANS} scans"),
    "16 MiB of empty JPEG comment segments": (lambda: hostile.jpeg_with_comment_run(),
                                              r"JPEG has more than 1000 marker segments"),
    "the 6-byte JPEG FF D8 FF FF FF FF": (lambda: hostile.SIX_BYTE_JPEG,
                                          r"truncated or corrupt \(JPEG has no readable frame header\)"),
}
# under the pixel limit, over the decoded-memory one: the bit depth and the decoder's buffers count
MEMORY = r"MB, above the 151\.0 MB limit \(limits\.max_decoded_bytes\)"
DECODED_BOMBS = {
    "16-bit RGBA PNG 4000x4000, 65 bytes": (lambda: hostile.png_header_only(4000, 4000),
                                             r"4000x4000 PNG \(4 x 16-bit samples\) takes 368\.0 " + MEMORY),
    "64-bit float RGB TIFF 4000x3000, cut short": (lambda: hostile.tiff_deep(), r"\(3 x 64-bit samples\) " + ".*" + MEMORY),
    "16-bit RGBA TIFF 4000x4000, cut short": (lambda: hostile.tiff_deep(4000, 4000, 16, 4, 1),
                                               r"\(4 x 16-bit samples\) " + ".*" + MEMORY),
    "animated WebP with a 4000x4000 canvas": (lambda: hostile.animated_webp_canvas(4000), MEMORY),
    "RLE8 BMP 4900x4900, 2 KB": (lambda: hostile.bmp_rle8(4900, 4900), MEMORY),
}
if hasattr(hostile.cv2, "IMWRITE_JPEG_SAMPLING_FACTOR"):  # OpenCV >= 4.7 writes 4:4:4 on request (not Debian's 4.6)
    DECODED_BOMBS["progressive 4:4:4 JPEG frame 4900x4900"] = (
        lambda: hostile.jpeg_with_size(hostile.encode(".jpg", hostile.marked_bgr(), hostile.cv2.IMWRITE_JPEG_PROGRESSIVE, 1,
                                                      hostile.cv2.IMWRITE_JPEG_SAMPLING_FACTOR,
                                                      hostile.cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444), 4900, 4900),
        MEMORY)
REFUSED.update(DECODED_BOMBS)


@pytest.fixture(scope="module")
def refused_files(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    where = tmp_path_factory.mktemp("hostile")
    files = {}
    for i, (kind, (make, message)) in enumerate(REFUSED.items()):
        path = where / f"hostile-{i}.img"
        path.write_bytes(make())
        files[kind] = (path, message)
    return files


_LISTENERS: list[socket.socket] = []


def special_files(where: Path) -> dict[str, tuple[Path, str]]:
    """A FIFO, a UNIX socket, a character device and an oversize file, with the word each
    refusal uses. The socket stays bound while the caller's folder exists."""
    fifo = where / "camera.fifo"
    os.mkfifo(fifo)
    sock_file = where / "s.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock_file))
    _LISTENERS.append(listener)  # bound for the rest of the session
    big = where / "big.png"
    big.write_bytes(hostile.encode(".png", np.zeros((8, 8), np.uint8)) + bytes(3000))
    return {"FIFO": (fifo, "a FIFO, not a regular file"), "socket": (sock_file, "a socket, not a regular file"),
            "device": (Path("/dev/zero"), "a character device, not a regular file"),
            "oversize": (big, r"bytes, above the 2048 byte limit \(limits.max_image_bytes\)")}


# ---- load_image ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(REFUSED))
def test_load_image_refuses_before_decoding(kind):
    make, message = REFUSED[kind]
    with pytest.raises(ImageError, match=message) as info:
        load_image(make())
    assert "\n" not in str(info.value)


def test_the_memory_limit_counts_bit_depth_and_channels():
    # the same 1000x1000: 8-bit RGB costs 6 MB (decoded twice by OpenCV), 16-bit RGBA 15 MB
    rgb8 = hostile.encode(".png", np.zeros((1000, 1000, 3), np.uint8))
    rgba16 = hostile.encode(".png", np.zeros((1000, 1000, 4), np.uint16))
    assert load_image(rgb8, max_decoded_bytes=7_000_000).shape == (1000, 1000, 3)
    with pytest.raises(ImageError, match=r"\(4 x 16-bit samples\) takes 23\.0 MB, above the 7\.0 MB limit"):
        load_image(rgba16, max_decoded_bytes=7_000_000)
    assert load_image(rgba16, max_decoded_bytes=23_000_000).shape == (1000, 1000, 3)


PEAK_OF_LOAD = """
import sys
import numpy as np
from tests.support import hostile_images as hostile
from edgemm.model import image, image_header
def kb(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
data = eval(sys.argv[1])
header = image_header.read_header(data, image_header.sniff_format(data))
open("/proc/self/clear_refs", "w").write("5")
before = kb("VmRSS")
image.load_image(data)
print((kb("VmHWM") - before) * 1024 / image_header.decode_cost(header))
"""


def _writes_float_tiff() -> bool:
    try:
        return bool(hostile.cv2.imencode(".tif", np.zeros((2, 2, 3)))[0])
    except hostile.cv2.error:
        return False


@pytest.mark.parametrize("make", [
    "hostile.encode('.png', np.random.default_rng(0).integers(0, 65535, (1500, 1500, 4), dtype=np.uint16))",
    "hostile.encode('.png', np.random.default_rng(0).integers(0, 255, (2500, 2500, 3), dtype=np.uint8))",
    "hostile.encode('.jpg', np.random.default_rng(0).integers(0, 255, (2000, 2000, 3), dtype=np.uint8), 2, 1)",
    "hostile.encode('.tif', np.random.default_rng(0).random((1000, 1000, 3)))",
])
def test_the_memory_an_accepted_image_takes_is_what_the_limit_counts(make):
    """decode_cost is what the limit is checked against: a decode that takes much more
    than it (an intermediate it does not know about) would let the limit be outrun."""
    if ".tif'" in make and not _writes_float_tiff():
        pytest.skip("this OpenCV cannot write a 64-bit float TIFF (Debian's 4.6)")
    out = subprocess.run([sys.executable, "-c", PEAK_OF_LOAD, make], capture_output=True, text=True,
                         timeout=WAIT_S, cwd=ROOT)  # -c: the repository root (cwd) is on the path
    assert out.returncode == 0, out.stderr
    assert 0.5 < float(out.stdout) <= 1.25, (make, out.stdout)


def test_decodes_share_one_budget_and_a_decode_that_does_not_fit_is_503():
    budget = DecodeBudget(10_000_000)
    small = hostile.encode(".png", np.zeros((1000, 1000, 3), np.uint8))  # costs 6 MB
    with budget.hold(6_000_000):  # another thread's decode in progress
        with pytest.raises(DecodeBusy, match=r"images being decoded hold 6\.0 MB of the 10\.0 MB budget") as info:
            load_image(small, budget=budget)
        assert info.value.http_status == 503
        load_image(hostile.encode(".png", np.zeros((100, 100, 3), np.uint8)), budget=budget)  # fits beside it
    assert budget.held == 0
    load_image(small, budget=budget)  # room again once the other ends
    with pytest.raises(ImageError):
        load_image(hostile.SIX_BYTE_JPEG, budget=budget)
    assert budget.held == 0


def test_daemon_answers_503_with_retry_after_when_the_decode_budget_is_full(runtime, sample_png, monkeypatch):
    monkeypatch.setattr(runtime.preparation, "decode_budget", DecodeBudget(1000))  # held by others, say
    with running(runtime) as daemon, raw_client(sock_path(daemon)) as http:
        refused = http.post("/v1/infer", params={"max_tokens": 1}, content=sample_png)
        error = assert_error(refused, 503)
        assert refused.headers["Retry-After"] == "1" and "limits.decode_budget_bytes" in error["message"]
    assert runtime.preparation.decode_budget.held == 0


def test_tiff_size_is_the_largest_any_tag_gives():
    # the same structure listing a small size twice decodes; a big one anywhere is refused
    with pytest.raises(ImageError, match="12000x12000"):
        load_image(hostile.tiff_with_repeated_size(big=12000, small=16))
    with pytest.raises(ImageError, match="16x12000|12000x16|12000x12000"):
        load_image(hostile.tiff_with_repeated_size(big=16, small=12000))


def test_a_progressive_jpeg_within_the_scan_bound_decodes():
    assert load_image(hostile.progressive_jpeg(repeats=MAX_JPEG_SCANS - 10)).shape == (64, 64, 3)
    with pytest.raises(ImageError, match="scans"):
        load_image(hostile.progressive_jpeg(repeats=MAX_JPEG_SCANS - 9))


def test_only_regular_files_are_read(tmp_path):
    for kind, (path, message) in special_files(tmp_path).items():
        with pytest.raises(ImageError, match=message):
            load_image(path, max_bytes=2048)  # a FIFO would block in open(), /dev/zero never ends


# ---- EXIF orientation in PNG and WebP ----------------------------------------------------

def corners(img: np.ndarray) -> tuple[str, str]:
    """Where the red and the green block of hostile.marked_bgr ended up."""
    h, w = img.shape[:2]
    at = {"tl": img[8, 8], "tr": img[8, w - 9], "bl": img[h - 9, 8], "br": img[h - 9, w - 9]}
    red = [k for k, px in at.items() if px[0] > 200 and px[1] < 60]
    green = [k for k, px in at.items() if px[1] > 200 and px[0] < 60]
    assert len(red) == 1 and len(green) == 1, at
    return red[0], green[0]


@pytest.mark.parametrize("make", [hostile.png_with_exif, hostile.webp_with_exif], ids=["PNG eXIf", "WebP EXIF"])
@pytest.mark.parametrize("orientation, shape, where", [
    (1, (48, 80, 3), ("tl", "tr")), (3, (48, 80, 3), ("br", "bl")),
    (6, (80, 48, 3), ("tr", "br")), (8, (80, 48, 3), ("bl", "tl")),
])
def test_exif_orientation_of_png_and_webp(make, orientation, shape, where):
    img = load_image(make(orientation))
    assert img.shape == shape and corners(img) == where


# ---- the CLI --------------------------------------------------------------------------------

def infer(*args, **kwargs):
    return CliRunner().invoke(main, ["infer", *map(str, args)], **kwargs)


@pytest.mark.parametrize("kind", list(REFUSED))
def test_cli_refuses_with_exit_2_and_one_line(refused_files, kind):
    path, message = refused_files[kind]
    result = infer(path)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgemm: error: ")
    assert re.search(message, lines[0]) and str(path) in lines[0]


def edgemm(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`edgemm ARGS` as its own process (a FIFO that blocked would hang only that)."""
    return subprocess.run([sys.executable, "-m", "edgemm.cli.main", *args], capture_output=True, text=True,
                          timeout=WAIT_S, env=child_env(**env))


def test_cli_refuses_fifo_socket_device_and_oversize_at_once(tmp_path):
    config = tmp_path / "edgemm.yaml"
    config.write_text("limits: {max_image_bytes: 2048}\n")
    for kind, (path, message) in special_files(tmp_path).items():
        done = edgemm("infer", str(path), "--config", str(config))
        assert done.returncode == 2, (kind, done.stderr)
        assert done.stderr.count("\n") == 1 and re.search(message, done.stderr), done.stderr


def test_cli_refuses_a_fifo_or_device_as_config_or_model_file_at_once(tmp_path, model_dir, sample_png):
    """--config FIFO hung for ever and --config /dev/zero was OOM-killed; the model
    folder's files (model.yaml, tokenizer.json) are read the same way: exit 2, one line."""
    image = tmp_path / "scene.png"
    image.write_bytes(sample_png)
    fifo = tmp_path / "cfg.fifo"
    os.mkfifo(fifo)
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    (model / "tokenizer.json").unlink()
    os.mkfifo(model / "tokenizer.json")
    for args, message in ((["--config", str(fifo)], f"config: {fifo}: path is a FIFO, not a regular file"),
                          (["--config", "/dev/zero"], "config: /dev/zero: path is a character device, not a regular file"),
                          (["--model", str(model)], f"{model}/tokenizer.json: path is a FIFO, not a regular file")):
        done = subprocess.run([sys.executable, "-m", "edgemm.cli.main", "infer", str(image), "--quiet", *args],
                              capture_output=True, text=True, timeout=WAIT_S, env=child_env())
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.splitlines() == [f"edgemm: error: {message}"], args


def test_cli_threads_are_bounded_by_the_usable_cores(model_dir):
    cores = len(os.sched_getaffinity(0))
    result = infer(model_dir / "samples" / "scene_11.png", "--threads", cores + 1)
    assert result.exit_code == 2
    assert result.stderr == (f"edgemm: error: --threads {cores + 1} is more than the {cores} cores this "
                             "process may use (0 lets edgemm choose)\n")


def test_config_threads_above_the_cores_are_refused_at_load(make_runtime):
    from edgemm.errors import ConfigError
    with pytest.raises(ConfigError, match=r"'backend.intra_op_threads' is \d+, more than the \d+ cores"):
        make_runtime(backend={"intra_op_threads": len(os.sched_getaffinity(0)) + 1})


def test_cli_shows_no_library_noise_unless_debugging(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(hostile.png_with_bad_crc())
    quiet = edgemm("infer", str(broken))
    assert quiet.returncode == 2
    assert quiet.stderr == f"edgemm: error: image is truncated or corrupt (PNG data could not be decoded): {broken}\n"
    loud = edgemm("infer", str(broken), EDGEMM_DEBUG="1")  # the same run, with the libraries speaking
    assert loud.returncode == 2 and "libpng error" in loud.stderr



def test_a_crash_in_c_code_still_leaves_its_traceback_once_libraries_are_quiet():
    """fd 2 goes to /dev/null, so a segfault's report must come through faulthandler on the kept stderr."""
    crash = ("import ctypes, sys\nfrom edgemm.util.library_noise import quiet_libraries\n"
             "quiet_libraries()\nprint('quieted', file=sys.stderr)\nctypes.string_at(0)\n")
    run = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "EDGEMM_DEBUG"})
    assert run.returncode != 0
    assert "quieted" in run.stderr and "Segmentation fault" in run.stderr and "string_at" in run.stderr

# ---- a real daemon --------------------------------------------------------------------------

def data_url(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


def chat(url: str) -> dict:
    return {"model": "tiny-vlm", "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "how many shapes are there ?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}


def test_daemon_refuses_each_kind_with_400_and_keeps_serving(runtime, refused_files, sample_png, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    specials = special_files(images)
    # the body limit above the 16 MiB comment run (as base64), so that the image check is what refuses it
    with running(runtime, image_dirs=[str(images)], max_body_bytes=64 << 20) as daemon, \
            raw_client(sock_path(daemon)) as http:
        for kind, (path, message) in refused_files.items():
            error = assert_error(http.post("/v1/chat/completions", json=chat(data_url(path.read_bytes()))), 400)
            assert re.search(message, error["message"]), (kind, error)
            assert_error(http.post("/v1/infer", content=path.read_bytes()), 400)
        for kind in ("FIFO", "socket"):  # file:// URLs naming them: refused without opening
            error = assert_error(http.post("/v1/chat/completions", json=chat(f"file://{specials[kind][0]}")), 400)
            assert error["message"].startswith("not a regular file: "), error
        ok = http.post("/v1/infer", params={"max_tokens": 1}, content=sample_png)
        assert ok.status_code == 200, ok.text


@pytest.fixture(scope="module")
def sample_png(model_dir) -> bytes:
    return (model_dir / "samples" / "scene_11.png").read_bytes()


def post_infer(path: str, image: bytes):
    with raw_client(path) as http:
        return http.post("/v1/infer", params={"max_tokens": 1}, content=image)


def test_a_slow_image_does_not_hold_up_another_request(runtime, sample_png, monkeypatch):
    """An image whose preparation does not end (here: held on a gate) leaves the next
    request's answer free to come back; with one prepare thread it would wait behind."""
    slow_image = hostile.encode(".png", hostile.marked_bgr())  # a distinct, valid image
    entered, release = threading.Event(), threading.Event()
    load = runtime.preparation.load

    def slow_load(image):
        if isinstance(image, bytes) and image == slow_image:
            entered.set()
            release.wait(WAIT_S)
        return load(image)
    monkeypatch.setattr(runtime.preparation, "load", slow_load)
    with running(runtime) as daemon:
        path = sock_path(daemon)
        try:
            thread, slow = in_background(post_infer, path, slow_image)
            assert entered.wait(WAIT_S)
            other = post_infer(path, sample_png)
            assert other.status_code == 200, other.text
            assert not slow, "the slow image was answered first"
        finally:
            release.set()
        thread.join(WAIT_S)
        assert slow and slow[0].status_code == 200


def test_daemon_log_has_no_library_noise():
    folder = short_dir()  # AF_UNIX paths are short
    path = str(folder / "edgemm.sock")
    proc = subprocess.Popen([sys.executable, "-m", "edgemm.cli.main", "serve", "--config", str(write_config(folder)),
                             "--socket", path], env=child_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(path, proc)
        with raw_client(path) as http:
            for data in (hostile.png_with_bad_crc(), hostile.progressive_jpeg(repeats=5)):  # libpng, libjpeg speak
                http.post("/v1/infer", params={"max_tokens": 1}, content=data)
        proc.terminate()
        _, log = proc.communicate(timeout=WAIT_S)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
    assert "edgemm: info:" in log  # the daemon's own lines are there …
    assert "libpng" not in log and "[ERROR" not in log and "Inconsistent progression" not in log, log
