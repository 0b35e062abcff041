"""Serve tests run against the real server (`python -m fnx.serve`) in a subprocess on a free port. One server is
shared by the whole session (start-up compiles dominate the run time); tests that change its settings or stop it
start their own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT
from tests.serve.checkpoint import write_serve_checkpoint

SLOTS, CAPACITY, CHUNK, CHUNK_IDLE = 8, 256, 32, 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, checkpoint: Path, log_path: Path, cache_dir: Path, *args: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                   JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fnx.serve", "--model", str(checkpoint), "--port", str(self.port),
             "--dtype", "float32", "--log-level", "warning", *args],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not come up:\n{self.output()}")
            time.sleep(0.25)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def serve_checkpoint(tmp_path_factory) -> Path:
    return write_serve_checkpoint(tmp_path_factory.mktemp("serve") / "tiny-serve")


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jax-cache")


@pytest.fixture(scope="session")
def server(serve_checkpoint, jax_cache, tmp_path_factory):
    s = Server(serve_checkpoint, tmp_path_factory.mktemp("logs") / "server.log", jax_cache,
               "--max-slots", str(SLOTS), "--capacity", str(CAPACITY), "--prefill-chunk", str(CHUNK),
               "--prefill-chunk-idle", str(CHUNK_IDLE), "--max-queue", "64")
    yield s
    s.stop()


def metric(base: str, name: str, labels: str = "") -> float:
    """One sample of /metrics (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0
