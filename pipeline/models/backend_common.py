"""What the LLM backends share: checking a chat prompt, fitting it to the context (cut in the middle of its
longest message), recording an item's error with its flags, cutting at stop strings, and importing an optional
engine lazily with a message naming the package to install."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from memgas.pipeline.models.base import ChatPrompt, GenerationResult


def lazy_import(module: str, install_hint: str) -> Any:
    """``module``, or ImportError naming the package and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"this LLM backend needs the package {module!r}: {install_hint}") from exc


# -- prompt fitting ---------------------------------------------------------------------------------------

#: ``GenerationResult.extra`` flag of an item whose prompt does not fit the context even when cut: the
#: request's fault, not the model's (``memgas serve`` answers it with 400 ``context_length_exceeded``).
PROMPT_TOO_LONG = "prompt_too_long"


#: ``GenerationResult.extra`` flag of an item whose JSON schema the backend cannot enforce (the request's fault:
#: ``memgas serve`` answers 400, ``param: "response_format"``).
SCHEMA_UNSUPPORTED = "schema_unsupported"
#: ``GenerationResult.extra`` flag of an item whose generation was stopped by the caller's ``cancelled()``
#: callback (its client has gone, or the server is stopping): its text is not an answer.
CANCELLED = "cancelled"


class PromptTooLong(ValueError):
    """A prompt that does not fit the model's context even with its contents cut."""


class UnsupportedSchema(ValueError):
    """A JSON schema that the backend's constrained decoding cannot enforce."""


def item_error(result: GenerationResult, exc: BaseException) -> None:
    """Record ``exc`` as one item's error (``Type: message``), flagging :data:`PROMPT_TOO_LONG` and
    :data:`SCHEMA_UNSUPPORTED`."""
    result.error = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, PromptTooLong):
        result.extra[PROMPT_TOO_LONG] = True
    if isinstance(exc, UnsupportedSchema):
        result.extra[SCHEMA_UNSUPPORTED] = True


def truncate_messages_middle(
    messages: ChatPrompt,
    prompt_len: Callable[[ChatPrompt], int],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    budget: int,
    marker: str = "\n...\n",
) -> tuple[ChatPrompt, int]:
    """Shorten the longest message's content in its middle until ``prompt_len(messages) <= budget``.

    Returns (messages, tokens dropped). Re-tokenising the joined halves can shift counts by a token or
    two, so it iterates a few times. Raises ValueError when even empty contents do not fit.
    """
    msgs = [dict(m) for m in messages]
    dropped = 0
    for _ in range(6):
        excess = prompt_len(msgs) - budget
        if excess <= 0:
            return msgs, dropped
        i = max(range(len(msgs)), key=lambda k: len(msgs[k].get("content") or ""))
        ids = encode(msgs[i].get("content") or "")
        if not ids:
            break
        cut = min(len(ids), excess + 4)  # a little margin for the marker and re-tokenisation drift
        keep = len(ids) - cut
        head, tail = ids[: (keep + 1) // 2], ids[len(ids) - keep // 2 :] if keep // 2 else []
        msgs[i]["content"] = decode(head) + marker + decode(tail) if keep else ""
        dropped += cut
    if prompt_len(msgs) > budget:
        raise PromptTooLong(f"prompt does not fit in {budget} tokens even after truncation")
    return msgs, dropped


def apply_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """Cut at the earliest stop string (engines differ in whether they include it; we never do)."""
    cut = min((text.find(s) for s in stop if s and s in text), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def validate_prompt(prompt: Any) -> str | None:
    if not isinstance(prompt, list) or not prompt:
        return "empty prompt: expected a non-empty list of {role, content} messages"
    for k, m in enumerate(prompt):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            return f"message {k}: expected a dict with 'role' and string 'content'"
    return None
