"""The playground at `/`: behind the API key like every route but /health, driven in headless Chromium.

The browser test needs Debian's Chromium at /usr/bin/chromium (`apt-get install chromium`); it skips only
when that binary is missing. Playwright never downloads a browser here: it launches that binary.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.server.procs import ServeProcess

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
API_KEY = "playground-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ABORTED = 'tandem_request_success_total{finished_reason="abort"}'
# The page writes "... finish: <reason>" under the chat when a reply ends (and clears it when one starts).
FINISHED = "document.getElementById('stats-last').textContent.includes('finish:')"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def metric(self, name: str) -> float:
        """One sample of /metrics by its exact text name (labels included)."""
        for line in httpx.get(f"{self.url}/metrics", headers=AUTH, timeout=30).text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} missing from /metrics")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`python -m tandem serve` with the embedded model and an API key, as a subprocess."""
    serve = ServeProcess(str(tmp_path_factory.mktemp("playground") / "server.log"), "--api-key", API_KEY,
                         log_level="warning", module="tandem")
    try:
        serve.wait_healthy(timeout_s=180)
        yield Server(serve.url, serve.proc, serve.log.name)
    finally:
        serve.proc.terminate()
        try:
            serve.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        serve.close()


def test_page_and_static_files_need_the_key(server: Server):
    # Without the key: 401 with a Basic challenge, so a browser asks for it (any user name, the key as password).
    for path in ("/", "/static/playground.js", "/v1/models", "/metrics"):
        r = httpx.get(f"{server.url}{path}", timeout=30)
        assert r.status_code == 401 and "Basic" in r.headers["www-authenticate"], path
    basic = httpx.BasicAuth("tandem", API_KEY)
    page = httpx.get(f"{server.url}/", auth=basic, timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/playground.js">' in page.text
    for name, kind in (("playground.js", "javascript"), ("playground.css", "text/css")):
        r = httpx.get(f"{server.url}/static/{name}", headers=AUTH, timeout=30)
        assert r.status_code == 200 and kind in r.headers["content-type"], name
    assert httpx.get(f"{server.url}/static/nope.js", headers=AUTH, timeout=30).status_code == 404
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (install Debian's: apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # launch() gives a fresh temporary profile; Playwright's own browser download is never used.
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def test_chat_in_browser(server: Server, browser, tmp_path):
    # The browser answers the server's Basic challenge with the key (a person types it into the browser's
    # prompt); the page's own requests then carry it too.
    context = browser.new_context(viewport={"width": 1100, "height": 720},
                                  http_credentials={"username": "tandem", "password": API_KEY})
    page = context.new_page()
    page.set_default_timeout(120_000)
    try:
        page.goto(server.url + "/")
        page.wait_for_function("document.getElementById('model-name').textContent === 'SmolLM2-135M-Instruct'")
        assert page.is_hidden("#error")

        # 1. A reply streams in: the text is seen at two or more different non-empty lengths, then finishes.
        page.fill("#system", "You are a helpful assistant.")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "24")
        page.evaluate("""() => {
            window.lengths = [];
            new MutationObserver(() => {
                const c = document.querySelector('.msg.assistant:last-child .content');
                if (c) window.lengths.push(c.textContent.length);
            }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
        }""")
        page.fill("#input", "Write a short poem about the sea.")
        page.click("#send")
        page.wait_for_function(FINISHED)
        lengths = page.evaluate("window.lengths")
        assert len({n for n in lengths if n > 0}) >= 2, f"the reply did not stream: lengths {lengths}"
        reply = page.text_content(".msg.assistant .content")
        assert reply and reply.strip()
        stats = page.text_content("#stats-last")
        assert "TTFT" in stats and "tok/s" in stats, stats
        assert page.is_visible("#send") and page.is_enabled("#regenerate")
        page.wait_for_function("document.getElementById('server-running').textContent === '0'")
        page.screenshot(path=str(tmp_path / "playground.png"))

        # 2. Regenerate with the same greedy settings gives the same reply in place of the last one.
        page.evaluate("document.getElementById('stats-last').textContent = ''")
        page.click("#regenerate")
        page.wait_for_function(FINISHED)
        assert page.locator(".msg.assistant").count() == 1
        assert page.text_content(".msg.assistant .content") == reply

        # 3. Stop mid-stream: the connection closes and the server aborts the request.
        aborted_before = server.metric(ABORTED)
        page.click("#clear")
        page.fill("#max-tokens", "200")
        page.fill("#input", "Count from 1 to 500, one number per line.")
        page.click("#send")
        page.wait_for_function(
            "(document.querySelector('.msg.assistant .content') || {}).textContent?.length > 0")
        page.click("#stop")
        page.wait_for_selector(".msg.assistant .note")
        assert page.text_content(".msg.assistant .note") == "(stopped)"
        assert "finish: stopped" in page.text_content("#stats-last")
        deadline = time.monotonic() + 60
        while server.metric(ABORTED) < aborted_before + 1:
            assert time.monotonic() < deadline, "the server did not abort the stopped request:\n" + server.log()
            time.sleep(0.2)
        assert server.metric(ABORTED) == aborted_before + 1
        # The engine's own counts reach /metrics a moment later (they come from the engine process).
        while server.metric("tandem_num_requests_running") != 0:
            assert time.monotonic() < deadline, "the aborted request still runs in the engine:\n" + server.log()
            time.sleep(0.2)

        # 4. A bad setting: the server's error message appears in the page verbatim.
        page.fill("#temperature", "-1")
        page.fill("#input", "Hello")
        page.click("#send")
        page.wait_for_selector("#error", state="visible")
        body = {"messages": [{"role": "user", "content": "Hello"}], "temperature": -1, "max_tokens": 8}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60,
                       headers=AUTH)
        assert r.status_code == 400
        assert page.text_content("#error") == r.json()["error"]["message"]
        assert "temperature" in page.text_content("#error")

        # 5. A phone-sized screen: one column, settings behind a button.
        page.set_viewport_size({"width": 390, "height": 800})
        assert page.is_visible("#toggle-settings")
        if page.is_visible("#settings"):  # still open from the API-key prompt at the start
            page.click("#toggle-settings")
        assert page.is_hidden("#settings")
        page.click("#toggle-settings")
        assert page.is_visible("#temperature")
        page.screenshot(path=str(tmp_path / "playground_phone.png"))
    finally:
        context.close()
    print(json.dumps({"screenshots": str(tmp_path)}))
