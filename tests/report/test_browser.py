"""The report opens in headless Chromium without a network, without errors, and shows its charts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def test_report_renders_in_headless_chromium(plan_report: Path) -> None:
    browser = _browser()
    if browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the browser test: no chromium found (.ci/run installs Debian's chromium)")
        pytest.skip("no Chromium on this machine (apt-get install chromium); CI=true makes this a failure")
    command = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--enable-logging=stderr",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # no network: anything the page fetched would fail
        "--virtual-time-budget=5000",
        "--dump-dom",
        plan_report.resolve().as_uri(),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", result.stdout)
    assert body, result.stdout[:500]
    assert 'data-charts-rendered="4"' in body.group(1), body.group(1)
    assert "data-errors" not in body.group(1), body.group(1)
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
