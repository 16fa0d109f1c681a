"""Real servers for the server tests: uvicorn on 127.0.0.1, in a thread or a subprocess.

Only loopback addresses are ever bound or contacted. The in-process servers
share one SmolLM2-135M LLM (n-gram drafter, k=4); they run one at a time.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

import real
from specdecode import NgramDrafter
from specdecode.llm import LLM, LoadInfo
from specdecode.server import create_app

HOST = "127.0.0.1"
# The official SDKs build their own HTTP clients (httpx or httpx2, by version):
# keep any proxy settings away from loopback.
os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), HOST, "localhost"]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@functools.cache
def smol_llm() -> LLM:
    m = real.load("smollm2-135m")
    info = LoadInfo(target=str(real.path("smollm2-135m")), drafter="ngram")
    return LLM(m.model, m.tokenizer, NgramDrafter(max_n=3, min_n=1), k=4, info=info)


def client(url: str, key: str | None = None, timeout: float = 60.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=timeout, trust_env=False)


class ThreadServer:
    """create_app(llm, **kw) served by uvicorn in a daemon thread."""

    def __init__(self, llm: LLM, **kw) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.app = create_app(llm, **kw)
        config = uvicorn.Config(self.app, host=HOST, port=self.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    @property
    def worker(self):
        return self.app.state.ctx.worker


class ProcessServer:
    """`specdecode serve ...` in a subprocess (what a user runs)."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        fd, self.log_path = tempfile.mkstemp(suffix=".log", prefix="specdecode-serve-")
        os.close(fd)
        self.cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--host", HOST,
                    "--port", str(self.port), "--log-level", "warning", *args]

    def __enter__(self) -> ProcessServer:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=env)
        # A load measures the cost curve where none is cached: ~170 s on a 2-core Zen 3,
        # whose noisy curves often fail the check that lets one be cached (costs.py).
        deadline = time.monotonic() + 420
        with httpx.Client(trust_env=False, timeout=2) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited:\n{self.output()}")
                try:
                    if c.get(f"{self.url}/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    output = self.output()  # before __exit__ removes the log
                    self.__exit__()
                    raise RuntimeError(f"the server did not start:\n{output}")
                time.sleep(0.25)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        Path(self.log_path).unlink(missing_ok=True)

    def output(self) -> str:
        return Path(self.log_path).read_text()

    def rss(self) -> int:
        """Resident memory of the server process, bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")
