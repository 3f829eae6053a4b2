"""The decoder's KV cache kept in onnxruntime's memory between steps (IOBinding).

The candidate bench/bench_kv_binding.py measures against edgemm's own OrtComponent
(session.run with numpy feeds); tests/test_kv_between_steps.py checks that both answer alike.
"""
from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort


class BoundDecoder:
    """An onnxruntime decoder component run through IOBinding, the present → past tensors
    kept in onnxruntime's memory: an input that is the numpy view of one of the last run's
    outputs is bound as that OrtValue itself. Every run binds its outputs to fresh
    onnxruntime allocations (never a buffer reused from an earlier step), so a view the
    prefix cache keeps of an output stays valid after later steps."""

    def __init__(self, component):
        self.component, self.session = component, component.session
        self.name, self.precision, self.device = component.name, component.precision, component.device
        self.inputs, self.outputs, self.stats = component.inputs, component.outputs, component.stats
        self._output_names = list(component.outputs)
        self._last: dict[int, tuple[ort.OrtValue, np.ndarray]] = {}  # id(view) → (its OrtValue, the view)

    def release_memory(self) -> None:
        self.component.release_memory()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        started = time.perf_counter()
        binding = self.session.io_binding()
        last = self._last
        for name, value in feeds.items():
            kept = last.get(id(value))
            if kept is not None and kept[1] is value:
                binding.bind_ortvalue_input(name, kept[0])
            else:
                binding.bind_cpu_input(name, value)
        for name in self._output_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        values = binding.get_outputs()
        views = [value.numpy() for value in values]  # numpy over onnxruntime's buffer (a copy before 1.19)
        self._last = {id(view): (value, view) for value, view in zip(values, views)}
        self.stats.add(started)
        return dict(zip(self._output_names, views))
