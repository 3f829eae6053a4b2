"""The endpoints that ask the model: POST /v1/chat/completions (OpenAI's), POST /v1/infer
(an image as the body, the prompt in the query), GET /v1/models[/{id}].

The body comes first, under its own deadline (edgemm.server.bodies), so a client trickling it
holds no admission slot; then admission, the pipeline, and the answer as JSON or server-sent
events (edgemm.server.service).
"""
from __future__ import annotations

import asyncio
import re
import secrets
import time
import urllib.parse

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from edgemm.server import sse
from edgemm.server.bodies import BodyReader
from edgemm.server.errors import ApiError
from edgemm.server.protocol import DEFAULT_PROMPT, completion, generation_options, load_image_url, parse_chat_request
from edgemm.server.service import Service
from edgemm.util.errors import LimitError
from edgemm.util.generation_limits import check_text


class InferenceRoutes:
    def __init__(self, service: Service, bodies: BodyReader):
        self.service, self.bodies = service, bodies

    async def chat_completions(self, http: HttpRequest) -> Response:
        # the body first, under its own deadline: a client trickling it holds no admission slot
        chat = parse_chat_request(await self.bodies.read_json(http))
        self.check_model(chat.model)
        with self.service.admitted() as ticket:
            if chat.image_url[:5].lower() == "data:":  # in memory: decoding inline (~0.02 ms) beats a thread hop
                image = load_image_url(chat.image_url, chat.image_param, self.service.images)
            else:  # file and http(s) URLs block on I/O: off the event loop
                image = await asyncio.to_thread(load_image_url, chat.image_url, chat.image_param, self.service.images)
            job = self.service.submit(ticket, image, chat.prompt, chat.options, stream=chat.stream)
        request_id, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if chat.stream:
            assert job.feed is not None
            await self.service.wait(job, http, job.feed.changed.wait())
            if job.future.done():
                self.service.outcome(job)  # an error before the first token keeps its HTTP status
            return sse.response(self.service.chunks(job, chat, request_id, created))
        result = await self.service.answer(job, http)
        return JSONResponse(completion(result, request_id, self.service.model_id, created))

    async def infer(self, http: HttpRequest) -> Response:
        prompt, options = infer_query(query_params(http.scope["query_string"]))
        image = await self.bodies.read_body(http)  # before admission, as for chat
        if not image:
            raise ApiError("no image: send the image file as the request body "
                           "(curl --data-binary @photo.jpg)", code="missing_image")
        with self.service.admitted() as ticket:
            job = self.service.submit(ticket, image, prompt, options)
        result = await self.service.answer(job, http)
        return JSONResponse({"answer": result.text, "prompt": prompt, **result.to_dict()})

    async def models(self, http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self.service.model_card()]})

    async def model(self, http: HttpRequest) -> Response:
        self.check_model(http.path_params["model"])
        return JSONResponse(self.service.model_card())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.service.model_id:
            raise ApiError(f"model {model!r} is not served here (this server has {self.service.model_id!r})",
                           status=404, param="model", code="model_not_found")


def query_params(query: bytes) -> dict[str, str]:
    """The query string's parameters, refusing what is not UTF-8 (`?prompt=%ed%a0%80`,
    `%ff`), where Starlette would put U+FFFD in its place, and a parameter given twice
    (which one was meant is not ours to guess), each with a 400 naming the parameter."""
    params: dict[str, str] = {}
    # latin-1 maps each byte to one character, so the percent-decoded bytes come back intact
    for key, value in urllib.parse.parse_qsl(query.decode("latin-1"), keep_blank_values=True, encoding="latin-1"):
        key = _utf8(key, "the query string")
        if key in params:
            raise ApiError(f"query parameter {key!r} is given more than once", param=key)
        params[key] = _utf8(value, key)
    return params


def _utf8(text: str, param: str) -> str:
    try:
        return text.encode("latin-1").decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(f"{param!r} must be UTF-8 text (percent-encoded), got percent-encoded bytes that are not UTF-8", param=param) from None


_INTEGER = re.compile(r"[0-9]+")  # int() would take '१', '1_0' and '+5' (%2B5) too
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(nan|inf|infinity)", re.IGNORECASE)


def infer_query(params: dict[str, str]) -> tuple[str, dict]:
    """/v1/infer?prompt=…&max_tokens=…&temperature=…&top_p=…&seed=…&tier=… → (prompt, options).
    Integers are ASCII digits only, without a sign (a negative one is out of range anyway); numbers are ASCII
    (nan and inf are left to the limits, which name them)."""
    typed: dict = {}
    for key, kind in (("max_tokens", int), ("seed", int), ("temperature", float), ("top_p", float)):
        if key in params:
            text = params.pop(key)
            if not (_INTEGER if kind is int else _NUMBER).fullmatch(text):
                raise ApiError(f"'{key}' must be {'an integer' if kind is int else 'a number'} in ASCII digits, "
                               f"got {text[:40]!r}", param=key)
            try:
                typed[key] = kind(text)
            except ValueError:  # an integer beyond Python's 4300 digits
                raise ApiError(f"'{key}' must be an integer, got one of {len(text)} digits", param=key) from None
    if "tier" in params:
        typed["edgemm"] = {"tier": params.pop("tier")}
    prompt = params.pop("prompt", DEFAULT_PROMPT)
    try:
        check_text(prompt, "prompt")  # ?prompt=%00
    except LimitError as e:
        raise ApiError(str(e), param="prompt") from None
    if params:
        raise ApiError(f"unknown query parameter {sorted(params)[0]!r} "
                       "(known: prompt, max_tokens, temperature, top_p, seed, tier)", param=sorted(params)[0])
    return prompt, generation_options(typed)
