"""`memgas serve`: the OpenAI-compatible endpoint over the configured LLM.

The fast test serves the tiny echo model in a thread; the slow one starts the real command as a
subprocess with the CPU default (SmolLM2 through transformers' GGUF loader) and calls it with httpx.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from memgas.pipeline.config import LLMConfig
from memgas.pipeline.models.server import EchoLLM, serve_forever_from_config

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_forever_from_config_answers_and_stops() -> None:
    ready = threading.Event()
    holder = {}

    def on_ready(srv) -> None:
        holder["srv"] = srv
        ready.set()

    t = threading.Thread(target=serve_forever_from_config, args=(LLMConfig(),),
                         kwargs={"port": 0, "llm": EchoLLM(), "on_ready": on_ready}, daemon=True)
    t.start()
    assert ready.wait(30)
    srv = holder["srv"]
    try:
        r = httpx.post(f"{srv.url}/chat/completions", json={"model": "echo", "max_tokens": 3,
                       "messages": [{"role": "user", "content": "one two three four"}]}, timeout=30)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "one two three"
        assert httpx.get(f"{srv.url}/models", timeout=30).json()["data"][0]["id"] == "echo"
    finally:
        srv.shutdown()
    t.join(30)
    assert not t.is_alive()


def test_a_busy_port_fails_before_the_model_loads() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        loaded = []
        with pytest.raises(OSError) as exc:
            serve_forever_from_config(LLMConfig(), port=port, on_ready=lambda srv: loaded.append(srv))
        assert "in use" in str(exc.value) and not loaded


@pytest.mark.slow
def test_memgas_serve_with_the_cpu_model() -> None:
    port = _free_port()
    exe = Path(sys.executable).with_name("memgas")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.Popen([str(exe), "serve", "--port", str(port), "--set", "llm.threads=1"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        deadline = time.time() + 300
        while True:  # the socket is bound at once; requests wait until the model is loaded
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=300)
                break
            except httpx.ConnectError:
                assert time.time() < deadline
                time.sleep(0.2)
        assert health.json() == {"status": "ok"}
        r = httpx.post(f"{base}/chat/completions", timeout=300, json={
            "model": "smollm2", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]})
        assert r.status_code == 200, r.text
        body = r.json()
        text = body["choices"][0]["message"]["content"]
        assert isinstance(text, str) and text.strip()
        assert 0 < body["usage"]["completion_tokens"] <= 8 and body["usage"]["prompt_tokens"] > 5
        models = httpx.get(f"{base}/models", timeout=30).json()["data"]
        assert "SmolLM2" in models[0]["id"] or "smollm" in models[0]["id"].lower()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err
