"""The Chromium every browser test of the viewer drives (tests/support/browser.py: Debian's chromium through
WebDriver), one per test module. A module sets `WINDOW = (width, height)` for the window its pictures and
geometry assume; without one the browser's default."""

from __future__ import annotations

import browser
import pytest


@pytest.fixture(scope="module")
def chrome(request):
    d = browser.launch()
    size = getattr(request.module, "WINDOW", None)
    if size is not None:
        d.set_window_size(*size)
    yield d
    browser.close(d)
