"""The chat page at `/` in headless Chromium, driven over the DevTools protocol on a pipe: it streams the same
reply the API gives, and its stop button cancels the request in the server."""

import json
import os
import shutil
import subprocess
import time

import httpx
import pytest

from tests.serve.conftest import metric

CHROMIUM = next((p for p in map(shutil.which, ["chromium", "chromium-browser", "google-chrome"]) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get "
                                                         "install chromium); the page's HTML is checked in test_api")


class Browser:
    """Chromium with --remote-debugging-pipe: commands on fd 3, replies on fd 4, NUL-separated JSON."""

    def __init__(self, profile):
        cmd_r, self.cmd_w = os.pipe()
        self.res_r, res_w = os.pipe()

        # The shell moves the pipe ends to fds 3 and 4 (no preexec_fn: forking a JAX process from Python is unsafe).
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" 3<&{cmd_r} 4>&{res_w}', CHROMIUM, "--headless",
                                      "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-pipe",
                                      f"--user-data-dir={profile}", "about:blank"],
                                     pass_fds=(cmd_r, res_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(res_w)
        self.buf, self.n, self.session = b"", 0, None

    def call(self, method, params=None, session=True):
        self.n += 1
        msg = {"id": self.n, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" in self.buf:
                raw, self.buf = self.buf.split(b"\0", 1)
                m = json.loads(raw)
                if m.get("id") == self.n:
                    if "error" in m:
                        raise RuntimeError(m["error"])
                    return m["result"]
            chunk = os.read(self.res_r, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self.buf += chunk

    def open(self, url):
        target = self.call("Target.createTarget", {"url": url}, session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]

    def js(self, expr):
        return self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True})["result"].get("value")

    def wait(self, expr, timeout=30):
        deadline = time.monotonic() + timeout
        while not self.js(expr):
            assert time.monotonic() < deadline, f"timed out waiting for {expr}"
            time.sleep(0.02)

    def close(self):
        self.proc.kill()
        self.proc.wait()
        os.close(self.cmd_w)
        os.close(self.res_r)


@pytest.fixture
def browser(tmp_path):
    b = Browser(tmp_path / "profile")
    yield b
    b.close()


def api_reply(server, prompt, max_tokens):
    r = httpx.post(f"{server.base}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0})
    choice = r.json()["choices"][0]
    return choice["message"]["content"] or "", choice["finish_reason"]


STATE = "document.body.dataset.state"
CONTENT = "(document.querySelector('.assistant .content') || {}).textContent"


def test_page_streams_the_api_reply(server, browser):
    want, _ = api_reply(server, "Hello there", 24)
    browser.open(f"{server.base}/?prompt=Hello%20there&send=1&temperature=0&max_tokens=24")
    browser.wait(f"['done', 'error'].includes({STATE})")
    assert browser.js(STATE) == "done", browser.js("document.getElementById('status').textContent")
    assert browser.js(CONTENT) == want
    assert browser.js("document.querySelector('.user').textContent") == "Hello there"


def test_stop_button_cancels_the_request(server, browser):
    # A reply that runs the whole 200 tokens (~1 s here), so that the click lands mid-stream.
    prompt = next(p for p in (f"Story {i}" for i in range(10, 40)) if api_reply(server, p, 200)[1] == "length")
    full, _ = api_reply(server, prompt, 200)
    aborted = metric(server.base, "fnx_requests_finished_total", 'reason="abort"')
    browser.open(f"{server.base}/?prompt={prompt.replace(' ', '%20')}&send=1&temperature=0&max_tokens=200")
    browser.wait(f"{STATE} === 'streaming' && ({CONTENT} || '').length > 0")
    browser.js("document.getElementById('stop').click()")
    browser.wait(f"{STATE} !== 'streaming'")
    assert browser.js(STATE) == "stopped"
    shown = browser.js(CONTENT)
    assert full.startswith(shown) and len(shown) < len(full)
    deadline = time.monotonic() + 10
    while metric(server.base, "fnx_requests_finished_total", 'reason="abort"') < aborted + 1:
        assert time.monotonic() < deadline, "the server did not cancel the request"
        time.sleep(0.05)
