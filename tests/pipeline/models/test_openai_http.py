"""HTTP backend against the real server (started here on a free localhost port), with injected faults."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from memgas.pipeline.config import LLMConfig
from memgas.pipeline.models.base import LLM, SamplingParams
from memgas.pipeline.models.factory import make_llm
from memgas.pipeline.models.openai_http import MAX_RESPONSE_BYTES, OpenAIHTTPLLM
from memgas.pipeline.models.server import ChatServer, EchoLLM, Faults, serve_in_thread

P = SamplingParams(max_tokens=5)


def _q(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture()
def echo_server() -> Iterator[ChatServer]:
    srv, _ = serve_in_thread(EchoLLM())
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(srv: ChatServer, **kw: object) -> OpenAIHTTPLLM:
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("max_retries", 3)
    return OpenAIHTTPLLM(srv.url, "echo", **kw)  # type: ignore[arg-type]


def test_roundtrip_order_and_usage(echo_server: ChatServer) -> None:
    llm = _client(echo_server, concurrency=4)
    assert isinstance(llm, LLM)
    prompts = [_q(f"item {i} a b c d e f") for i in range(10)] + [[]]
    res = llm.generate(prompts, P)
    assert [r.text for r in res[:10]] == [f"item {i} a b c" for i in range(10)]
    assert all(r.retries == 0 and r.finish_reason == "length" and r.completion_tokens == 5 for r in res[:10])
    assert res[10].error  # invalid prompt: its own error, never sent
    r = httpx.get(echo_server.url + "/models")
    assert r.json()["data"][0]["id"] == "echo"
    assert httpx.get(echo_server.url.replace("/v1", "/health")).json() == {"status": "ok"}


def test_500_then_success_counts_retries(echo_server: ChatServer) -> None:
    echo_server.faults.fail_500 = 2
    r = _client(echo_server).generate([_q("hello there")], P)[0]
    assert r.ok and r.text == "hello there" and r.retries == 2


def test_429_retry_and_exhaustion(echo_server: ChatServer) -> None:
    echo_server.faults.fail_429 = 1
    r = _client(echo_server).generate([_q("x")], P)[0]
    assert r.ok and r.retries == 1
    echo_server.faults.fail_429 = 10
    r = _client(echo_server, max_retries=2).generate([_q("x")], P)[0]
    assert not r.ok and "429" in (r.error or "") and r.retries == 2


def test_malformed_json_is_a_per_item_error(echo_server: ChatServer) -> None:
    echo_server.faults.malformed = 1
    res = _client(echo_server, concurrency=1).generate([_q("a"), _q("b")], P)
    assert not res[0].ok and "malformed" in (res[0].error or "")
    assert res[1].ok and res[1].text == "b"


def test_timeout_is_retried_then_reported(echo_server: ChatServer, capsys: pytest.CaptureFixture) -> None:
    echo_server.faults.delay_s = 0.6
    r = _client(echo_server, timeout_s=0.2, max_retries=1).generate([_q("slow")], P)[0]
    assert not r.ok and "Timeout" in (r.error or "") and r.retries == 1
    # the server answers after the client hung up: a quiet close, not a BrokenPipeError traceback on stderr
    time.sleep(1.2)
    echo_server.faults.delay_s = 0.0
    assert "Traceback" not in capsys.readouterr().err


def test_connection_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llm = OpenAIHTTPLLM(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff_base_s=0.01)
    res = llm.generate([_q("a"), _q("b")], P)
    assert all(not r.ok and "Connect" in (r.error or "") and r.retries == 1 for r in res)


def test_api_key_sent_but_never_shown(
    echo_server: ChatServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "sk-test-DO-NOT-LEAK-1234"
    monkeypatch.setenv("MEMGAS_TEST_KEY", secret)
    caplog.set_level(logging.DEBUG)
    echo_server.faults.fail_500 = 1  # exercise the retry log lines too
    llm = make_llm(LLMConfig(backend="openai", base_url=echo_server.url, model="echo",
                             api_key_env="MEMGAS_TEST_KEY", max_retries=2))
    assert isinstance(llm, OpenAIHTTPLLM)
    llm.backoff_base_s = 0.01
    r = llm.generate([_q("hi")], P)[0]
    assert r.ok and r.retries == 1
    assert echo_server.last_authorization == f"Bearer {secret}"
    assert secret not in repr(llm) and secret not in str(vars(llm))
    assert secret not in caplog.text


def test_generate_inside_running_loop_and_thread(echo_server: ChatServer) -> None:
    llm = _client(echo_server)

    async def inside() -> str:
        return llm.generate([_q("from a loop")], P)[0].text

    assert asyncio.run(inside()) == "from a loop"
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(llm.generate([_q("from a thread")], P)[0].text))
    t.start()
    t.join()
    assert box == ["from a thread"]


def test_client_side_truncation_flag(echo_server: ChatServer) -> None:
    llm = _client(echo_server, context_tokens=64)
    r = llm.generate([_q("word " * 400 + "END")], P)[0]
    assert r.ok and r.extra.get("truncated") is True


@pytest.mark.slow
def test_real_model_behind_server() -> None:
    smol = make_llm(LLMConfig(context_tokens=256))  # same cached weights as test_llms.py
    srv, _ = serve_in_thread(smol, faults=Faults())
    try:
        llm = OpenAIHTTPLLM(srv.url, smol.name)
        direct = smol.generate([_q("What is the capital of France?")], SamplingParams(max_tokens=6))[0]
        via = llm.generate([_q("What is the capital of France?")], SamplingParams(max_tokens=6))[0]
        assert via.ok and via.text == direct.text
        assert via.prompt_tokens == direct.prompt_tokens and via.completion_tokens == direct.completion_tokens
    finally:
        srv.shutdown()
        srv.server_close()


def _bounded_generate(llm: OpenAIHTTPLLM, prompts: list, bound_s: float) -> list:
    """``llm.generate`` in a daemon thread, failing the test (instead of hanging it) past ``bound_s``."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(llm.generate(prompts, P)), daemon=True)
    t.start()
    t.join(bound_s)
    if t.is_alive():
        pytest.fail(f"generate did not return within {bound_s} s")
    return box[0]


def test_huge_response_body_is_capped_and_retried(echo_server: ChatServer) -> None:
    """A 50 MB body (a valid completion) is read only up to MAX_RESPONSE_BYTES, then counted and retried like a
    transport failure; the next answer is used. A server that keeps sending it fails the item, not the run."""
    echo_server.faults.huge_body = 1
    r = _bounded_generate(_client(echo_server, timeout_s=20), [_q("after the flood")], 60)[0]
    assert (r.ok, r.text, r.retries) == (True, "after the flood", 1)
    echo_server.faults.huge_body = 3
    r = _bounded_generate(_client(echo_server, timeout_s=20, max_retries=2), [_q("x")], 60)[0]
    assert (r.ok, r.text, r.retries) == (False, "", 2)
    assert r.error == (f"ResponseTooLarge: the response body is larger than the limit of {MAX_RESPONSE_BYTES} "
                       f"bytes (after 2 retries)")


def test_endless_response_body_gives_up_within_the_timeout(echo_server: ChatServer) -> None:
    """A body that never ends (a byte every 50 ms, so no single read ever times out) is given up after
    ``timeout_s`` per attempt, counted and retried; two items in one batch both fail, within the bound."""
    echo_server.faults.endless_body = 4
    res = _bounded_generate(_client(echo_server, timeout_s=1.0, max_retries=1), [_q("a"), _q("b")], 30)
    assert [(r.ok, r.text, r.retries) for r in res] == [(False, "", 1), (False, "", 1)]
    assert [r.error for r in res] == ["TimeoutError: no complete response within 1 s (after 1 retries)"] * 2
    assert echo_server.faults.endless_body == 0


@pytest.fixture()
def canned_server() -> Iterator[tuple[list[bytes], str]]:
    """A real HTTP server answering every POST with the next body of its list (the last one repeats), with 200
    or the status given beside it as ``(status, body)``:
    a backend that speaks HTTP but sends what no OpenAI-compatible server should."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            item = bodies.pop(0) if len(bodies) > 1 else bodies[0]
            status, raw = item if isinstance(item, tuple) else (200, item)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield bodies, f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def _completion(content: object = "Paris", usage: object = None) -> bytes:
    import json

    body = {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body).encode()


@pytest.mark.parametrize("usage, why", [
    ({"prompt_tokens": 10**30, "completion_tokens": 3}, "usage.prompt_tokens 1000000000000000000000000000000 is not a "
                                                          "token count"),
    ({"prompt_tokens": 5, "completion_tokens": -9}, "usage.completion_tokens -9 is not a token count"),
    ({"prompt_tokens": 1e30, "completion_tokens": 3}, "usage.prompt_tokens 1e+30 is not a token count"),
    ({"prompt_tokens": "12", "completion_tokens": "x"}, "usage.prompt_tokens '12' is not a token count"),
    ({"prompt_tokens": True, "completion_tokens": 3}, "usage.prompt_tokens True is not a token count"),
])
def test_usage_that_is_not_a_token_count_is_a_malformed_response(canned_server, usage: dict, why: str) -> None:
    """A backend's usage of 10^30 tokens passed the client and ended `memgas answer` with exit 1 (OverflowError at
    the Parquet write); "x" raised inside the error path (AttributeError). Each is the item's malformed response."""
    bodies, url = canned_server
    bodies.append(_completion(usage=usage))
    r = OpenAIHTTPLLM(url, "m", max_retries=0).generate([_q("a")], P)[0]
    assert (r.ok, r.text, r.prompt_tokens, r.completion_tokens) == (False, "", 0, 0)
    assert r.error == f"malformed response (ValueError: {why}): {bodies[0][:200].decode()!r}"


def test_content_that_is_not_text_is_a_malformed_response(canned_server) -> None:
    """A number for the message's content was taken as an empty answer; null (no text: a refusal, a tool call)
    stays an empty answer, and whole-number floats and missing usage stay accepted."""
    bodies, url = canned_server
    bodies.extend([_completion(content=12345), _completion(content=None), _completion(usage={"prompt_tokens": 7.0})])
    llm = OpenAIHTTPLLM(url, "m", max_retries=0, concurrency=1)
    bad, null, floats = llm.generate([_q("a"), _q("b"), _q("c")], P)
    assert bad.error == ("malformed response (ValueError: choices[0].message.content is a int, not text or null): "
                         f"{_completion(content=12345).decode()!r}")
    assert (null.ok, null.text) == (True, "")
    assert (floats.ok, floats.text, floats.prompt_tokens, floats.completion_tokens) == (True, "Paris", 7, 0)


def test_a_servers_context_length_exceeded_is_prompt_too_long(canned_server) -> None:
    """`memgas serve` (and OpenAI) refuse a prompt that cannot fit with 400 `context_length_exceeded`: the item is
    marked PROMPT_TOO_LONG, as a local backend marks it, so it is not retried as a transient failure; any other
    400 is not."""
    import json

    from memgas.pipeline.models.backend_common import PROMPT_TOO_LONG

    too_long = json.dumps({"error": {"message": "too long", "type": "invalid_request_error", "param": "messages",
                                     "code": "context_length_exceeded"}}).encode()
    other = json.dumps({"error": {"message": "bad", "type": "invalid_request_error", "param": "stop",
                                  "code": None}}).encode()
    bodies, url = canned_server
    bodies.extend([(400, too_long), (400, other)])
    llm = OpenAIHTTPLLM(url, "m", max_retries=0, concurrency=1)
    first, second = llm.generate([_q("a"), _q("b")], P)
    assert (first.ok, first.extra.get(PROMPT_TOO_LONG), first.error) == (False, True, f"HTTP 400: {too_long.decode()}")
    assert (second.ok, PROMPT_TOO_LONG in second.extra) == (False, False)
