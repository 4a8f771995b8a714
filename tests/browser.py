"""A real headless Chromium for tests of HTML pages, driven from its command line.

``--screenshot`` renders the page (the picture goes under the test's tmp_path; its path is
printed), ``--dump-dom`` gives the DOM once the page's scripts ran, and
``--enable-logging=stderr`` prints every console message as a ``:CONSOLE`` line. conveyor's pages
write nothing to the console, so any such line (an uncaught error above all) fails a test.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from subprocs import stop_group

CHROMIUM = next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))),
                None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium)")


def browse(page: Path, profile: Path, *args: str, fragment: str = "") -> tuple[str, list[str]]:
    """Open ``page`` in headless Chromium with ``args``: its stdout, and the console messages."""
    assert CHROMIUM is not None
    command = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr", "--v=0",
               f"--user-data-dir={profile}", "--no-first-run", *args, page.resolve().as_uri() + fragment]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its renderer and GPU processes go with it
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        stop_group(proc, timeout=10)
    return stdout, [line for line in stderr.splitlines() if ":CONSOLE" in line]


def rendered(page: Path, tmp_path: Path, fragment: str = "") -> str:
    """The page rendered (a screenshot under tmp_path, printed) and its DOM once its script ran;
    fails on any console message."""
    shot = tmp_path / f"{page.stem}.png"
    _, console = browse(page, tmp_path / "chromium", f"--screenshot={shot}", "--window-size=1400,900",
                        fragment=fragment)
    dom, more = browse(page, tmp_path / "chromium", "--dump-dom", fragment=fragment)
    print(f"screenshot of {page.name}: {shot}")
    assert console + more == [], "console messages:\n" + "\n".join(console + more)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
    assert 'data-ready="yes"' in dom, "the page's script did not run to its end"
    return dom


