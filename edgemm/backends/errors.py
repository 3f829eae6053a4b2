"""The errors of edgemm.backends: a provider onnxruntime lacks, CUDA that refuses."""
from __future__ import annotations

from edgemm.errors import BackendError, EngineError


class ProviderUnavailable(BackendError):
    """backend.providers names only providers this onnxruntime build lacks: the config's
    to fix (or the install's), like a bad config, so exit code 2."""
    exit_code = 2


class CudaError(EngineError):
    """CUDA refused: the driver did not start, no device, or an allocation or copy failed."""


class CudaMissing(CudaError):
    """Neither cuda-python nor pycuda imports: nothing here could start the driver."""
