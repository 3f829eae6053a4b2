"""edgemm: an edge runtime for vision-language models on NVIDIA Jetson."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Runtime", "InferenceResult", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import edgemm.model.scenes` (training, tests) doesn't load onnxruntime.
    if name in ("Runtime", "InferenceResult"):
        from edgemm.engine import runtime
        return getattr(runtime, name)
    raise AttributeError(name)
