"""The OpenAI API's request bodies, checked, and its error JSON.

``parse_request`` turns the JSON body of ``POST /v1/completions`` or ``POST /v1/chat/completions``
into a ``GenerationRequest`` or raises ``ApiError``, whose ``body()`` is the OpenAI error object
``{"error": {"message", "type", "param", "code"}}`` with ``param`` naming the field. Everything is
checked here, before a request reaches the engine: JSON syntax (NaN and infinities are not JSON),
the body is an object, every field is known and of its type (a bool is not a number, a float is not
an integer), the model is the one served (404 otherwise), and the sampling parameters' values
(through ``ir.sampling.SamplingParams``, whose ``IRValidationError`` names the field: it is
answered under the OpenAI name, ``max_tokens`` for ``max_new_tokens``). ``null`` means "not given",
as in the OpenAI API. ``n`` (1 to ``MAX_N`` completions) and logprobs (a completion's ``logprobs``,
an integer: the alternatives per token, 0 to ``MAX_LOGPROBS``; a chat's ``logprobs: true`` with
``top_logprobs``, 0 to ``MAX_LOGPROBS``) become ``SamplingParams.n`` and ``.logprobs``. Fields the
server cannot honour yet (``echo``, ``suffix``, ``logit_bias``, tools, ``best_of`` other than ``n``)
are refused with a 400 saying so, never ignored.

The prompt's length against the context is checked by the caller once it is tokenised
(``check_context``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final, Literal

import attrs

from compiler.offline.load import sampling_params
from ir.errors import IRValidationError
from ir.sampling import MAX_LOGPROBS, MAX_N, SamplingParams

__all__ = ["DEFAULT_COMPLETION_TOKENS", "ROLES", "ApiError", "ChatMessage", "GenerationRequest", "Kind", "bad", "check_context", "load_json", "parse_request"]

Kind = Literal["completion", "chat"]
"""Which endpoint a request came to: ``/v1/completions`` or ``/v1/chat/completions``."""

DEFAULT_COMPLETION_TOKENS: Final = 16
"""``max_tokens`` of a completion that gives none (the OpenAI API's default)."""

_SAMPLING: Final = {
    # OpenAI / vLLM body name -> SamplingParams field
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
    "stop": "stop", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "min_tokens": "min_tokens", "n": "n",
}
_COMMON: Final = frozenset({"model", "stream", "stream_options", "max_tokens", "user", "logprobs", "logit_bias", *_SAMPLING})
_FIELDS: Final[Mapping[Kind, frozenset[str]]] = {
    "completion": _COMMON | {"prompt", "echo", "suffix", "best_of"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt", "tools", "tool_choice",
                       "response_format"},
}
ROLES: Final = ("system", "user", "assistant", "tool", "developer")
"""The roles a chat message may have."""


class ApiError(Exception):
    """An OpenAI error answer: HTTP ``status`` and the error object's fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, object]:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    """A 400 ``ApiError`` naming the body field ``param`` (``None``: the body as a whole)."""
    return ApiError(400, message, param=param, code=code)


@attrs.frozen(kw_only=True)
class ChatMessage:
    """One message of a chat request: its ``role`` (one of ``ROLES``) and its text ``content``."""

    role: str
    content: str


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """One checked request: what to generate and how to answer."""

    kind: Kind
    prompt: str | tuple[int, ...] | None
    """A completion's prompt: text, or token ids (``None`` for a chat)."""
    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool
    sampling: SamplingParams
    max_tokens_given: bool
    """Whether the body set the limit (a chat without one gets the rest of the context)."""
    stream: bool
    include_usage: bool

    @property
    def max_tokens_param(self) -> str:
        """The name error messages give the token limit: ``max_tokens`` for a completion,
        ``max_completion_tokens`` for a chat."""
        return "max_tokens" if self.kind == "completion" else "max_completion_tokens"


def _no_constants(text: str) -> object:
    raise ValueError(f"{text} is not JSON")


def load_json(body: bytes) -> dict[str, object]:
    """The body as a JSON object, or ``ApiError`` 400."""
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError as exc:
        raise bad(None, f"the body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        raise bad(None, f"the body is not valid JSON: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(value, dict):
        raise bad(None, f"the body must be a JSON object, got {_json_type(value)}")
    return value


def _json_type(value: object) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case _:
            return "an object"


def _bool(body: Mapping[str, object], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be a boolean, got {_json_type(value)}")
    return value


def _int(body: Mapping[str, object], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"{name} must be an integer, got {_json_type(value)}")
    return value


def _prompt(value: object) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if len(value) == 1 and isinstance(value[0], str):
            return value[0]
        if value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return tuple(value)  # token ids (checked against the vocabulary by the caller)
        if value and all(isinstance(p, (str, list)) for p in value):
            raise bad("prompt", f"a batch of {len(value)} prompts is not supported yet: send one prompt per request")
    raise bad("prompt", f"prompt must be a non-empty string or a list of token ids, got {_json_type(value)}")


def _content(i: int, value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content", "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", f"content must be a string or a list of text parts, got {_json_type(value)}")


def _messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise bad("messages", f"messages must be a non-empty array, got {_json_type(value) if value != [] else 'an empty array'}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"a message must be an object, got {_json_type(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"role must be one of {', '.join(ROLES)}, got {role!r}"[:300])
        out.append(ChatMessage(role=str(role), content=_content(i, m.get("content"))))
    return tuple(out)


def _logprobs(body: Mapping[str, object], kind: Kind) -> int | None:
    """The alternatives per token a request's logprobs ask for (``None``: no logprobs)."""
    if kind == "completion":
        k = _int(body, "logprobs")
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise bad("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {k}")
        return k
    wanted = _bool(body, "logprobs", False)
    k = _int(body, "top_logprobs")
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {k}")
    if k is not None and not wanted:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    return (k or 0) if wanted else None


def parse_request(body: Mapping[str, object], kind: Kind, *, model: str, defaults: Mapping[str, object] | None = None) -> GenerationRequest:
    """``body`` (a JSON object) checked against the endpoint ``kind`` and the served ``model``
    (see the module), or ``ApiError``. A sampling field the body does not set takes its value from
    ``defaults`` (``batchc serve --temperature`` and the like) if there is one, as a workload line
    does in ``batchc run`` (``compiler.offline.load.sampling_params``)."""
    unknown = sorted(set(body) - _FIELDS[kind])
    if unknown:
        raise bad(unknown[0], f"unknown field {unknown[0]!r}"[:300])
    name = body.get("model")
    if not isinstance(name, str):
        raise bad("model", f"model must be a string, got {_json_type(name)}")
    if name != model:
        raise ApiError(404, f"The model {name!r} does not exist; this server serves {model!r}"[:300], param="model", code="model_not_found")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise bad("stream_options", "stream_options must be an object with include_usage")
        include_usage = _bool(options, "include_usage", False)
    n = _int(body, "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise bad("n", f"n must be in [1, {MAX_N}], got {n}")
    logprobs = _logprobs(body, kind)
    # what this server cannot do yet is refused, never silently ignored
    best_of = body.get("best_of")
    if best_of is not None and best_of != (n or 1):
        raise bad("best_of", f"best_of other than n ({n or 1}) is not supported")
    if _bool(body, "echo", False):
        raise bad("echo", "echo is not supported")
    for field in ("suffix", "tools", "response_format"):
        if body.get(field) is not None:
            raise bad(field, f"{field} is not supported")
    if body.get("tool_choice") not in (None, "none"):
        raise bad("tool_choice", "tools are not supported")
    if body.get("logit_bias") not in (None, {}):
        raise bad("logit_bias", "logit_bias is not supported")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"user must be a string, got {_json_type(user)}")
    if kind == "completion":
        prompt: str | tuple[int, ...] | None = _prompt(body.get("prompt"))
        messages: tuple[ChatMessage, ...] = ()
        limit_name = "max_tokens"
        limit = _int(body, "max_tokens")
    else:
        prompt = None
        messages = _messages(body.get("messages"))
        limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        limit = _int(body, limit_name)
    given = {api: body[api] for api in _SAMPLING if body.get(api) is not None}
    fields = {_SAMPLING[api]: value for api, value in given.items()}
    if logprobs is not None:
        fields["logprobs"] = logprobs
    max_new = limit if limit is not None else DEFAULT_COMPLETION_TOKENS
    try:
        sampling = sampling_params(fields, defaults or {}, max_new_tokens=max_new)
    except IRValidationError as exc:
        field = limit_name if exc.field == "max_new_tokens" else exc.field
        raise bad(field, str(exc).replace("SamplingParams.max_new_tokens", limit_name)) from None
    except TypeError as exc:  # (an unknown field: excluded above)
        raise bad(None, str(exc)) from None
    return GenerationRequest(kind=kind, prompt=prompt, messages=messages, add_generation_prompt=_bool(body, "add_generation_prompt", True),
                             sampling=sampling, max_tokens_given=limit is not None, stream=stream, include_usage=include_usage)


def check_context(req: GenerationRequest, prompt_len: int, *, max_len: int, reserve: int) -> SamplingParams:
    """The request's sampling with its ``max_new_tokens`` fitted to the context: a prompt with no
    room for one new token is refused (param ``prompt`` or ``messages``), and so is a given limit
    past the room (param ``max_tokens``); a chat without a limit gets the room."""
    room = max_len - reserve - prompt_len
    what = "prompt" if req.kind == "completion" else "messages"
    if prompt_len == 0:
        raise bad(what, f"the {what} is empty (no tokens)")
    if room < 1:
        raise bad(what, f"the prompt is {prompt_len} tokens: with the {reserve} positions a step keeps free it leaves no room "
                  f"for a new token in this model's context of {max_len} tokens", code="context_length_exceeded")
    new = req.sampling.max_new_tokens
    if not req.max_tokens_given:
        new = room if req.kind == "chat" else min(new, room)
    elif new > room:
        raise bad(req.max_tokens_param, f"{req.max_tokens_param} {new} is over the room left by the prompt: {prompt_len} prompt tokens + "
                  f"{new} new tokens + {reserve} free positions exceed the context of {max_len} tokens", code="context_length_exceeded")
    if new != req.sampling.max_new_tokens:
        return attrs.evolve(req.sampling, max_new_tokens=new, min_tokens=min(req.sampling.min_tokens, new))
    return req.sampling
