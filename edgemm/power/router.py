"""Where the daemon's requests run: the power policy's route, then local or cloud.

    Service.submit ─► Router.submit ─► Governor.decide (telemetry, queue depth, breaker state)
        route "cloud" ─► an offload worker ─► OffloadClient.chat ─► InferenceResult
            the endpoint failed ─► offload.fallback_local: the local pipeline
                                   otherwise: the error (502; 504 on timeout; 503 breaker open)
        anything else ─► the local pipeline, each stage on the device the route names
                         (where that component is loaded: placement.keep_alternatives)

The policy only says "cloud" when offload is enabled, allowed for the condition at hand
and the breaker lets requests through; so with offload off (the default) every request
runs locally. Nothing is dropped: a request ends with an answer or a stated error.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from edgemm.config import Config
from edgemm.power.errors import OffloadError
from edgemm.power.offload import OffloadClient, OffloadReply
from edgemm.engine.pipeline import Pipeline, Request
from edgemm.engine.route import Route
from edgemm.power.policy import Governor, Load, PowerPolicy
from edgemm.power.telemetry import Sampler
from edgemm.engine.answering import InferenceResult

log = logging.getLogger("edgemm")


@dataclass
class CloudResult(InferenceResult):
    """An answer from the offload endpoint: no local token ids, so the count travels alone."""
    completion_tokens: int = 0


class Router:
    def __init__(self, config: Config, sampler: Sampler | None = None, client: OffloadClient | None = None):
        self.governor = Governor(PowerPolicy.from_config(config), sampler)
        self.sampler, self.client = sampler, client
        self.fallback_local = config.offload.fallback_local
        self.workers = ThreadPoolExecutor(config.offload.max_concurrent, "edgemm-offload") if client else None
        self.fallbacks = 0  # cloud requests answered locally after the endpoint failed

    def offload_state(self) -> str:
        """off | closed | half_open | open: what the policy needs to know about the cloud."""
        return "off" if self.client is None else self.client.breaker.state

    def submit(self, request: Request, pipeline: Pipeline, queue_depth: int) -> Future:
        """Run `request` where the policy says; Overloaded (503) if the local pipeline is full."""
        route = self.governor.decide(queue_depth, self.offload_state())
        if not route.cloud or self.workers is None:
            request.options["route"] = route
            return pipeline.submit(request, block=False)
        return self.workers.submit(self._cloud, request, pipeline, route)

    def _cloud(self, request: Request, pipeline: Pipeline, route: Route) -> InferenceResult:
        assert self.client is not None
        try:
            reply = self.client.chat(image_bytes(request.image), request.prompt, request.options)
        except OffloadError as e:
            if not self.fallback_local:
                raise
            self.fallbacks += 1
            log.warning("%s; answering locally (offload.fallback_local)", e)
            request.options["route"] = self.local_route()
            return pipeline.submit(request, block=False).result()
        if request.on_token is not None:
            request.on_token(-1, reply.text)  # a stream gets the whole answer as one piece (edgemm.engine.detokenize.END_OF_TEXT)
        return cloud_result(reply, route)

    def local_route(self, queue_depth: int = 0) -> Route:
        """Where a request that must run here goes now (the policy with the cloud ruled out)."""
        telemetry = self.sampler.latest() if self.sampler else None
        return self.governor.policy.decide(telemetry, Load(queue_depth, self.governor.latency_ms), "open",
                                           self.governor.last)

    def answered(self, result: InferenceResult) -> float | None:
        """Account one answer: latency (local ones) and energy in J, if the rails are readable."""
        local = result.devices.get("encode") != "cloud"
        return self.governor.observe(result.timings_ms.get("total", 0.0), local)

    def preview(self, queue_depth: int) -> Route:
        """The route a request arriving now would get (nothing recorded)."""
        telemetry = self.sampler.latest() if self.sampler else None
        load = Load(queue_depth, self.governor.latency_ms)
        return self.governor.policy.decide(telemetry, load, self.offload_state(), self.governor.last)

    def offload_status(self) -> dict:
        if self.client is None:
            return {"enabled": False, "breaker": "off"}
        return {**self.client.state(), "fallbacks_to_local": self.fallbacks}

    def close(self) -> None:
        if self.workers is not None:
            self.workers.shutdown(wait=False)  # requests in flight were drained already; a stuck one is bounded by offload.timeout_s
        if self.client is not None:
            self.client.close()


def image_bytes(image: object) -> bytes:
    """The encoded image: bytes as they came, or a file:// image's file (server.image_dirs)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as file:
            return file.read()
    raise OffloadError("offload: this request's image cannot be sent (not encoded bytes or a file)")


def cloud_result(reply: OffloadReply, route: Route) -> CloudResult:
    ms = reply.seconds * 1e3
    return CloudResult(text=reply.text, tokens=[], finish_reason="length" if reply.finish_reason == "length" else "stop",
                       prompt_tokens=reply.prompt_tokens, tier="cloud", image_tokens=0, precision="remote",
                       devices={"encode": "cloud", "decode": "cloud"}, timings_ms={"offload": ms, "total": ms},
                       model=reply.model, schedule={"placement": route.reason},
                       completion_tokens=reply.completion_tokens)
