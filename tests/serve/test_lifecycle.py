"""Start-up, the bounded queue (429), and graceful shutdown on SIGTERM, on a server of its own (1 slot, 1 queued,
the n-gram table kept on the host: `--ple-store pageable`)."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from fnx.serve.server import DEFAULT_MODEL, IDLE_CHUNK_GPU, idle_chunk, parse_args
from tests.conftest import ROOT
from tests.serve.conftest import Server

MODEL = "tiny-serve"
LONG = {"model": MODEL, "prompt": "Hello", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}


def test_help_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "fnx.serve", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0
    parser_opts = [a for a in vars(parse_args([]))]
    for opt in parser_opts:
        assert "--" + opt.replace("_", "-") in out.stdout, opt
    for needed in ["--model", "--host", "--port", "--max-slots", "--capacity", "--speculative", "--dtype"]:
        assert needed in out.stdout


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    if DEFAULT_MODEL.exists():
        args = ["--model", str(tmp_path / "missing")]
        expect = [str(tmp_path / "missing"), "config.json"]
    else:
        args, expect = [], [str(DEFAULT_MODEL), "--model"]
    out = subprocess.run([sys.executable, "-m", "fnx.serve", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    for s in expect:
        assert s in out.stderr


def test_idle_prefill_budget_below_the_chunk_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "fnx.serve", "--prefill-chunk", "64", "--prefill-chunk-idle", "32"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 2
    assert "--prefill-chunk-idle (32) must be at least --prefill-chunk (64)" in out.stderr


def test_idle_prefill_budget_default():
    """Unset, the idle budget is IDLE_CHUNK_GPU on a GPU (at most the capacity, never below the chunk) and the chunk
    on the CPU; a value given is kept."""
    assert idle_chunk(None, 512, 8192, "gpu") == IDLE_CHUNK_GPU == 2048
    assert idle_chunk(None, 512, 1000, "gpu") == 1000
    assert idle_chunk(None, 4096, 8192, "gpu") == 4096
    assert idle_chunk(None, 512, 8192, "cpu") == 512
    assert idle_chunk(1024, 512, 8192, "gpu") == 1024 and idle_chunk(1024, 512, 8192, "cpu") == 1024


def test_unusable_compile_cache_is_a_clear_error(tmp_path):
    if not DEFAULT_MODEL.exists():
        pytest.skip("needs the embedded checkpoint")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = subprocess.run([sys.executable, "-m", "fnx.serve", "--compile-cache", str(blocker / "jax")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 2
    assert "--compile-cache" in out.stderr and "without it" in out.stderr


def test_uva_ple_store_without_a_gpu_is_a_clear_error():
    """--ple-store uva reads the table from pinned host memory in a CUDA kernel: on a CPU the server exits at load
    with the reason and the modes that work, before listening."""
    if not DEFAULT_MODEL.exists():
        pytest.skip("needs the embedded checkpoint")
    out = subprocess.run([sys.executable, "-m", "fnx.serve", "--ple-store", "uva"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 2
    assert "uva" in out.stderr and "cannot run here" in out.stderr and "pageable" in out.stderr


@pytest.fixture(scope="module")
def small(serve_checkpoint, jax_cache, tmp_path_factory):
    s = Server(serve_checkpoint, tmp_path_factory.mktemp("logs") / "small.log", jax_cache,
               "--max-slots", "1", "--max-queue", "1", "--capacity", "1024", "--prefill-chunk", "16",
               "--shutdown-timeout", "20", "--ple-store", "pageable", "--ple-deadline-ms", "2000",
               "--layers", "stacked", "--ple-fetch", "pipeline")
    yield s
    s.stop()


def first_event(lines):
    """The first SSE event from a response's line iterator (kept by the caller: dropping a half-read httpx
    iterator closes the connection, which the server rightly takes as a client that went away)."""
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])


def test_host_ple_store_serves(small):
    """The table stays in a read-only mmap of the checkpoint's shards; requests are served from its rows, here
    with the stacked layout (the default on a GPU) and the step split at the PLE layer while a host thread fetches
    the rows (pipeline)."""
    assert "PLE table: pageable (pipeline)" in small.output()
    assert "layers stacked" in small.output()
    assert "input projections fused" in small.output()
    r = httpx.post(f"{small.base}/v1/completions", json=dict(LONG, stream=False, max_tokens=3), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_queue_full_gets_429(small):
    with httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b:
        with a.stream("POST", f"{small.base}/v1/completions", json=LONG) as r1:
            lines1 = r1.iter_lines()
            assert r1.status_code == 200 and first_event(lines1)     # holds the slot
            with b.stream("POST", f"{small.base}/v1/completions", json=LONG) as r2:
                assert r2.status_code == 200                     # accepted: waits in the queue
                r3 = httpx.post(f"{small.base}/v1/completions", json=dict(LONG, stream=False), timeout=30)
                assert r3.status_code == 429
                err = r3.json()["error"]
                assert err["code"] == "queue_full" and err["type"] == "rate_limit_error" and "retry" in err["message"]
    deadline = time.monotonic() + 20
    while httpx.get(f"{small.base}/health").json()["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # n = 3 choices where one slot and one queue place hold two: refused whole, the two queued choices cancelled
    r = httpx.post(f"{small.base}/v1/completions", json=dict(LONG, stream=False, n=3), timeout=30)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    while httpx.get(f"{small.base}/health").json()["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.post(f"{small.base}/v1/completions", json=dict(LONG, stream=False, max_tokens=2, n=2), timeout=30)
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_sigterm_finishes_running_requests_and_exits_0(small):
    with httpx.stream("POST", f"{small.base}/v1/completions", json=LONG, timeout=60) as r:
        lines = r.iter_lines()
        assert first_event(lines)
        small.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = None
        try:
            refused = httpx.post(f"{small.base}/v1/completions", json=dict(LONG, stream=False), timeout=5)
        except httpx.HTTPError:
            pass                                                  # the listening socket is already closed
        assert refused is None or refused.status_code == 503
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"   # ran to its end
    assert small.proc.wait(30) == 0
    assert "stopped" in small.output()


def test_ple_fetch_auto_takes_the_in_step_path_on_cuda():
    """--ple-fetch auto (the default): on a CUDA GPU a host table is served through the ring (the fastest measured
    on the H200; a pinned table read in place, as uva), elsewhere fetched before each step; every variant stays
    selectable by name, and options that do not apply are refused with the reason."""
    from fnx.serve.server import ple_plan
    assert ple_plan("device", "auto", "fail", None, cuda=True) == ("device", None, "sync")
    assert ple_plan("pageable", "auto", "degrade", 5.0, cuda=True) == (
        "ring", {"policy": "degrade", "deadline_s": 0.005, "backing": "pageable"}, "sync")
    assert ple_plan("direct", "auto", "fail", None, cuda=True)[0:2] == (
        "ring", {"policy": "fail", "deadline_s": None, "backing": "direct"})
    assert ple_plan("pinned", "auto", "fail", None, cuda=True)[0] == "uva"
    assert ple_plan("pageable", "auto", "fail", None, cuda=False) == (
        "pageable", {"policy": "fail", "deadline_s": None}, "sync")
    assert ple_plan("pageable", "pipeline", "fail", None, cuda=True)[::2] == ("pageable", "pipeline")
    assert ple_plan("ring", "auto", "fail", None, cuda=False)[0] == "ring"
    assert "apply to a host" in ple_plan("uva", "sync", "fail", None, cuda=True)
    assert "fetches inside each step" in ple_plan("ring", "split", "fail", None, cuda=True)
