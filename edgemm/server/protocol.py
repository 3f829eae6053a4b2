"""The OpenAI chat-completions schema: requests in, answers and stream chunks out.

No HTTP here: edgemm.server.inference_routes reads the body and hands it to `parse_chat_request`,
turns the image URL into bytes or a path with `load_image_url`, runs the pipeline,
and shapes the result with `completion` / `chunk`. Every refusal is an `ApiError` (edgemm.server.errors)
carrying its HTTP status and OpenAI's error fields (type, param, code).

How a conversation maps onto a single-image model (the built-in one has no chat
template): the question is the text of the last user message ("describe the
image" if it has none); the image is the last `image_url` part of the user
messages. System and assistant turns are accepted and not shown to the model.
"""
from __future__ import annotations

import binascii
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pybase64

from edgemm.server.errors import ApiError
from edgemm.util.errors import LimitError
from edgemm.util.generation_limits import check_generation, check_text

DEFAULT_PROMPT = "describe the image"
ROLES = ("system", "developer", "user", "assistant", "tool")


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- request bodies ---------------------------------------------------------------------

MAX_JSON_DEPTH = 64  # nesting of arrays and objects; a chat request needs 6
# arrays' elements and objects' members in one body: a chat request with a long conversation has
# a few thousand. The json module's C parser holds the GIL for the whole of a call, so a body of
# 8 M values (16 MB of [1,1,1,…]) held every thread, the event loop's too, for seconds wherever it ran
MAX_JSON_VALUES = 100_000
MAX_INTEGER_DIGITS = 100  # longer integers are kept as LongNumber (no field takes one: a seed has 20)
_BRACKETS = np.zeros(256, np.int8)
_BRACKETS[[ord("["), ord("{")]], _BRACKETS[[ord("]"), ord("}")]] = 1, -1
_CHUNK = 1 << 20


class LongNumber:
    """An integer of more than MAX_INTEGER_DIGITS digits in a request body, never converted
    (Python refuses past 4300 digits, and converting is quadratic): a field given one is
    refused by name, as a number of the wrong kind."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<a number of {self.digits} digits>"


def _integer(text: str) -> int | LongNumber:
    digits = len(text.lstrip("-"))
    return LongNumber(digits) if digits > MAX_INTEGER_DIGITS else int(text)


def parse_json_body(body: bytes) -> Any:
    """A request body as JSON, or a 400: not JSON, nested deeper than MAX_JSON_DEPTH (checked
    before decoding, as Python's decoder would recurse), more than MAX_JSON_VALUES values
    (checked before decoding, which would take seconds), or not UTF-8."""
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise ApiError(f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")
    if json_values_exceed(body, MAX_JSON_VALUES):
        raise ApiError(f"the request body holds more than {MAX_JSON_VALUES} JSON values "
                       "(array elements and object members); no request takes that many")
    try:
        return json.loads(body, parse_int=_integer)
    except UnicodeDecodeError:
        raise ApiError("the request body is not UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise ApiError(f"the request body is not valid JSON: {e.msg} (line {e.lineno} column {e.colno})") from None


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether `body` nests [ and { deeper than `limit`, brackets in strings not counted.

    Linear and in bounded memory: escaped backslashes, then escaped quotes, are dropped, so
    every quote left opens or closes a string; a bracket counts where the quotes before it
    are even. A body with no more brackets than `limit` is not scanned at all."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for chunk, in_string in _outside_strings(body):
        steps = np.where(in_string, 0, _BRACKETS[chunk]).astype(np.int32)
        running = np.cumsum(steps) + depth
        if running.max(initial=depth) > limit:
            return True
        depth = int(running[-1])
    return False


def json_values_exceed(body: bytes, limit: int) -> bool:
    """Whether `body` has more than `limit` commas, colons and opening brackets outside strings
    (each array element but the first follows a comma, each object member has a colon, and
    each array or object opens with a bracket, so `[[[]],[[]]]` counts too), as
    json_depth_exceeds scans. A body with no more of them than `limit` anywhere (a base64
    image has none) is not scanned."""
    marks = (b",", b":", b"[", b"{")
    if sum(body.count(mark) for mark in marks) <= limit:
        return False
    counted = 0
    for chunk, in_string in _outside_strings(body):
        is_mark = (chunk == ord(",")) | (chunk == ord(":")) | (chunk == ord("[")) | (chunk == ord("{"))
        counted += int(np.count_nonzero(is_mark & ~in_string))
        if counted > limit:
            return True
    return False


def _outside_strings(body: bytes) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`body` in chunks of _CHUNK bytes, each with where it is inside a string: escaped backslashes,
    then escaped quotes, are dropped, so every quote left opens or closes a string."""
    plain = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    quotes = 0
    for start in range(0, len(plain), _CHUNK):
        chunk = plain[start:start + _CHUNK]
        is_quote = chunk == ord('"')
        yield chunk, (np.cumsum(is_quote, dtype=np.int32) + quotes) % 2 == 1
        quotes += int(np.count_nonzero(is_quote))


# ---- requests -------------------------------------------------------------------------

@dataclass
class ChatRequest:
    prompt: str
    image_url: str
    image_param: str  # where the image sits in the request, for error messages
    options: dict = field(default_factory=dict)  # the pipeline Request's options
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    model: str | None = None


def parse_chat_request(body: Any) -> ChatRequest:
    """Check a decoded JSON body against the parts of the schema edgemm uses."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {_json_type(body)}")
    model = _optional(body, "model", str, "a string")
    if body.get("n") not in (None, 1):
        raise ApiError("only n=1 is supported", param="n")
    if body.get("tools"):
        raise ApiError("tools are not supported by this model", param="tools")
    stream = _optional(body, "stream", bool, "a boolean") or False
    stream_options = _optional(body, "stream_options", dict, "an object") or {}
    options = generation_options(body)
    prompt, image_url, image_param = _conversation(body.get("messages"))
    return ChatRequest(prompt, image_url, image_param, options, stream,
                       stream_options.get("include_usage") is True, model)


def _conversation(messages: Any) -> tuple[str, str, str]:
    """(question, image URL, where the image is) from `messages`."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of messages", param="messages")
    question: str | None = None
    image: tuple[str, str] | None = None
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(f"{where} must be an object, got {_json_type(message)}", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                           param=f"{where}.role")
        texts, images = _parts(message.get("content"), f"{where}.content", role)
        if role != "user":
            continue
        question = " ".join(texts)
        if len(images) > 1:
            raise ApiError(f"{where} has {len(images)} images; the model takes one image per request",
                           param=f"{where}.content")
        image = images[0] if images else image
    if question is None:
        raise ApiError("'messages' has no user message", param="messages")
    if image is None:
        raise ApiError("no image: add an image_url content part (a data: URL) to a user message",
                       param="messages", code="missing_image")
    return question.strip() or DEFAULT_PROMPT, image[0], image[1]


def _parts(content: Any, where: str, role: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The texts and (image URL, where) of one message's content."""
    if content is None and role != "user":
        return [], []
    if isinstance(content, str):
        return [_text(content, where)], []
    if not isinstance(content, list):
        raise ApiError(f"{where} must be a string or a list of content parts", param=where)
    texts, images = [], []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(_text(part["text"], f"{at}.text"))
        elif kind == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else None
            if not isinstance(url, str):
                raise ApiError(f"{at}.image_url must be an object with a string 'url'", param=f"{at}.image_url")
            images.append((url, f"{at}.image_url.url"))
        elif kind in ("text", None):
            raise ApiError(f"{at} must be {{'type': 'text', 'text': …}} or "
                           "{'type': 'image_url', 'image_url': {'url': …}}", param=at)
        else:
            raise ApiError(f"{at}: content part type {kind!r} is not supported (text, image_url)",
                           param=f"{at}.type")
    return texts, images


def generation_options(body: dict) -> dict:
    """Generation options, checked here so a bad value is a 400 naming its field."""
    # max_completion_tokens is the current name, max_tokens the deprecated one; either may come
    tokens_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    given = {"max_new_tokens": _optional(body, tokens_key, int, "an integer"),
             "temperature": _optional(body, "temperature", float, "a number"),
             "top_p": _optional(body, "top_p", float, "a number"),
             "seed": _optional(body, "seed", int, "an integer")}
    try:
        check_generation(**given, names={"max_new_tokens": tokens_key})
    except LimitError as e:
        raise ApiError(str(e), param=e.field) from None
    options: dict = {k: v for k, v in given.items() if v is not None}
    for key in ("temperature", "top_p"):
        if key in options:
            options[key] = float(options[key])
    extension = _optional(body, "edgemm", dict, "an object") or {}
    if extension.get("tier") is not None:
        _check(isinstance(extension["tier"], str), "edgemm.tier", "must be a tier name", extension["tier"])
        options["tier"] = extension["tier"]
    return options


def _optional(body: dict, key: str, kind: type, described: str) -> Any:
    """body[key] if present and not null, checked to be `kind` (bool is no number here)."""
    value = body.get(key)
    if value is None:
        return None
    numbers = (int, float) if kind is float else (kind,)
    # NaN and infinities are numbers (JSON parsers let them through): the limits refuse them by name
    if not isinstance(value, numbers) or (kind is not bool and isinstance(value, bool)):
        raise ApiError(f"'{key}' must be {described}, got {_json_type(value)}", param=key)
    return value


def _text(value: str, where: str) -> str:
    """`value`, if the tokenizer (or the OS, for a path) can take it."""
    try:
        check_text(value, where)
    except LimitError as e:
        raise ApiError(str(e), param=where) from None
    return value


def _check(ok: bool, key: str, must: str, value: Any) -> None:
    if not ok:
        raise ApiError(f"'{key}' {must}, got {value!r}", param=key)


def _json_type(value: Any) -> str:
    if isinstance(value, LongNumber):
        return f"a number of {value.digits} digits"
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# ---- image URLs -----------------------------------------------------------------------

@dataclass
class ImagePolicy:
    """Which image URLs a request may use (server.image_dirs, server.remote_images)."""
    image_dirs: list[str] = field(default_factory=list)
    remote: bool = False
    timeout_s: float = 10.0
    max_bytes: int = 50 * 1024 * 1024


def load_image_url(url: str, param: str, policy: ImagePolicy) -> bytes | str:
    """The encoded image bytes (data:, http:, https:) or a local path (file:). Blocking I/O."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, param, policy.max_bytes)
    if scheme == "file":
        return _file_url(_text(url, param), param, policy.image_dirs)
    if scheme in ("http", "https"):
        _text(url, param)
        if not policy.remote:
            raise ApiError("http(s) image URLs are disabled on this server (server.remote_images); "
                           "send the image as a data: URL", param=param, code="url_scheme_not_allowed")
        return fetch_image(url, param, policy.max_bytes, policy.timeout_s)
    raise ApiError(f"unsupported image URL scheme {scheme or url[:20]!r}: use a data: URL "
                   "(data:image/jpeg;base64,…)", param=param, code="url_scheme_not_allowed")


def _data_url(url: str, param: str, max_bytes: int) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    _text(header, param)  # data:image/png\u0000;base64: the payload is checked as base64, the header here
    media, *flags = header.split(";")
    if not comma or "base64" not in flags:
        raise ApiError("bad data URL: expected data:image/<type>;base64,<data>", param=param,
                       code="invalid_image_url")
    if media and not media.startswith("image/") and media != "application/octet-stream":
        raise ApiError(f"bad data URL: media type {media!r} is not an image", param=param,
                       code="invalid_image_url")
    if len(payload) * 3 // 4 > max_bytes:  # refuse before decoding
        raise ApiError(f"image is larger than {max_bytes} bytes (limits.max_image_bytes)", param=param)
    try:
        # pybase64 (SIMD) decodes a 200 KB data URL in ~0.02 ms; the standard library takes ~1 ms
        data = pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError("bad data URL: the image data is not valid base64", param=param,
                       code="invalid_image_url") from None
    if not data:
        raise ApiError("bad data URL: the image is empty", param=param, code="invalid_image_url")
    return data


def _file_url(url: str, param: str, image_dirs: list[str]) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ApiError(f"file URL names another host ({parsed.netloc})", param=param,
                       code="invalid_image_url")
    # '..' and symlinks resolved first; %00 would end the path in the OS's eyes
    path = os.path.realpath(_text(urllib.parse.unquote(parsed.path), param))
    if not image_dirs:
        raise ApiError("file:// image URLs are not enabled on this server (server.image_dirs)",
                       status=403, kind="permission_error", param=param, code="path_not_allowed")
    roots = [os.path.realpath(d) for d in image_dirs]
    if not any(os.path.commonpath([path, root]) == root for root in roots):
        raise ApiError(f"{path} is not under a folder this server may read (server.image_dirs)",
                       status=403, kind="permission_error", param=param, code="path_not_allowed")
    if not os.path.isfile(path):  # a FIFO, device or socket is refused here, unopened
        what = "not a regular file" if os.path.exists(path) else "no such image file"
        raise ApiError(f"{what}: {path}", param=param, code="invalid_image_url")
    return path


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects to http(s) only (urllib would also follow one to ftp:)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlparse(newurl).scheme not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, "redirect to a non-http URL", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_opener = urllib.request.build_opener(_HttpOnlyRedirects)


def fetch_image(url: str, param: str, max_bytes: int, timeout_s: float) -> bytes:
    """GET an image over http(s), reading at most max_bytes + 1 bytes."""
    request = urllib.request.Request(url, headers={"User-Agent": "edgemm"})
    try:
        with _opener.open(request, timeout=timeout_s) as response:
            data = response.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise ApiError(f"image URL answered HTTP {e.code}", param=param, code="image_fetch_failed") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise ApiError(f"could not fetch the image URL: {reason}", param=param,
                       code="image_fetch_failed") from None
    if len(data) > max_bytes:
        raise ApiError(f"image is larger than {max_bytes} bytes (limits.max_image_bytes)", param=param)
    return data


# ---- answers --------------------------------------------------------------------------

_NOT_EXTRAS = ("text", "tokens", "finish_reason", "prompt_tokens", "model")


def extras(result) -> dict:
    """edgemm's own figures for an answer (tier, precision, devices, timings_ms, …)."""
    return {k: v for k, v in result.to_dict().items() if k not in _NOT_EXTRAS}


def usage(result) -> dict:
    completion_tokens = getattr(result, "completion_tokens", len(result.tokens))  # offloaded answers carry a count
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": result.prompt_tokens + completion_tokens}


def finish_reason(result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def completion(result, request_id: str, model: str, created: int) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "logprobs": None, "finish_reason": finish_reason(result)}],
            "usage": usage(result), "edgemm": extras(result)}


def chunk(request_id: str, model: str, created: int, delta: dict | None,
          finish: str | None = None, **more: Any) -> dict:
    """One `chat.completion.chunk`; delta None makes the usage-only chunk (no choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}]
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": choices, **more}
