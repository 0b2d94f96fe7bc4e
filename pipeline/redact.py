"""What memgas writes or prints never carries a credential or a terminal control sequence.

:func:`redact` is the one redaction function: every config dump (config.yaml, manifest.json, RUNNING.json,
the bank manifest), every error line, log line and warning goes through it. It removes the user-info part of
URLs (``http://user:pass@host/v1`` -> ``http://***@host/v1``; a bare token as user name is a credential too)
and the values of query parameters that carry keys (``?api_key=...``). The config itself keeps the real
values: the HTTP client needs them, and fingerprints hash them without showing them.

:func:`printable` is for text bound for a terminal: dataset strings can hold ANSI escapes (``\\x1b[2J``
clears the screen, OSC sequences set the window title or write the clipboard) and carriage returns that
overwrite what was printed.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"

# scheme://USERINFO@ : greedy up to the last '@' before the path, so a password holding a raw '@' is covered;
# also scheme:/USERINFO@, the form a URL takes after pathlib folded its "//" (a URL given as data.path)
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*:/{1,2})(?P<userinfo>[^\s/?#]*)@")
_SECRET_QUERY = re.compile(
    r"(?i)(?P<key>[?&](?:api[_-]?key|key|token|access[_-]?token|auth|secret|password|passwd|pwd|sig|signature)=)"
    r"[^&#\s]+")
# C0 controls but tab and newline, DEL, and C1 controls (0x80-0x9f: CSI and OSC have 8-bit forms)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")


def redact(text: str) -> str:
    """``text`` with URL credentials and secret query values replaced by ``***``."""
    if ":/" not in text and "=" not in text:  # the common case: nothing to look at
        return text
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)
    return _SECRET_QUERY.sub(lambda m: f"{m['key']}{REDACTED}", text)


def redact_obj(obj: Any) -> Any:
    """A copy of a JSON-like ``obj`` (dicts, lists, strings, numbers) with every string redacted."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return obj


def printable(text: str) -> str:
    """``text`` redacted and safe for a terminal: control characters (ESC included) shown as ``\\xNN``;
    tab and newline kept (multi-line messages), carriage return shown (it overwrites the line)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", redact(text))
