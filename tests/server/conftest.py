"""The server under test: `python -m pymlxc.server` on a tiny random model, as a child process on
a free loopback port; the tests talk to it over HTTP with the official `openai` client."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

try:
    import httpx
except ImportError:  # the openai client's HTTP library under its newer name
    import httpx2 as httpx  # type: ignore[no-redef]
import pytest

from pymlxc.testing import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"

# A Hermes-style template that renders the tools, as Qwen's templates do, so that tool calls are
# parsed in the `<tool_call>` format.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "Answer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@dataclass
class Server:
    url: str
    model_dir: Path
    process: subprocess.Popen[bytes]

    def health(self) -> dict[str, int]:
        return httpx.get(f"{self.url}/health", timeout=10).json()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, *args: str, log: Path) -> Server:
    port = _free_port()
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(
        [sys.executable, "-m", "pymlxc.server", str(model_dir), "--port", str(port), *args],
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return Server(url, model_dir, process)
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not start: {log.read_text()[-2000:]}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "qwen3", "qwen3", seed=3,
                            chat_template=TOOLS_TEMPLATE)


@pytest.fixture(scope="session")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(model_dir, "--api-key", API_KEY, "--max-concurrency", "16", "--max-body-bytes", "65536",
                           "--max-tokens-limit", "8192", log=tmp_path_factory.mktemp("log") / "server.log")
    yield running
    stop_server(running)
