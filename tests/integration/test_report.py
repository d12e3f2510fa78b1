"""The cycle report renders in a real browser: a tiny-model cycle, ``flywheel report``, then headless
Chromium (Debian ``chromium``, installed by ``.ci/run``) takes a screenshot, dumps the DOM after its
script ran, and logs the console. Asserted: every section and its chart is there, the page's script
ran (``data-ready``), nothing is fetched from the network, and the console is silent (a control page
with a deliberate error proves the console check can fail)."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
SECTIONS = ["summary", "failure-kinds", "training", "pass-rates", "gate", "lineage"]
CHARTED = ["failure-kinds", "training", "pass-rates", "lineage"]


def chromium(tmp: Path, url: str, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.skip("headless Chromium is not installed (Debian package `chromium`; .ci/run installs it)")
    tmp.mkdir(parents=True, exist_ok=True)
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
            f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr", "--v=0", *extra, url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def console_messages(stderr: str) -> list[str]:
    """Chromium logs every console message (any level) and uncaught exception as ``...:CONSOLE...``."""
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]


class Sections(HTMLParser):
    """For each <section id=...>: how many <svg> it holds; plus the <body> attributes."""

    def __init__(self):
        super().__init__()
        self.svgs: dict[str, int] = {}
        self.body: dict[str, str] = {}
        self.external: list[str] = []
        self._stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = {k: v or "" for k, v in a.items()}
        if tag == "section":
            self._stack.append(a.get("id", ""))
            self.svgs.setdefault(a.get("id", ""), 0)
        if tag == "svg" and self._stack:
            self.svgs[self._stack[-1]] += 1
        for k in ("src", "href"):
            if a.get(k) and re.match(r"(https?:)?//", a[k]):
                self.external.append(a[k])

    def handle_endtag(self, tag):
        if tag == "section" and self._stack:
            self._stack.pop()


@pytest.fixture(scope="module")
def report(tiny_cycle):
    """A tiny-model cycle, then ``flywheel report --json`` for the last completed cycle (both run
    once per session by ``tiny_cycle``, whose cycle test_cycle.py reads too)."""
    return tiny_cycle["result"], tiny_cycle["report"], tiny_cycle["root"]


def test_report_names_the_cycle_and_its_model(report):
    result, info, _ = report
    assert info["cycle"] == result["cycle"] and info["outcome"] == result["outcome"]
    model = result["stages"].get("grpo", {}).get("model_entity") or result["stages"]["sft"]["model_entity"]
    assert info["model"] == model
    assert info["traces"] > 0 and info["slices"] >= 1 and info["curves"]
    page = Path(info["path"]).read_text()
    assert f'data-cycle="{result["cycle"]}"' in page
    # Self-contained: no stylesheet, script, image or font is loaded from anywhere.
    assert not re.search(r"""(src|href)=["'](https?:)?//""", page)


def test_report_renders_in_headless_chromium(report, tmp_path):
    result, info, _ = report
    url = Path(info["path"]).absolute().as_uri()

    dom_run = chromium(tmp_path / "dom", url, "--dump-dom")
    assert dom_run.returncode == 0, dom_run.stderr[-3000:]
    parsed = Sections()
    parsed.feed(dom_run.stdout)
    assert parsed.body.get("data-ready") == "1", "the page's script did not run"
    assert parsed.body.get("data-cycle") == result["cycle"]
    for s in SECTIONS:
        assert s in parsed.svgs, f"section #{s} is missing from the rendered page"
    for s in CHARTED:
        assert parsed.svgs[s] >= 1, f"section #{s} has no chart"
    assert not parsed.external
    assert console_messages(dom_run.stderr) == [], "the report logged to the console"

    png = tmp_path / "report.png"
    shot = chromium(tmp_path / "shot", url, f"--screenshot={png}", "--window-size=1280,3000",
                    "--hide-scrollbars")
    assert shot.returncode == 0 and png.exists(), shot.stderr[-3000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1280, 3000)
    # A blank white page compresses to a few KB; charts, tables and text do not.
    assert len(data) > 40_000, f"the screenshot is suspiciously small ({len(data)} bytes): blank page?"
    assert console_messages(shot.stderr) == []


def test_console_check_catches_errors(tmp_path):
    """Control: a page with an uncaught error and a console.error is caught by the same check."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!doctype html><body><script>console.error("boom"); undefinedFunction();</script>'
                   '<script>document.body.dataset.ready = "1";</script></body>')
    run = chromium(tmp_path / "ctl", bad.as_uri(), "--dump-dom")
    msgs = console_messages(run.stderr)
    assert any("boom" in m for m in msgs) and any("Uncaught ReferenceError" in m for m in msgs), run.stderr[-2000:]
