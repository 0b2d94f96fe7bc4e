"""Bounded parsing of LLM replies: linear time, a size cap and a depth cap, and every parse
failure an InvalidOutput (the recorded repair/fallback path), never another exception."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memgas.pipeline.justmem import structured
from memgas.pipeline.justmem.structured import InvalidOutput, parse_json_object

OBJ = {"cards": [{"text": "Caroline adopted a dog.", "type": "event", "time": "", "turn_start": 0, "turn_end": 0}]}

#: Wall-clock bound on the subprocess that parses a huge reply. Not a timing assert: a linear parse of these
#: replies takes well under a second; the bound only keeps a super-linear parse (the old code-fence regex:
#: 80 KB took 28 s, 60 MB ran for ever) from hanging the suite: it then fails instead.
HANG_S = 20


def _parse_in_subprocess(expr: str) -> str:
    """``parse_json_object(<expr>)`` in a fresh interpreter: 'ok <keys>' or 'invalid <message>'."""
    code = ("import sys\nfrom memgas.pipeline.justmem.structured import InvalidOutput, parse_json_object as p\n"
            f"reply = {expr}\n"
            "try:\n    obj = p(reply)\nexcept InvalidOutput as e:\n    print('invalid', e)\n"
            "else:\n    print('ok', sorted(obj))\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"parsing {expr} did not end within {HANG_S} s: the parse is not linear")
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_a_60_mb_whitespace_reply_is_invalid_and_parsing_ends() -> None:
    out = _parse_in_subprocess(f"'```json\\n' + {json.dumps(json.dumps(OBJ))} + ' ' * 60_000_000")
    n = len("```json\n") + len(json.dumps(OBJ)) + 60_000_000
    assert out == f"invalid the reply is {n} characters; at most {structured.MAX_REPLY_CHARS} are parsed"


def test_trailing_whitespace_up_to_the_size_cap_parses_in_linear_time() -> None:
    """An object padded with whitespace to just under the cap (runaway whitespace of guided decoding, the closing
    fence never written): the object is found (the old fence regex needed hours for this)."""
    head = "'```json\\n' + " + json.dumps(json.dumps(OBJ))
    out = _parse_in_subprocess(f"{head} + ' \\n' * (({structured.MAX_REPLY_CHARS} - 200) // 2)")
    assert out == "ok ['cards']"


@pytest.mark.parametrize("expr, want", [
    # never closed, nested: the old loop decoded from every "{" to the end (quadratic)
    (f"'{{\"a\": [' * ({structured.MAX_REPLY_CHARS} // 8)",
     f"invalid the reply nests deeper than {structured.MAX_JSON_DEPTH} levels"),
    # a string never closed, full of escaped quotes: a scan retrying from each quote would be quadratic
    (f"'{{\"' + '\\\\\"' * ({structured.MAX_REPLY_CHARS} // 2 - 2)", "invalid the reply holds no complete JSON object"),
])
def test_pathological_replies_up_to_the_cap_end(expr, want) -> None:
    assert _parse_in_subprocess(expr) == want


@pytest.mark.parametrize("reply", [
    '{"a": ' * 100_000 + "1" + "}" * 100_000,
    '{"cards": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "Here: " + '{"x": {"y": [' * 50_000,
])
def test_deep_nesting_is_invalid_output_not_recursion_error(reply) -> None:
    with pytest.raises(InvalidOutput) as e:
        parse_json_object(reply)
    assert str(e.value) == f"the reply nests deeper than {structured.MAX_JSON_DEPTH} levels"


def test_nesting_at_the_cap_parses() -> None:
    d = structured.MAX_JSON_DEPTH
    reply = '{"a": ' * (d - 1) + "[1]" + "}" * (d - 1)
    assert parse_json_object(reply) == json.loads(reply)
    with pytest.raises(InvalidOutput):
        parse_json_object('{"a": ' * d + "[1]" + "}" * d)


@pytest.mark.parametrize("reply, want", [
    ("```json\n" + json.dumps(OBJ) + "\n```", OBJ),
    ("Here is the JSON: " + json.dumps(OBJ) + " Hope it helps {", OBJ),
    ("Use {braces} like this: " + json.dumps(OBJ), OBJ),
    ('{"note": "a } and a { in a string", "k": [1, {"z": "\\"}"}]}',
     {"note": "a } and a { in a string", "k": [1, {"z": "\"}"}]}),
])
def test_objects_around_text_and_fences_still_parse(reply, want) -> None:
    assert parse_json_object(reply) == want


@pytest.mark.parametrize("reply, problem", [
    ("", "the reply is empty"),
    ("   \n ", "the reply is empty"),
    ('{"cards": [', "the reply holds no complete JSON object"),
    ('{"n": ' + "1" * 5000 + "}", "the reply holds no complete JSON object"),  # int digit limit: ValueError
    ("[1, 2]", "the reply holds no complete JSON object"),
])
def test_every_parse_failure_is_invalid_output(reply, problem) -> None:
    with pytest.raises(InvalidOutput) as e:
        parse_json_object(reply)
    assert str(e.value) == problem


def test_a_lone_surrogate_in_a_reply_is_invalid_output() -> None:
    """``\\ud800`` escaped in JSON decodes to a string Parquet cannot store (not UTF-8): invalid, like any
    other unusable reply; a surrogate pair (an emoji) is one character and fine."""
    with pytest.raises(InvalidOutput) as e:
        parse_json_object('{"cards": [{"text": "Max \\ud800"}]}')
    assert str(e.value) == "the reply holds a lone surrogate (\\ud800), which is not text"
    assert parse_json_object('{"t": "\\ud83d\\ude00"}') == {"t": "\U0001F600"}
