"""The model's graphs, loaded on their devices: placement, standby copies, generators.

    placement.vision_encoder: [dla0, gpu, cpu]  ─► the first device that loads it
                                                   (+ the others the power policy may pick,
                                                    with placement.keep_alternatives)
    a request's Route ─► resolve() ─► (encoder, embedding, decoder) devices ─► Generator

`cpu` is onnxruntime with backend.providers; gpu, dla0 and dla1 are TensorRT engines
from the engines folder. Every device that could not take a component is kept with
its one-line reason (placement_report, `edgemm status`).
"""
from __future__ import annotations

import importlib.resources
import logging
import os
from pathlib import Path

from edgemm.backends.base import Component, LoadedComponents
from edgemm.backends.onnxruntime import OnnxRuntimeBackend
from edgemm.config import Config
from edgemm.errors import ConfigError, EdgemmError
from edgemm.engine.generate import Generator
from edgemm.engine.contract import check_component
from edgemm.engine.precision_choice import Measurement, cpu_identity, load_measurement
from edgemm.model.family import GraphInputs
from edgemm.model.manifest import COMPONENTS, ModelManifest
from edgemm.model.manifest_types import AUTO, AUTO_FALLBACK, AUTO_ORDER
from edgemm.model.quantization import BATCH_DEPENDENT, graph_kind
from edgemm.engine.placement import Placement, place
from edgemm.engine.route import Route, reachable_devices

log = logging.getLogger("edgemm")

# Where built engines go when neither --out nor model.engines names a folder. For root (who
# builds them for the service on a Jetson) the system's state folder; edgemm.service reads it
# through $EDGEMM_ENGINES. Everyone else: their own cache, since site-packages may be read-only.
SYSTEM_ENGINES = Path("/var/lib/edgemm/engines")


def usable_cpus() -> int:
    """CPUs this process may run on (systemd's CPUAffinity, taskset, cgroups), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_engines_root() -> Path:
    """$EDGEMM_ENGINES; else /var/lib/edgemm/engines for root; else $XDG_CACHE_HOME/edgemm/engines
    (~/.cache/edgemm/engines)."""
    if os.environ.get("EDGEMM_ENGINES"):
        return Path(os.environ["EDGEMM_ENGINES"])
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return SYSTEM_ENGINES
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "edgemm" / "engines"


# Package data (pyproject.toml), so every install has it: editable, `pip install .`, a wheel.
# The clone's models/tiny-vlm is a symlink to it. Here rather than in edgemm.engine.runtime, which
# imports OpenCV: `edgemm doctor` names the model folder without it.
BUILTIN_MODEL = Path(str(importlib.resources.files("edgemm").joinpath("builtin", "tiny-vlm")))


def default_model_dir() -> Path:
    """$EDGEMM_MODEL, else the built-in tiny VLM inside the package."""
    return Path(os.environ.get("EDGEMM_MODEL", BUILTIN_MODEL))


def default_engines_dir(model_name: str) -> Path:
    """<engines root>/<model name>: where `edgemm engines build` writes and `model.engines: null` looks."""
    return default_engines_root() / model_name


class ModelComponents:
    """Each component on the first device of its placement list that loads it; with
    placement.keep_alternatives, also on the other devices the power policy may give it.

    `concurrent`: the encoder and the decoder run at the same time (the pipeline of
    `serve` and `stream`); backend.intra_op_threads 0 then splits the cores between them."""

    def __init__(self, config: Config, manifest: ModelManifest, stop_ids: set[int], concurrent: bool = False,
                 fed: GraphInputs | None = None):
        """`fed`: what the model's family feeds the graphs beyond the contract (its GraphInputs)."""
        self.config, self.manifest, self.stop_ids, self.concurrent = config, manifest, stop_ids, concurrent
        self.fed = fed
        self.precision = config.model.precision  # after loading: what the components run in (auto resolved)
        self.precision_choices: dict[str, str] = {}  # component → why `auto` took its precision there
        self._ort: OnnxRuntimeBackend | None = None
        self._trt = None  # TensorRTBackend, made on the first gpu/dla placement
        self.cpu_threads = 0  # the CPU components' intra-op threads (0 before the first loads)
        self._measured: Measurement | None | bool = False  # tools/choose_precisions.py's, read once (False: not yet)
        # (component, device) → its graph's quantization kind, read from its operators (cpu only:
        # a TensorRT engine is never built from a kind whose rows depend on their batch)
        self.kinds: dict[tuple[str, str], str] = {}
        self.placements: dict[str, Placement] = {}
        self.standby: dict[str, dict[str, Component]] = {}  # component → device → loaded, first device first
        loaded: dict[str, Component] = {}
        for kind in COMPONENTS:
            devices = getattr(config.placement, kind)
            loaded[kind], self.placements[kind] = place(kind, devices, self._load_on)
            self.standby[kind] = {self.placements[kind].device: loaded[kind]}
            if config.placement.keep_alternatives:
                self._load_alternatives(kind, devices)
        missing = self._ort.missing if self._ort is not None else []
        self.loaded = LoadedComponents(loaded["vision_encoder"], loaded["embed_tokens"], loaded["decoder"],
                                       extra={"missing_providers": missing,
                                              "placement": {k: p.to_dict() for k, p in self.placements.items()}})
        self.generator = Generator(self.loaded.vision_encoder, self.loaded.embed_tokens, self.loaded.decoder,
                                   manifest.max_context, stop_ids, fed)
        if self.precision == AUTO:  # one name where the components agree, else each one's
            chosen = {c.name: c.precision for c in self.loaded.all()}
            self.precision = (next(iter(chosen.values())) if len(set(chosen.values())) == 1
                              else "+".join(dict.fromkeys(chosen.values())))
        self._generators = {self.resolve(None): self.generator}  # (encoder, embed, decoder device) → Generator

    @property
    def variants(self) -> str:
        """Each component's precisions as loaded, its standbys' too (`vision_encoder=fp32
        embed_tokens=fp32 decoder=q4`): what the feature cache keys by, so that features and
        prompt prefixes of different variants never share a key (`auto` resolves per component)."""
        return " ".join(f"{kind}={'+'.join(sorted({c.precision for c in self.standby[kind].values()}))}"
                        for kind in COMPONENTS)

    def _load_alternatives(self, kind: str, devices: list[str]) -> None:
        """Load `kind` on the devices after the first that the power policy could move it to
        (the first DLA when hot or over budget, the GPU when latency is at risk). The CPU
        stays a fallback for a missing engine, not a power choice, unless it is listed first."""
        placement = self.placements[kind]
        tried = {placement.device} | {d for d, _ in placement.skipped}
        for device in reachable_devices(devices):
            if device in tried:
                continue
            try:
                self.standby[kind][device] = self._load_on(kind, device)
            except EdgemmError as e:
                placement.skipped.append((device, str(e)))
                log.warning("%s: no standby on %s: %s", kind, device, e)
                continue
            placement.standby.append(device)

    def _load_on(self, kind: str, device: str) -> Component:
        """One component on one device, in model.precision or, for `auto`, the fastest
        variant present for that device's backend (on the CPU the one measured fastest, else
        AUTO_ORDER's first)."""
        if self.precision != AUTO:
            return self._load_precision(kind, device, self.precision)
        if device == "cpu":
            precision, why = self._cpu_auto(kind)
            component = self._load_precision(kind, device, precision)
            # the first device's choice is the one answers report (a standby's would overwrite it)
            self.precision_choices.setdefault(kind, f"auto: {precision} on cpu, {why}")
            return component
        order, failed = AUTO_ORDER["tensorrt"], []  # TensorRT: the first precision with an engine that loads
        for precision in order:
            try:
                component = self._load_precision(kind, device, precision)
            except EdgemmError as e:
                failed.append(e)
                continue
            self.precision_choices.setdefault(kind, f"auto: {precision} on {device}, the fastest TensorRT "
                                                    f"engine present ({' > '.join(order)})")
            return component
        raise failed[0]  # the int8 engine's reason (its rebuild command names the usual choice)

    def _cpu_auto(self, kind: str) -> tuple[str, str]:
        """(precision, why) `auto` gives `kind` on the CPU: the fastest that tools/choose_precisions.py
        measured for this folder, CPU and thread count (edgemm.engine.precision_choice); without a
        measurement, the first variant of AUTO_ORDER whose graph is in the folder."""
        self._onnxruntime()  # its thread count keys the measurement
        if self._measured is False:
            self._measured = load_measurement(self.manifest, cpu_identity(), self.cpu_threads)
        if self._measured is not None:
            chosen = self._measured.choose(kind, self.manifest.graph_precisions()[kind], AUTO_ORDER["onnxruntime"])
            if chosen is not None:
                return chosen
        order = AUTO_ORDER["onnxruntime"]
        present = [p for p in order if self.manifest.has_graph(kind, p)]
        if present:
            return present[0], (f"the fastest present for onnxruntime ({' > '.join(order)}; present: "
                                f"{', '.join(present)})")
        # a folder published with other variants only: the one this graph has
        others = [p for p in AUTO_FALLBACK["onnxruntime"] if self.manifest.has_graph(kind, p)]
        return (others[0] if others else "fp32",  # no graph at all: graph_path's error
                f"the only kind present ({' > '.join(order)} absent; present: {', '.join(others)})")

    def load_cpu_variant(self, kind: str, precision: str) -> Component:
        """`kind` in `precision` on this model's onnxruntime backend (its threads and session
        options), unchecked and unrecorded: what edgemm.engine.precision_timing times."""
        return self._onnxruntime().load(kind, self.manifest.graph_path(kind, precision), precision)

    def _load_precision(self, kind: str, device: str, precision: str) -> Component:
        """One component on one device: onnxruntime for cpu, a TensorRT engine otherwise."""
        if device == "cpu":
            path = self.manifest.graph_path(kind, precision)
            component = self._onnxruntime().load(kind, path, precision)
            self.kinds[(kind, device)] = graph_kind(path)
        else:
            path = self.engines_dir
            split = self.fed.split_encoder_feeds if self.fed is not None and kind == "vision_encoder" else None
            component = self._tensorrt().load_component(kind, device, precision, split_feeds=split)
        check_component(kind, component, str(path), self.fed)
        return component

    def batches_exactly(self, component: Component) -> bool:
        """Whether `component` gives each row the same result alone or batched with others: not
        a dynamic int8 graph, which scales the activations per call over every row and token
        in it (edgemm.model.quantization). Such a component runs one request per call."""
        return self.kinds.get((component.name, component.device)) not in BATCH_DEPENDENT

    @property
    def engines_dir(self) -> Path:
        engines = self.config.model.engines
        return Path(engines) if engines else default_engines_dir(self.manifest.name)

    def _onnxruntime(self) -> OnnxRuntimeBackend:
        if self._ort is None:
            cfg = self.config.backend
            threads, spin = cfg.intra_op_threads, True
            if threads > usable_cpus():  # more threads than cores only queue up behind each other
                raise ConfigError(f"'backend.intra_op_threads' is {threads}, more than the {usable_cpus()} "
                                  "cores this process may use (0 lets edgemm choose)")
            if self.concurrent:  # two stages at once: half the cores each, no spinning on the other's cores
                threads, spin = threads or max(1, usable_cpus() // 2), False
            self._ort = OnnxRuntimeBackend(cfg.providers, threads, spin)
            self.cpu_threads = threads or usable_cpus()
            if self._ort.missing:
                log.warning("onnxruntime here lacks %s; running on %s", ", ".join(self._ort.missing),
                            ", ".join(self._ort.providers))
        return self._ort

    def _tensorrt(self):
        if self._trt is None:
            from edgemm.backends.tensorrt.component import TensorRTBackend  # imports tensorrt + pycuda
            self._trt = TensorRTBackend.for_model(self.manifest, self.engines_dir)
        return self._trt

    @property
    def devices(self) -> dict[str, str]:
        """component → the device that runs it (cpu, gpu, dla0, dla1)."""
        return {c.name: c.device for c in self.loaded.all()}

    def placement_report(self) -> dict[str, dict]:
        """component → {device, backend, provider, precision, quantization (the kind its graph's
        operators say, on the CPU), skipped: [{device, reason}]}, for status."""
        return {c.name: {**self.placements[c.name].to_dict(), "device": c.device, "provider": c.provider,
                         "precision": c.precision,
                         **({"quantization": self.kinds[(c.name, c.device)]} if (c.name, c.device) in self.kinds
                            else {}),
                         **({"precision_choice": self.precision_choices[c.name]}
                            if c.name in self.precision_choices else {})} for c in self.loaded.all()}

    def backend_seconds(self) -> float:
        """Total time spent inside raw backend run calls so far (for overhead accounting)."""
        return sum(c.stats.seconds for by_device in self.standby.values() for c in by_device.values())

    def release_memory(self) -> None:
        """Every loaded component hands back the memory its largest run left it (warm-up)."""
        for by_device in self.standby.values():
            for component in by_device.values():
                component.release_memory()

    def resolve(self, route: Route | None) -> tuple[str, str, str]:
        """The devices that run (encoder, embedding, decoder) for a wished placement: the
        wished device where that component is loaded on it, else its first device."""
        wished = route.stages if route is not None else {}
        return tuple(wished[kind] if wished.get(kind) in self.standby[kind] else self.placements[kind].device
                     for kind in COMPONENTS)

    def generator_for(self, route: Route | None) -> Generator:
        """A Generator over the components `route` resolves to (made once per combination)."""
        devices = self.resolve(route)
        generator = self._generators.get(devices)
        if generator is None:
            parts = [self.standby[kind][device] for kind, device in zip(COMPONENTS, devices)]
            generator = self._generators[devices] = Generator(*parts, self.manifest.max_context, self.stop_ids,
                                                                             self.fed)
        return generator
