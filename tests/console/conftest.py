"""Fixtures of the console's browser tests: the fake LLM, a real Bedrock server and a
headless Chromium driven by Playwright.

Run through tests/console.sh, which builds the binaries and says where they are
(BEDROCK_BIN, FAKE_LLM_BIN). Every process here is started by these fixtures and stopped
by the pid they started; nothing else is signalled.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

# Generous waits: CI is a busy 2-core machine, and a wait ends as soon as its condition holds.
expect.set_options(timeout=20_000)

ROOT = Path(__file__).resolve().parents[2]
SHOTS = Path(os.environ.get("CONSOLE_SCREENSHOTS", ROOT / "target" / "console-screenshots"))
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

# Models whose small windows put the context meter in its warning colours: every fake
# answer counts 100 prompt + 10 completion tokens.
CONFIG = """
[models."warn-window"]
context_window = 130

[models."danger-window"]
context_window = 112
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, key=None, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, (json.loads(raw) if raw else None)


class FakeLlm:
    def __init__(self, work):
        self.out = open(work / "llm.out", "w+")
        self.proc = subprocess.Popen([os.environ["FAKE_LLM_BIN"], "--follow"], stdout=self.out)
        for _ in range(200):
            self.out.seek(0)
            line = self.out.readline().strip()
            if line:
                self.base_url = line
                return
            time.sleep(0.05)
        raise RuntimeError("the fake LLM did not print its URL")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=10)


class Server:
    """`bedrock serve` on a fixed port and database, so that it can be restarted."""

    def __init__(self, work, llm_url, auth="required"):
        self.work = work
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        work.mkdir(parents=True, exist_ok=True)
        (work / "config.toml").write_text(CONFIG)
        self.env = dict(
            os.environ,
            BEDROCK_LISTEN=f"127.0.0.1:{self.port}",
            BEDROCK_METRICS__LISTEN="off",
            BEDROCK_DATABASE_URL=f"sqlite://{work}/bedrock.db?mode=rwc",
            BEDROCK_DATA_DIR=str(work / "data"),
            BEDROCK_WORKSPACE_ROOT=str(work / "ws"),
            BEDROCK_LLM_BASE_URL=llm_url,
            BEDROCK_LLM_API_KEY="fake",
            BEDROCK_AUTH=auth,
        )
        self.proc = None
        self.log = open(work / "server.log", "a")

    def bedrock(self, *args):
        return subprocess.run(
            [os.environ["BEDROCK_BIN"], "--config", str(self.work / "config.toml"), *args],
            env=self.env, capture_output=True, text=True, check=True,
        ).stdout

    def start(self):
        self.proc = subprocess.Popen(
            [os.environ["BEDROCK_BIN"], "--config", str(self.work / "config.toml"), "serve"],
            env=self.env, stdout=self.log, stderr=self.log,
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.work}/server.log")
            try:
                if http("GET", f"{self.url}/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the server did not become ready")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self):
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def work():
    path = Path(tempfile.mkdtemp(prefix="bedrock-console-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def llm(work):
    fake = FakeLlm(work)
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def server(work, llm):
    srv = Server(work / "required", llm.base_url)
    srv.key = json.loads(srv.bedrock("tenant", "create", "console-tests"))["api_key"]
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        )
        yield b
        b.close()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(15_000)
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    SHOTS.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)
    pg.screenshot(path=str(SHOTS / f"{name}.png"))
    context.close()
    assert not errors, f"the page threw: {errors}"


def sign_in(page, server):
    page.goto(server.url + "/")
    page.get_by_label("API key").fill(server.key)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", name="Conversations").wait_for()


def create_conversation(page, **fields):
    """Creates a conversation with the form; returns its id once its page is open and its
    live stream is up."""
    before = page.evaluate("location.hash")
    page.get_by_text("New conversation", exact=True).click()
    labels = {"slug": "Name", "cwd": "Working directory", "model": "Model", "system_prompt": "System prompt"}
    for field, value in fields.items():
        page.get_by_label(labels[field]).fill(value)
    page.get_by_role("button", name="Create", exact=True).click()
    page.wait_for_function("(before) => location.hash.startsWith('#/c/') && location.hash !== before", arg=before)
    conv = page.evaluate("decodeURIComponent(location.hash.slice(4))")
    open_conversation(page, conv)
    return conv


def open_conversation(page, conv):
    """Waits until conversation `conv`'s page shows and its live stream is up."""
    page.locator(f"#chat-title[title='{conv}']").wait_for()
    page.locator("#chat[data-live]").wait_for(state="attached")


def send(page, text):
    box = page.get_by_label("Message")
    box.fill(text)
    box.press("Enter")
