"""How `pipec view` scales: a million-op schedule's file (size, time to build and write it) and, in headless
Chromium, the time to first paint and to redraw after a pan and a zoom (measured in the page with
performance.now). Prints one JSON line per figure, each with the load average (the machine is shared).

    python benchmarks/view_scale.py [--schedule 1f1b] [-D p=8] [-D m=62500] [--no-browser]
    python benchmarks/view_scale.py --wide    # 1f1b p=10000 m=8: 160,000 ops over ten thousand ranks
    python benchmarks/view_scale.py --playground [--reps 3]  # the same in `pipec serve`: open the page to drawn
    python benchmarks/view_scale.py --smoke   # p=2 m=8 (the browser part where Chromium is installed; tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import sidebyside


def emit(**fields: object) -> None:
    sidebyside.emit({"benchmark": "view_scale", **fields})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("-D", dest="defines", action="append", default=[])
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--wide", action="store_true", help="a wide pipeline: 1f1b p=10000 m=8")
    ap.add_argument(
        "--playground", action="store_true", help="pipec serve: open the page at the schedule and wait until drawn"
    )
    ap.add_argument("--reps", type=int, default=3, help="rounds of the playground case (medians)")
    sidebyside.smoke_flag(ap)
    args = ap.parse_args()
    defines = [tuple(d.split("=", 1)) for d in args.defines] or [("p", "8"), ("m", "62500")]
    if args.wide or (args.playground and not args.defines):
        defines = [("p", "10000"), ("m", "8")]
    if args.smoke:  # p=2 m=8; the browser part only where Chromium is installed: the format (tests)
        defines = [("p", "2"), ("m", "8")]
    if args.playground:
        return playground(args.schedule, defines, max(1, args.reps), args.smoke)

    from pipec.view.html import op_count, page, view_document

    t = time.perf_counter()
    doc = view_document(args.schedule, defines)
    built = time.perf_counter() - t
    t = time.perf_counter()
    text = page(doc)
    out = Path(tempfile.mkdtemp(prefix="pipec-view-")) / "view.html"
    out.write_text(text)
    written = time.perf_counter() - t
    n, size = op_count(doc), len(text.encode())
    emit(
        figure="file",
        schedule=args.schedule,
        params=dict(defines),
        ops=n,
        bytes=size,
        bytes_per_op=round(size / n, 2),
        build_s=round(built, 2),
        write_s=round(written, 2),
    )
    if args.no_browser:
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    import browser

    if args.smoke and browser._missing():
        print(f"view_scale --smoke: no browser part ({browser._missing()})", file=sys.stderr)
        return 0

    chrome = browser.launch()
    try:
        t = time.perf_counter()
        chrome.get(out.as_uri())
        browser.wait_for(chrome, "document.getElementById('pipec-view').dataset.ready === '1'", timeout=120)
        wall = time.perf_counter() - t
        in_page = chrome.execute_script("return window.pipecLoadMs")
        first = chrome.execute_script("return performance.now()")  # since navigation start
        emit(
            figure="first_paint",
            ops=n,
            wall_s=round(wall, 2),
            page_ms=round(first, 1),
            decode_and_draw_ms=round(in_page, 1),
            errors=len(browser.console_errors(chrome)),
        )
        draws = chrome.execute_script(
            """
            const v = pipecView, full = v.full[1] - v.full[0], out = {};
            const time = (f) => { const t = performance.now(); f(); return performance.now() - t; };
            out.full_ms = time(() => v.setWindow(v.full[0], v.full[1]));
            const pans = [];
            for (let k = 1; k <= 10; k++) pans.push(time(() => v.setWindow(full * 0.05 * k, full * (0.05 * k + 0.5))));
            out.pan_ms = pans.reduce((a, b) => a + b) / pans.length;
            out.pan_max_ms = Math.max(...pans);
            out.zoom_in_ms = time(() => v.setWindow(full * 0.4, full * 0.4001));
            out.zoom_mid_ms = time(() => v.setWindow(full * 0.4, full * 0.45));
            out.zoom_out_ms = time(() => v.setWindow(v.full[0], v.full[1]));
            const P = v.doc.panels[0];  // a selection (its index is built on the first) and a scroll to the last rank
            out.select_ms = time(() => { v.select(0, P.op_off[1] + 1); v.draw(); });
            out.scroll_last_rank_ms = time(() => v.scrollToRank(0, P.ranks - 1));
            out.rows_drawn = v.shown.length;
            return out;
            """
        )
        emit(figure="redraw", ops=n, **{k: round(v, 1) for k, v in draws.items()})
    finally:
        browser.close(chrome)
    return 0


def playground(schedule: str, defines: list[tuple[str, str]], reps: int, smoke: bool) -> int:
    """`pipec serve` with the schedule: per round, the server's answer built in this process (parse, check,
    compile, simulate, the document; nothing kept from an earlier round), then a cost edit's answer (F
    changed: the compiled target kept, pipec.view.serve `CACHE`) and, in headless Chromium, the page opened
    at ?schedule=...&p=... until the picture is drawn (wall, from `get`: the page, the library's text, the
    request, the answer, inflating and drawing; the server's kept targets cleared first, so each round is a
    first visit). Medians over the rounds, each round's figures too."""
    import json
    from urllib.parse import urlencode

    from pipec.frontend import library
    from pipec.view import serve

    body = {"source": library.read(schedule).text, "params": dict(defines), "costs": {}}
    builds, edits, sizes = [], [], []
    for k in range(reps):
        serve.clear_cache()  # cold: parse, check, compile, simulate, the document
        t = time.perf_counter()
        answer = serve.simulate(body)
        builds.append(time.perf_counter() - t)
        sizes.append(len(json.dumps(answer, separators=(",", ":"))))
        t = time.perf_counter()  # a cost edit: the compiled target kept, only the simulation and the document
        edited = serve.simulate({**body, "costs": {"F": str(1.5 + k)}})
        edits.append(time.perf_counter() - t)
        if edited.get("ok") != answer.get("ok"):
            emit(figure="playground_build", error="a cost edit's answer differs in kind from the cold one's")
            return 1
    ops = int(answer.get("ops") or 0)
    emit(
        figure="playground_build",
        schedule=schedule,
        params=dict(defines),
        ops=ops,
        answer_bytes=sizes[0],
        build_s=[round(x, 2) for x in builds],
        build_median_s=round(statistics.median(builds), 2),
        cost_edit_s=[round(x, 2) for x in edits],
        cost_edit_median_s=round(statistics.median(edits), 2),
        cost_edit_over_build=round(statistics.median(edits) / statistics.median(builds), 3),
    )
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    import browser

    if browser._missing():
        if smoke:
            print(f"view_scale --playground --smoke: no browser part ({browser._missing()})", file=sys.stderr)
            return 0
        print(f"view_scale --playground: no browser ({browser._missing()})", file=sys.stderr)
        return 1
    srv = serve.start_in_thread("127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.server_address[1]}/?" + urlencode({"schedule": schedule, **dict(defines)})
    ranks = int(dict(defines).get("p", 0) or 0)
    # the first answer: drawn (body's seq is set once the view has booted) or refused (set at once: a build
    # past pipec serve's 20 s deadline is a 503, reported, not waited for)
    answered = "document.body.dataset.seq && document.getElementById('status').textContent === ''"
    drawn = f"!!(window.pipecView && pipecView.doc.panels[0].ranks === {ranks})"
    chrome = browser.launch()
    walls, pages, phases = [], [], []
    try:
        for _ in range(reps):
            chrome.get("about:blank")
            serve.clear_cache()
            t = time.perf_counter()
            chrome.get(url)
            browser.wait_for(chrome, answered, timeout=300)
            walls.append(time.perf_counter() - t)
            if not chrome.execute_script("return " + drawn):
                why = chrome.execute_script("return document.getElementById('diagnostics').innerText")
                emit(figure="playground_open_to_drawn", ranks=ranks, error=f"not drawn: {why[:200]}")
                return 1
            pages.append(chrome.execute_script("return window.pipecLoadMs"))
            phases.append(  # the simulate request as the page saw it (ms since navigation start)
                chrome.execute_script(
                    "const e = performance.getEntriesByType('resource')"
                    ".filter((r) => r.name.endsWith('/api/simulate'));"
                    "const r = e[e.length - 1]; return r && {sent: r.requestStart, first_byte: r.responseStart,"
                    " received: r.responseEnd, drawn: performance.now(), requests: e.length}"
                )
            )
        rows = chrome.execute_script("pipecView.draw(); return pipecView.shown.length")
        errors = len(browser.console_errors(chrome))
    finally:
        browser.close(chrome)
        srv.shutdown()
        srv.server_close()
    emit(
        figure="playground_open_to_drawn",
        ops=ops,
        ranks=ranks,
        wall_s=[round(x, 2) for x in walls],
        wall_median_s=round(statistics.median(walls), 2),
        decode_and_draw_ms=[round(x, 1) for x in pages],
        request_ms=[{k: round(v) for k, v in p.items()} if p else None for p in phases],
        rows_drawn=rows,
        errors=errors,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
