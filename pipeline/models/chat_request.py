"""The body of a chat-completions request, checked: (messages, sampling parameters) or :class:`BadRequest`.

Nothing is substituted or ignored silently: every field OpenAI defines is either honoured, accepted because it
changes nothing, or refused with 400 naming it (OpenAI's error contract: ``param`` and, where OpenAI has one, its
machine-readable ``code``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from memgas.pipeline.models.base import ChatPrompt, SamplingParams

#: Largest ``max_tokens`` a request may ask for (the served models' contexts are far smaller; the model's
#: context bounds it further: at most ``context_tokens - 1``, one token left for the prompt).
MAX_COMPLETION_TOKENS = 1 << 20
#: Most messages in one request (OpenAI's own cap). Each costs template tokens, and a prompt is re-rendered
#: whole while it is cut to fit: thousands of them hold the only model for nothing.
MAX_MESSAGES = 2048
#: Most stop sequences in one request (OpenAI's own cap).
MAX_STOP = 4
#: Roles a memgas chat prompt has and every served chat template renders; others (``tool``, ``function``,
#: ``developer``, made-up ones) are refused rather than rendered as text the model was never trained on.
ROLES = ("system", "user", "assistant")
#: Request fields this server honours.
SUPPORTED_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
                    "seed", "response_format", "stream")
#: Fields that change nothing in the answer (bookkeeping in OpenAI's API): accepted and ignored.
IGNORED_FIELDS = ("user", "metadata", "store")
#: Fields OpenAI defines that this server does not implement, with the values that ask for nothing
#: (accepted); any other value is refused with 400 rather than silently ignored.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None, False, True),
    "stream_options": (None,), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,), "service_tier": (None, "auto", "default"),
}
#: Most characters of a client's value quoted back in an error message (a 500 KB model name was echoed whole).
MAX_QUOTED_CHARS = 200


class BadRequest(Exception):
    """An invalid request: HTTP ``status`` (400, 404 or 413) with an OpenAI-style error naming ``param``, and
    OpenAI's machine-readable ``code`` where it has one (``model_not_found``, ``context_length_exceeded``...)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code



def not_found(model: str) -> str:
    shown = model if len(model) <= MAX_QUOTED_CHARS else model[:MAX_QUOTED_CHARS] + "..."
    return f"The model `{shown}` does not exist or you do not have access to it."


def _number(req: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    v = req.get(key)
    if v is None:
        return default
    # bool is an int in Python; NaN and infinity fail the range test (json.loads accepts NaN and Infinity)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
        raise BadRequest(f"{key} must be a number in [{low:g}, {high:g}], got {json.dumps(v)[:40]}", key)
    return float(v)


def _whole(req: dict[str, Any], key: str, low: int, high: int) -> int | None:
    v = req.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        code = None if isinstance(v, bool) or not isinstance(v, int) else \
            "integer_below_min_value" if v < low else "integer_above_max_value"  # OpenAI's codes for these
        raise BadRequest(f"{key} must be a whole number in [{low}, {high}], got {json.dumps(v)[:40]}", key, code=code)
    return v


def parse_chat_request(raw: bytes, *, served: Sequence[str] = (),
                       context_tokens: int | None = None) -> tuple[ChatPrompt, SamplingParams]:
    """(messages, sampling parameters) of a chat-completions body, or BadRequest naming the parameter.

    Nothing is substituted or ignored silently: ``max_tokens`` 0 or negative is refused (only a missing one
    takes the default, 256), and so are ``stream: true`` (whole completions only), fields OpenAI does not
    define, and those it defines that this server does not implement unless they ask for nothing
    (:data:`NEUTRAL_VALUES`). Given ``served`` (the model's names), another ``model`` is a 404
    ``model_not_found``; given ``context_tokens``, ``max_tokens`` must leave a token for the prompt.
    """
    try:
        req = json.loads(raw or b"{}")
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the body is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    except RecursionError:
        raise BadRequest("the body is not valid JSON: nested too deeply") from None
    if not isinstance(req, dict):
        raise BadRequest("the body must be a JSON object")
    _check_fields(req)
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {json.dumps(model)[:40]}", "model")
    if model is not None and served and model not in served:
        raise BadRequest(not_found(model), "model", status=404, code="model_not_found")
    messages = _messages(req.get("messages"))
    if req.get("stream") not in (None, False):
        raise BadRequest("stream: true is not supported by memgas serve; send stream: false (or leave it out)",
                         "stream")
    max_key = "max_completion_tokens" if req.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _whole(req, max_key, 1, MAX_COMPLETION_TOKENS)
    if max_tokens is not None and context_tokens is not None and max_tokens >= context_tokens:
        raise BadRequest(f"Invalid '{max_key}': integer above maximum value. Expected a value <= "
                         f"{context_tokens - 1} (this model's context is {context_tokens} tokens, and the prompt "
                         f"needs at least one), but got {max_tokens} instead.", max_key,
                         code="integer_above_max_value")
    stop = req.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        if len(stop) > MAX_STOP:  # each is searched in the text after every step
            raise BadRequest(f"Invalid 'stop': array too long. Expected an array with maximum length {MAX_STOP}, "
                             f"but got an array with length {len(stop)} instead.", "stop",
                             code="array_above_max_length")
        stop = tuple(stop)
    else:
        raise BadRequest("stop must be a string or an array of strings", "stop")
    if any(not x for x in stop):  # it matches before the first token: a stop that can mean nothing
        raise BadRequest("stop sequences must be non-empty strings", "stop")
    for x in stop:
        if not _is_unicode(x):  # JSON's "\\ud800" decodes to a lone surrogate, which no tokenizer takes
            raise BadRequest(f"stop {json.dumps(x)[:60]} is not valid Unicode text (a lone surrogate)", "stop")
    params = SamplingParams(
        max_tokens=256 if max_tokens is None else max_tokens,
        temperature=_number(req, "temperature", 0.0, 0.0, 2.0),
        top_p=_number(req, "top_p", 1.0, 0.0, 1.0),
        stop=stop,
        seed=_whole(req, "seed", -(2**63), 2**63 - 1) or 0,
        json_schema=_json_schema(req.get("response_format")),
    )
    return messages, params


def _check_fields(req: dict[str, Any]) -> None:
    """Refuse fields OpenAI does not define (as OpenAI does), and defined ones this server cannot honour
    unless their value asks for nothing: a request never gets an answer that silently ignored part of it."""
    for key, value in req.items():
        if key in SUPPORTED_FIELDS or key in IGNORED_FIELDS:
            continue
        if key not in NEUTRAL_VALUES:
            raise BadRequest(f"Unrecognized request argument supplied: {key[:80]}", key[:80])
        # type-exact: true == 1 and 1.0 == 1 in Python, but n: true is not n: 1
        if not any(value is None if v is None else (type(value) is type(v) and value == v)
                   for v in NEUTRAL_VALUES[key]):
            raise BadRequest(f"{key} {json.dumps(value)[:60]} is not supported by memgas serve (one choice, plain "
                             f"text, no tools or log-probabilities); leave {key} out", key)


def _messages(messages: Any) -> ChatPrompt:
    """``messages``: 1 to MAX_MESSAGES objects, each with a role in ROLES and a string content that is valid
    Unicode (JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer takes)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"Invalid 'messages': array too long. Expected an array with maximum length {MAX_MESSAGES}, "
                         f"but got an array with length {len(messages)} instead.", "messages",
                         code="array_above_max_length")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRequest(f"messages[{i}] must be an object with a string role and a string content",
                             f"messages[{i}]")
        if m["role"] not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(m['role'])[:40]}",
                             f"messages[{i}].role")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(f"messages[{i}].content is not valid Unicode text: a lone surrogate "
                             f"{json.dumps(exc.object[exc.start])} at character {exc.start}",
                             f"messages[{i}].content") from None
    return messages


def _json_schema(rf: Any) -> dict | None:
    """The schema of ``response_format`` (``text``, ``json_object`` or ``json_schema``), None when none."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise BadRequest("response_format must be an object", "response_format")
    kind = rf.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise BadRequest(f"response_format.type must be text, json_object or json_schema, got "
                         f"{json.dumps(kind)[:40]}", "response_format")
    if kind != "json_schema":
        return None
    js = rf.get("json_schema")
    schema = js.get("schema") if isinstance(js, dict) else None
    if not isinstance(schema, dict):
        raise BadRequest("response_format.json_schema.schema must be an object", "response_format")
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    try:  # against its own draft's meta-schema ($schema, else the latest): "type": "objekt" is no JSON Schema
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(k) for k in exc.path)
        raise BadRequest(f"response_format.json_schema.schema is not a valid JSON Schema: "
                         f"{exc.message[:MAX_QUOTED_CHARS]}{f' (at {where})' if where else ''}",
                         "response_format") from None
    except RecursionError:
        raise BadRequest("response_format.json_schema.schema is nested too deeply", "response_format") from None
    return schema


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_context(prompt_tokens: int, max_tokens: int, context_tokens: int) -> None:
    """BadRequest ``context_length_exceeded`` (OpenAI's code and message) when the prompt and the completion it
    asks for do not fit the model's context together. Nothing is cut: a client that needs the whole prompt read
    gets told, instead of an answer to a prompt with its middle missing."""
    if prompt_tokens + max_tokens > context_tokens:
        raise BadRequest(f"This model's maximum context length is {context_tokens} tokens. However, you requested "
                         f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                         "completion). Please reduce the length of the messages or completion.", "messages",
                         code="context_length_exceeded")
