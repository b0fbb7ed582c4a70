"""Screenshots of `pipec view` and `pipec serve` for docs/view.md, in headless Chromium at 1600x857:

    .venv/bin/python docs/img/view_shots.py [--prefix before-] [--only view-summary,...] [--measured run.json]

Each picture is one PNG under docs/img/ (the prefix lets a change keep its "before" pictures apart).
`--measured` takes the trace of a real run for view-measured (without it that picture is left as it is):

    pipec run 1f1b -D p=2 -D m=8 --model examples/mlp.py --nproc 2 --steps 3 --trace run.json"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))

import browser  # noqa: E402

from pipec.view.html import page, view_document  # noqa: E402

READY = "document.getElementById('pipec-view').dataset.ready === '1'"


def _open(chrome, doc) -> None:
    out = Path(tempfile.mkdtemp(prefix="pipec-shot-")) / "view.html"
    out.write_text(page(doc))
    chrome.get(out.as_uri())
    browser.wait_for(chrome, READY, timeout=120)
    time.sleep(0.3)


def _js(chrome, script: str) -> object:
    return chrome.execute_script(script)


def _set(chrome, css: str, value: str, event: str = "input") -> None:
    chrome.execute_script(
        "const e = document.querySelector(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event(arguments[2], {bubbles: true}))",
        css,
        value,
        event,
    )


def shots(chrome, prefix: str, only: set[str] | None, measured: str | None = None) -> list[Path]:
    img = ROOT / "docs" / "img"
    done = []

    def save(name: str) -> None:
        path = img / f"{prefix}{name}.png"
        chrome.save_screenshot(str(path))
        done.append(path)

    def want(name: str) -> bool:
        return only is None or name in only

    if want("view-summary"):  # a library schedule with its summary, and one op selected
        _open(chrome, view_document("zb-v", [("p", 4), ("m", 8)]))
        _js(chrome, "pipecView.select(0, pipecView.doc.panels[0].op_off[1] + 5)")
        time.sleep(0.2)
        save("view-summary")
    if want("view-graph"):  # a stage graph (U-Net's long skip 0 -> 3): a fan-in's F selected, its two inputs
        here = os.getcwd()
        try:
            os.chdir(ROOT)  # the selection names the source line by the path as given: a short relative one
            doc = view_document("examples/unet.pipe", [("p", 4), ("m", 8)])
        finally:
            os.chdir(here)
        _open(chrome, doc)
        i = _js(
            chrome,
            "const P = pipecView.doc.panels[0], O = P.ops; for (let i = 0; i < O.op.length; i++)"
            " if (O.stage[i] === 3 && O.mb[i] === 4 && pipecView.op[O.op[i]] === 'FWD') return i; return -1",
        )
        _js(chrome, f"pipecView.select(0, {i}); pipecView.setWindow(0, pipecView.full[1] * 0.62)")
        time.sleep(0.2)
        save("view-graph")
    if want("view-zoomed-out"):  # 50,000 ops zoomed out: the memory curves
        _open(chrome, view_document("1f1b", [("p", 8), ("m", 3125)]))
        save("view-zoomed-out")
    if want("view-deep-zoom"):  # deep zoom: the time axis's ticks
        _js(chrome, "const v = window.pipecView, f = v.full[1]; v.setWindow(f * 0.5, f * 0.5 + f * 2e-6)")
        time.sleep(0.2)
        save("view-deep-zoom")
    if want("view-dualpipe-pairs"):  # overlapped pairs, zoomed onto the steady state
        _open(chrome, view_document("dualpipe-v", [("p", 4), ("m", 8)]))
        _js(chrome, "const v = window.pipecView, f = v.full[1]; v.setWindow(f * 0.3, f * 0.75)")
        time.sleep(0.2)
        save("view-dualpipe-pairs")
    if want("view-offload"):  # the host link, both pools, the collective lane
        _open(chrome, view_document("1f1b-offload", []))
        save("view-offload")
    if want("view-compare"):  # two schedules on one time axis, the summary's deltas
        _open(chrome, view_document("zb-h1", [("p", 4), ("m", 6)], compare="1f1b"))
        save("view-compare")
    if want("view-measured") and measured:  # a real run over its simulation
        _open(chrome, view_document("1f1b", [("p", 2), ("m", 8)], measured=measured))
        save("view-measured")
    if want("view-deadlock"):  # a refused schedule, drawn with its wait cycle
        from deadlocks import DEADLOCK_1F1B

        here, where = os.getcwd(), Path(tempfile.mkdtemp(prefix="pipec-shot-"))
        (where / "1f1b-deadlock.pipe").write_text(DEADLOCK_1F1B)
        try:
            os.chdir(where)  # the diagnostic names the file as given: a short relative path
            doc = view_document("1f1b-deadlock.pipe")
        finally:
            os.chdir(here)
        _open(chrome, doc)
        save("view-deadlock")
    if want("serve-stale"):  # the playground; its compare mode; after a syntax error
        from pipec.view import serve

        srv = serve.start_in_thread("127.0.0.1", 0)
        try:
            base = f"http://127.0.0.1:{srv.server_address[1]}/"
            chrome.get(base + "?schedule=1f1b&p=4&m=8")
            browser.wait_for(chrome, "document.getElementById('makespan').dataset.value", timeout=60)
            time.sleep(0.5)
            save("serve-playground")
            chrome.find_element("css selector", "[data-role=pin]").click()  # pin p=4 m=8, then draw m=3 under it
            browser.wait_for(chrome, "window.pipecView && pipecView.doc.panels.length === 2", timeout=60)
            _set(chrome, "input[data-param=m]", "3")
            browser.wait_for(chrome, "pipecView.doc.panels.length === 2 && pipecView.doc.panels[1].maxMb === 2", 60)
            time.sleep(0.5)
            save("serve-compare")
            _set(chrome, "[data-role=compare]", "", "change")
            _set(chrome, "input[data-param=m]", "8")
            browser.wait_for(chrome, "pipecView.doc.panels.length === 1 && pipecView.doc.panels[0].maxMb === 7", 60)
            _js(
                chrome,
                "const e = document.getElementById('source'); e.value = e.value + '\\nstages = (';"
                "e.dispatchEvent(new Event('input', {bubbles: true}))",
            )
            browser.wait_for(chrome, "document.querySelector('[data-role=diag]')", timeout=30)
            time.sleep(0.5)
            save("serve-stale")
        finally:
            srv.shutdown()
            srv.server_close()
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", default="")
    ap.add_argument("--only", default=None)
    ap.add_argument("--measured", default=None, help="a run's trace for view-measured")
    args = ap.parse_args()
    chrome = browser.launch()
    chrome.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 1600, "height": 857, "deviceScaleFactor": 1, "mobile": False}
    )
    try:
        for p in shots(chrome, args.prefix, set(args.only.split(",")) if args.only else None, args.measured):
            print(p.relative_to(ROOT), p.stat().st_size)
    finally:
        browser.close(chrome)
    return 0


if __name__ == "__main__":
    sys.exit(main())
