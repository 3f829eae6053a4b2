"""Keep the C libraries' own messages off the user's stderr: edgemm's line is the one shown.

A corrupt PNG makes libpng print `libpng error: IDAT: CRC error`, libjpeg prints
`Corrupt JPEG data: …` or `Inconsistent progression sequence …`, OpenCV's logger
`[ERROR:0@0.014] global loadsave.cpp …` (libtiff's messages go through it), FFmpeg its
own lines; then edgemm says what was wrong, in one line. `quiet_libraries` is called
once when `edgemm infer`, `stream` or `serve` starts:

* OpenCV's logger is set to silent, and FFmpeg's log level (read by OpenCV when it
  first opens a video) to quiet.
* libpng and libjpeg write to file descriptor 2 themselves, from whatever thread
  decodes. Redirecting fd 2 around each decode would be process-wide, and in the
  daemon would swallow other threads' lines meanwhile. So fd 2 goes to /dev/null for
  good, and Python's `sys.stderr` is moved to a copy of the original descriptor first:
  everything edgemm (and Python: logging, tracebacks, warnings) writes still reaches
  the terminal or the journal, in order; only what C code writes to fd 2 is dropped.
  (`sys.__stderr__` stays the original object, now writing to /dev/null: code that writes
  there explicitly, rather than to `sys.stderr`, is silenced too.)
  A crash in C code (a segfault in a decoder or a provider) would then leave no trace,
  so `faulthandler` is enabled on the kept descriptor: its traceback still reaches the
  journal.

TensorRT would lose its messages here too (its stock trt.Logger writes to fd 2), so edgemm
gives it a logger of its own (edgemm.backends.tensorrt.platform.trt_log) that writes them through
Python's `edgemm` logger instead.

With EDGEMM_DEBUG=1 none of this happens: the libraries say everything they say.
"""
from __future__ import annotations

import faulthandler
import io
import os
import sys

from edgemm.util.opencv import cv2

_AV_LOG_QUIET = "-8"
_quieted = False


def quiet_libraries() -> None:
    """Silence OpenCV, FFmpeg and what C libraries write to fd 2 (not with EDGEMM_DEBUG)."""
    global _quieted
    if _quieted or os.environ.get("EDGEMM_DEBUG"):
        return
    _quieted = True
    _silence_opencv()
    os.environ.setdefault("OPENCV_LOG_LEVEL", "SILENT")  # for OpenCV code that reads it late
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", _AV_LOG_QUIET)
    _drop_fd2()


def _silence_opencv() -> None:
    # PyPI's wheels have cv2.utils.logging; a cv2 built from OpenCV's sources without its Python
    # loader (Debian's, and so the Jetson install's) has only cv2.setLogLevel.
    logging = getattr(getattr(cv2, "utils", None), "logging", None)
    if logging is not None:
        logging.setLogLevel(logging.LOG_LEVEL_SILENT)
    elif hasattr(cv2, "setLogLevel"):
        cv2.setLogLevel(0)  # cv::utils::logging::LOG_LEVEL_SILENT


def _drop_fd2() -> None:
    """fd 2 → /dev/null, sys.stderr → a copy of the old fd 2. Only when sys.stderr is the
    process's own stderr: under a test runner (which swaps it) fd 2 is left alone."""
    stream = sys.stderr
    if stream is None or stream is not sys.__stderr__:
        return
    try:
        if stream.fileno() != 2:
            return
    except (AttributeError, OSError, ValueError):
        return
    stream.flush()
    kept = os.dup(2)  # not inheritable (PEP 446): children get the /dev/null fd 2
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
    finally:
        os.close(devnull)
    sys.stderr = io.TextIOWrapper(io.FileIO(kept, "w"), encoding=stream.encoding, errors="backslashreplace",
                                  line_buffering=True, write_through=True)
    faulthandler.enable(file=sys.stderr)
