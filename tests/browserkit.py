"""A real browser for tests: Debian's Chromium driven by Playwright for Python (`make setup` installs both; no
Playwright browser download). Pages are checked by what they show once their content is there, never by waiting
for the network to go idle (a chart may still be empty then)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

CHROMIUM = os.environ.get("DTRAIN_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = ["--no-sandbox"]  # Chromium refuses to run as root with its sandbox

# Every Plotly chart on the page: its traces' names and points (Plotly keeps them on the chart's element).
PLOTLY_TRACES = ("() => [...document.querySelectorAll('.js-plotly-plot')].flatMap(p => (p.data || []).map("
                 "t => ({name: t.name || '', x: Array.from(t.x || []), y: Array.from(t.y || [])})))")


def browser_missing() -> str | None:
    """Why a browser test cannot run here, or None."""
    if importlib.util.find_spec("playwright") is None:
        return "needs Playwright for Python (pip install playwright; make setup installs it)"
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        return f"needs Chromium at {CHROMIUM} (as root: apt-get install chromium; make setup installs it)"
    return None
