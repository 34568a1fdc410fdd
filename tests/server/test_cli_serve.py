"""`python build.py serve` as a user runs it: with no --model it serves SmolLM2 on CPU,
prints where it listens and how long loading took, and the unchanged openai client
works against it. Startup errors are one sentence and exit 1."""
from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

BUILD = Path(__file__).resolve().parents[2] / "build.py"


class ServeProcess:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(BUILD), "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        seen = []
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {pattern!r} within {timeout} s; output: {''.join(seen)}") from None
            if line is None:
                raise AssertionError(f"exited ({self.proc.wait()}) without {pattern!r}: {''.join(seen)}")
            seen.append(line)
            if m := re.search(pattern, line):
                return m

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="module")
def smollm2_server(smollm2_gguf):
    srv = ServeProcess("--api-key", "k3y", "--max-model-len", "1024", "--kv-cache-tokens", "4096")
    m = srv.wait_for(r"serving (\S+) on http://127\.0\.0\.1:(\d+) \(model loaded in [\d.]+ s")
    srv.name, srv.url = m.group(1), f"http://127.0.0.1:{m.group(2)}"
    yield srv
    assert srv.stop() == 0


def test_default_model_with_the_openai_client(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="k3y", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [smollm2_server.name]
    resp = client.completions.create(model=smollm2_server.name, prompt="The capital of France is",
                                     max_tokens=2, temperature=0)
    assert resp.choices[0].text.startswith(" Paris")
    chunks = list(client.chat.completions.create(
        model=smollm2_server.name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage.completion_tokens == 6
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_missing_chat_template_file_is_one_sentence():
    proc = subprocess.run([sys.executable, str(BUILD), "serve", "--chat-template", "/no/such/template.jinja"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: chat template file /no/such/template.jinja does not exist"
