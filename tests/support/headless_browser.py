"""A real browser for the live view's test, its screenshot and its cost benchmark: Debian's
chromium, headless, driven over its DevTools protocol (a websocket, websocket-client).

    with HeadlessBrowser("http://127.0.0.1:8080/") as browser:
        browser.evaluate("document.title")
        browser.screenshot("docs/live-view.png")

Playwright would want its own browser download; this uses whichever chromium the system has
(`apt-get install chromium`): `find_chromium()` says None where there is none.
"""
from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import websocket  # websocket-client

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    return next((path for name in NAMES if (path := shutil.which(name))), None)


class HeadlessBrowser:
    """One headless chromium with one page open at `url`."""

    def __init__(self, url: str, width: int = 1100, height: int = 720, timeout_s: float = 30.0):
        binary = find_chromium()
        if binary is None:
            raise RuntimeError(f"no chromium on PATH (looked for {', '.join(NAMES)}): apt-get install chromium")
        self.profile = Path(tempfile.mkdtemp(prefix="edgemm-chromium-"))
        # --no-sandbox: CI and this machine run as root, where chromium's sandbox refuses to start
        self.process = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--disable-background-networking", "--mute-audio", f"--user-data-dir={self.profile}",
             "--remote-debugging-port=0", f"--window-size={width},{height}", url],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # its own process group: close() ends the renderers and helpers too
        self._ids = itertools.count(1)
        try:
            port = self._debugging_port(timeout_s)
            self.socket = websocket.create_connection(self._page_socket(port, url, timeout_s), timeout=timeout_s,
                                                      suppress_origin=True)
            self._wait_loaded(timeout_s)
        except BaseException:
            self.close()
            raise

    def _debugging_port(self, timeout_s: float) -> int:
        """chromium writes the port it chose to DevToolsActivePort in its profile."""
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode} before it listened")
            if marker.exists() and (lines := marker.read_text().split()):
                return int(lines[0])
            time.sleep(0.05)
        raise RuntimeError(f"chromium did not open its DevTools port within {timeout_s:g} s")

    @staticmethod
    def _page_socket(port: int, url: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout_s) as response:
                pages = [t for t in json.load(response) if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.05)
        raise RuntimeError(f"chromium opened no page for {url}")

    def _wait_loaded(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.evaluate("location.href !== 'about:blank' && document.readyState === 'complete'"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the page did not load within {timeout_s:g} s")
            time.sleep(0.05)

    def call(self, method: str, **params) -> dict:
        """One DevTools command; its result (events that come meanwhile are skipped)."""
        call_id = next(self._ids)
        self.socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-able values)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:60]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def screenshot(self, path: str | Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        socket = getattr(self, "socket", None)
        if socket is not None:
            socket.close()
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "HeadlessBrowser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
