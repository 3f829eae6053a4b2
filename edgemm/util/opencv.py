"""OpenCV, whichever the environment has, or one line that says what to install.

Every edgemm module takes cv2 from here (`from edgemm.util.opencv import cv2`). edgemm does not
depend on one OpenCV distribution: the `opencv` extra installs PyPI's wheel, while on a
Jetson JetPack's python3-opencv (with GStreamer, for csi:// cameras) comes from the system
site-packages. When no cv2 imports (none installed, or one built for NumPy 1 under NumPy 2),
importing this module raises `OpenCVUnavailable`, which the command line reports as one line
with exit code 2 instead of a traceback.
"""
from __future__ import annotations

import contextlib
import io

from edgemm.util.errors import OpenCVUnavailable

INSTALL_HINT = ("install it with: pip install 'edgemm[opencv]' (PyPI's wheel, no GStreamer); on a Jetson, "
                "use JetPack's python3-opencv in a venv made with --system-site-packages and "
                "pip install 'edgemm[jetson]' (NumPy 1, which that cv2 is built for)")


def why_not_importable(error: ImportError) -> str:
    """The one-line reason `import cv2` failed, with what to do about it."""
    if getattr(error, "name", None) == "cv2":
        return f"OpenCV (cv2) is not installed: {INSTALL_HINT}"
    text = " ".join(str(error).split())
    if "numpy" in text.lower():
        import numpy
        return (f"OpenCV (cv2) cannot be imported under NumPy {numpy.__version__}: {text}. It was built "
                "for NumPy 1: pip install 'numpy<2' (on a Jetson: pip install 'edgemm[jetson]'), or use "
                "PyPI's wheel: pip install 'edgemm[opencv]'")
    return f"OpenCV (cv2) cannot be imported: {text}; {INSTALL_HINT}"


def _import_cv2():
    # A cv2 built for NumPy 1 makes NumPy 2 print a page with a stack trace to stderr before it
    # raises; the one line below says the same, so the page is held back.
    noise = io.StringIO()
    try:
        with contextlib.redirect_stderr(noise):
            import cv2
    except ImportError as e:
        raise OpenCVUnavailable(why_not_importable(e)) from e
    return cv2


cv2 = _import_cv2()
