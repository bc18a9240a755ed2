"""Headless Chromium (Debian's `chromium` package) for tests of HTML pages.

Each call starts a fresh browser with its own temporary profile directory,
waits for it in its own process group, and removes the profile and kills the
group whatever happens, so no browser process or directory is left behind.

    python -m tests.chromium screenshot PAGE.html OUT.png [WIDTHxHEIGHT]
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",  # as root; the page is our own file
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
]


def chromium_path() -> str:
    path = shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    if path is None:
        raise RuntimeError("chromium is not installed: run `make setup-host` (apt-get install chromium)")
    return path


def _run(args: list[str], *, timeout_s: float) -> str:
    profile = tempfile.mkdtemp(prefix="prorl-chromium-")
    try:
        process = subprocess.Popen(
            [chromium_path(), *FLAGS, f"--user-data-dir={profile}", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: renderers and helpers die with it
        )
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if process.returncode not in (0, -signal.SIGKILL):
            raise RuntimeError(f"chromium exited with {process.returncode}: {stderr[-2000:]}")
        return stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def dump_dom(page: Path, *, timeout_s: float = 60) -> str:
    """The page's DOM after its scripts ran on load."""
    return _run(["--dump-dom", page.absolute().as_uri()], timeout_s=timeout_s)


def screenshot(page: Path, out: Path, *, width: int = 1440, height: int = 1000, timeout_s: float = 60) -> None:
    out.unlink(missing_ok=True)
    _run(
        [f"--screenshot={out.absolute()}", f"--window-size={width},{height}", page.absolute().as_uri()],
        timeout_s=timeout_s,
    )
    if not out.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {out}")


def check_page(page: Path, *, rollouts: int, tokens: bool = True) -> str:
    """The page as Chromium shows it after its script ran: list, first rollout selected, the others hidden."""
    dom = dump_dom(page)
    assert dom.count('<tr class="row') == rollouts
    assert len(re.findall(r'<tr class="row selected"', dom)) == 1
    assert len(re.findall(r'<section class="rollout" id="r\d+" data-idx="\d+" hidden="">', dom)) == rollouts - 1
    assert 'class="msg msg-assistant"' in dom and 'class="msg msg-user"' in dom and 'class="wf-bar wf-model' in dom
    if tokens:  # sampled tokens shaded by log-prob, prompt and tool tokens grey, each with its hover text
        assert re.search(r'<span class="tok m1" data-id="\d+" data-lp="-?[\d.]+" style="background:hsl\(', dom)
        assert re.search(r'<span class="tok m0" data-id="\d+" data-lp="[-\d.]+" title="id \d+ · ', dom)
    return dom


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5) or sys.argv[1] != "screenshot":
        sys.exit(__doc__)
    size = sys.argv[4] if len(sys.argv) == 5 else "1440x1000"
    w, h = (int(x) for x in size.split("x"))
    screenshot(Path(sys.argv[2]), Path(sys.argv[3]), width=w, height=h)
