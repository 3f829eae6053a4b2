"""TrtComponent.run drives its engines' execution contexts one caller at a time.

There is no TensorRT here: the component is built around a fake engine (the parts of
_Engine that TrtComponent uses) and a fake CUDA context. The fake engine holds the first
caller inside `run` until the test lets it go, and counts how many callers are inside at
once; a second caller must wait at the component's lock, never reach the engine meanwhile.
"""
from __future__ import annotations

import threading

import numpy as np

from edgemm.backends.base import TensorSpec
from edgemm.backends.tensorrt.component import TrtComponent

WAIT_S = 30  # upper bound for anything that should happen "now"; never a timing assumption


class FakeEngine:
    """Binds, enqueues and syncs (here: doubles x) — holding the first caller until `release`."""

    inputs, outputs = ["x"], ["y"]

    def __init__(self, second_arrived: threading.Event):
        self.release = threading.Event()
        self.entered = threading.Event()
        self.second_arrived = second_arrived  # set when a second call gets in (it must not, while one runs)
        self.inside = 0
        self.most_inside = 0
        self.calls = 0
        self._count = threading.Lock()

    def spec(self, name: str) -> TensorSpec:
        return TensorSpec(name, np.dtype(np.float32), (None,))

    def profile_for(self, shapes):
        return object()

    def run(self, feeds, profile):
        with self._count:
            self.inside += 1
            self.calls += 1
            self.most_inside = max(self.most_inside, self.inside)
            first = self.calls == 1
        self.entered.set()
        if not first:
            self.second_arrived.set()
        if first:
            assert self.release.wait(WAIT_S), "the test never released the engine"
        with self._count:
            self.inside -= 1
        return {"y": feeds["x"] * 2}


class FakeCudaContext:
    def push(self) -> None:
        pass

    def pop(self) -> None:
        pass


class WatchedLock:
    """The component's lock, telling the test when a caller starts waiting for it."""

    def __init__(self, second_arrived: threading.Event):
        self._lock = threading.Lock()
        self.attempts = 0
        self.second_arrived = second_arrived

    def __enter__(self):
        self.attempts += 1
        if self.attempts >= 2:
            self.second_arrived.set()
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def test_two_concurrent_callers_are_serialised():
    second_arrived = threading.Event()  # at the lock (as it should) or inside the engine (a failure)
    engine = FakeEngine(second_arrived)
    component = TrtComponent("decoder", "gpu", "fp16", [engine], FakeCudaContext(), "10.3.0")
    component._lock = WatchedLock(second_arrived)
    results: dict[str, np.ndarray] = {}

    def call(name: str, value: float) -> None:
        results[name] = component.run({"x": np.full(2, value, np.float32)})["y"]

    first = threading.Thread(target=call, args=("first", 1.0), daemon=True)
    first.start()
    assert engine.entered.wait(WAIT_S)  # the first caller is inside the engine, held there
    second = threading.Thread(target=call, args=("second", 5.0), daemon=True)
    second.start()
    assert second_arrived.wait(WAIT_S)  # the second caller got somewhere:
    assert engine.calls == 1 and engine.inside == 1  # to the lock, where it waits, not into the engine
    engine.release.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert not first.is_alive() and not second.is_alive()
    assert engine.most_inside == 1 and engine.calls == 2
    assert results["first"].tolist() == [2.0, 2.0] and results["second"].tolist() == [10.0, 10.0]
    assert component.stats.calls == 2
