/* pipec serve: the editor, the controls and the requests; the viewer (viewer.js) draws the result. */
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const src = $("source"), gutter = $("gutter"), diagBox = $("diagnostics");
  const COSTS = ["F", "B", "W", "comm", "overhead"];
  let paramNames = [], seq = 0, timer = null, drawn = null, pinned = null;
  const values = {}, libraryText = {};

  function renderGutter(bad) {
    const n = src.value.split("\n").length;
    gutter.textContent = "";
    for (let i = 1; i <= n; i++) {
      const s = document.createElement("span");
      s.textContent = String(i);
      if (bad.has(i)) { s.className = "bad"; s.title = bad.get(i); }
      s.dataset.line = String(i);
      gutter.appendChild(s);
    }
    gutter.scrollTop = src.scrollTop;
  }
  src.addEventListener("scroll", () => { gutter.scrollTop = src.scrollTop; });

  function controls() {
    const box = $("params");
    box.textContent = "";
    for (const name of paramNames) box.appendChild(input("param", name, values[name] || ""));
    const cbox = $("costs");
    if (!cbox.childElementCount) for (const c of COSTS) cbox.appendChild(input("cost", c, ""));
  }

  function input(kind, name, value) {
    const g = document.createElement("label");
    g.className = "grp";
    const i = document.createElement("input");
    i.dataset[kind] = name;
    i.value = value;
    i.placeholder = kind === "cost" ? "-" : "";
    i.addEventListener("input", () => { if (kind === "param") values[name] = i.value; schedule(0); });
    g.append(name + " =", i);
    return g;
  }

  /** The parameter fields show the values the picture is drawn at (a field left empty: the default). */
  function showDrawn(vals) {
    for (const i of document.querySelectorAll("input[data-param]")) {
      const v = vals[i.dataset.param];
      if (v === undefined) continue;
      if (i.value.trim() === "" || document.activeElement !== i) i.value = v;
      values[i.dataset.param] = i.value;
      i.classList.remove("undrawn");
    }
  }

  /** A build failed or was refused: the picture, its summary and the makespan are the last good build's,
   * greyed, and say so; the fields that differ from what is drawn are marked. */
  function stale(why) {
    const view = $("pipec-view"), note = $("stale-note");
    if (!drawn) { view.textContent = ""; note.className = "pv-stale-note"; return; }
    view.classList.add("pv-stale");
    const params = Object.entries(drawn.values).map(([k, v]) => `${k}=${v}`).join(" ") || "no parameters";
    note.textContent = `Not current (${why}): this picture is of build #${drawn.seq} from ${drawn.time} ` +
      `(${params}, ${drawn.lines} source lines), not of the source as it stands.`;
    note.className = "pv-stale-note on";
    note.dataset.role = "stale";
    $("makespan").classList.add("stale");
    for (const i of document.querySelectorAll("input[data-param]")) {
      const v = drawn.values[i.dataset.param];
      i.classList.toggle("undrawn", v !== undefined && i.value.trim() !== "" && i.value.trim() !== v);
      i.title = v !== undefined ? `drawn at ${i.dataset.param} = ${v}` : "";
    }
  }

  function request() {
    const params = {}, costs = {};
    for (const i of document.querySelectorAll("input[data-param]")) if (i.value.trim()) params[i.dataset.param] = i.value;
    if (!paramNames.length) for (const [k, v] of Object.entries(values)) if (String(v).trim()) params[k] = v; // no fields yet: the URL's
    for (const i of document.querySelectorAll("input[data-cost]")) if (i.value.trim()) costs[i.dataset.cost] = i.value;
    const body = { source: src.value, params, costs };
    // Compare mode: a baseline drawn above the source, under the same costs (the server draws the two as
    // pipec view --compare does; the viewer's summary gives the second minus the first).
    const c = $("compare").value;
    if (c === "@pinned" && pinned) body.compare = { source: pinned.source, params: pinned.params };
    else if (c && c !== "@pinned" && libraryText[c] !== undefined) body.compare = { source: libraryText[c], params };
    return body;
  }

  /** The baseline's source, when it is a library schedule not fetched yet. */
  async function baselineReady() {
    const c = $("compare").value;
    if (!c || c === "@pinned" || libraryText[c] !== undefined) return;
    const r = await fetch("/api/library/" + encodeURIComponent(c));
    const doc = await r.json();
    if (r.ok) libraryText[c] = doc.text;
  }

  function showCompare(res) {
    const note = $("compare-note");
    note.className = "pv-hint";
    note.title = "";
    if (!res.compare) { note.textContent = ""; return; }
    const b = res.compare;
    if (b.title) { // drawn: simulated, or refused for a deadlock and drawn as its chain of waits
      const params = Object.entries(b.values || {}).map(([k, v]) => `${k}=${v}`).join(" ");
      note.textContent = b.ok ? `baseline drawn above (${params}): makespan ${+b.makespan.toPrecision(6)}` : `baseline drawn above (${params}): refused (deadlock)`;
      return;
    }
    const why = b.error || (b.diagnostics[0] && b.diagnostics[0].text) || "it failed";
    note.textContent = "baseline not drawn: " + why.split("\n")[0];
    note.title = why;
    note.className = "pv-hint bad";
  }

  function pin() {
    if (!drawn) return;
    pinned = { source: drawn.source, params: { ...drawn.values }, seq: drawn.seq };
    const opt = $("compare").querySelector("option[value='@pinned']");
    const params = Object.entries(pinned.params).map(([k, v]) => `${k}=${v}`).join(" ") || "no parameters";
    opt.textContent = `the pinned build #${pinned.seq} (${params})`;
    opt.disabled = false;
    $("compare").value = "@pinned";
    schedule(0);
  }

  function schedule(delay) {
    clearTimeout(timer);
    timer = setTimeout(run, delay === undefined ? 300 : delay);
  }

  async function run() {
    const mine = ++seq;
    $("status").textContent = "simulating…";
    let res, req;
    try {
      await baselineReady();
      req = request();
      const r = await fetch("/api/simulate", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(req) });
      res = await r.json();
      if (!r.ok) res = { ok: false, error: res.error || r.statusText, diagnostics: [] };
    } catch (e) { res = { ok: false, error: String(e), diagnostics: [] }; }
    if (mine !== seq) return; // a newer request is on its way
    show(res, req);
  }

  function show(res, req) {
    const bad = new Map();
    diagBox.textContent = "";
    for (const d of res.diagnostics || []) {
      const div = document.createElement("div");
      div.className = "d";
      div.dataset.role = "diag";
      div.dataset.line = d.line === null ? "" : String(d.line);
      div.dataset.col = d.col === null ? "" : String(d.col);
      div.textContent = d.text;
      if (d.line) {
        bad.set(d.line, d.message);
        div.addEventListener("click", () => goTo(d.line, d.col));
      }
      diagBox.appendChild(div);
    }
    if (res.error) {
      const div = document.createElement("div");
      div.className = "d";
      div.dataset.role = "error";
      div.textContent = res.error;
      diagBox.appendChild(div);
    }
    if (res.ok) {
      const ok = document.createElement("div");
      ok.className = "ok";
      ok.textContent = `no errors · ${res.ops.toLocaleString()} ops`;
      diagBox.appendChild(ok);
    }
    renderGutter(bad);
    if (res.params && res.params.join() !== paramNames.join() && (res.view || res.params.length)) { // a syntax error keeps the fields
      paramNames = res.params;
      for (const [k, v] of Object.entries(res.values || {})) if (!(k in values)) values[k] = v;
      controls();
    }
    $("status").textContent = "";
    const view = $("pipec-view");
    if (res.view) {
      const mine = seq;
      view.classList.remove("pv-stale");
      $("stale-note").className = "pv-stale-note";
      $("makespan").classList.remove("stale");
      $("makespan").textContent = res.makespan === null || res.makespan === undefined ? "-" : String(+res.makespan.toPrecision(6));
      $("makespan").dataset.value = res.makespan === null || res.makespan === undefined ? "" : String(res.makespan);
      const vals = res.values || {};
      drawn = { seq: mine, time: new Date().toLocaleTimeString(), values: vals, lines: src.value.split("\n").length,
        source: req ? req.source : src.value };
      showDrawn(vals);
      view.dataset.drawn = JSON.stringify(vals);
      showCompare(res);
      PipecView.boot(view, res.view).then(() => { document.body.dataset.seq = String(mine); });
    } else {
      stale(res.error ? "the server refused it" : "the source has errors");
      $("makespan").dataset.value = "";
      document.body.dataset.seq = String(seq);
    }
  }

  function goTo(line, col) {
    const lines = src.value.split("\n");
    let pos = 0;
    for (let i = 0; i < line - 1 && i < lines.length; i++) pos += lines[i].length + 1;
    pos += Math.max(0, (col || 1) - 1);
    src.focus();
    src.setSelectionRange(pos, pos);
  }

  async function load(name, preset) {
    const r = await fetch("/api/library/" + encodeURIComponent(name));
    const doc = await r.json();
    if (!r.ok) { show({ error: doc.error, diagnostics: [] }); return; }
    src.value = doc.text;
    paramNames = [];
    for (const k of Object.keys(values)) delete values[k];
    Object.assign(values, preset || {});
    renderGutter(new Map());
    schedule(0);
  }

  async function download(what) {
    const r = await fetch("/api/download", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ ...request(), what }) });
    if (!r.ok) { const e = await r.json(); show({ error: e.error, diagnostics: [] }); return; }
    const name = (r.headers.get("Content-Disposition") || "").match(/filename="([^"]+)"/);
    const url = URL.createObjectURL(await r.blob());
    const a = document.createElement("a");
    a.href = url; a.download = name ? name[1] : what;
    document.body.appendChild(a); a.click(); a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  src.addEventListener("input", () => { renderGutter(new Map()); schedule(); });
  src.addEventListener("keydown", (ev) => {
    if (ev.key === "Tab") { ev.preventDefault(); src.setRangeText("    ", src.selectionStart, src.selectionEnd, "end"); schedule(); }
  });
  for (const b of document.querySelectorAll(".pg-downloads button")) b.addEventListener("click", () => download(b.dataset.what));
  $("library").addEventListener("change", (ev) => { if (ev.target.value) load(ev.target.value); });
  $("compare").addEventListener("change", () => schedule(0));
  $("pin").addEventListener("click", pin);

  (async () => {
    controls();
    const r = await fetch("/api/library");
    const doc = await r.json();
    for (const n of doc.names) {
      const o = document.createElement("option");
      o.value = n; o.textContent = n;
      $("library").appendChild(o);
      const c = document.createElement("option");
      c.value = n; c.textContent = "library: " + n;
      $("compare").appendChild(c);
    }
    // ?schedule=NAME opens a library schedule; any other key=value is a parameter (?schedule=1f1b&p=8&m=16),
    // a cost (F=1.5), or compare=NAME (a library schedule to compare with).
    const query = new URLSearchParams(location.search), preset = {};
    for (const [k, v] of query) {
      if (k === "schedule") continue;
      if (k === "compare") { $("compare").value = v; continue; }
      const cost = document.querySelector(`input[data-cost="${CSS.escape(k)}"]`);
      if (cost) cost.value = v; else preset[k] = v;
    }
    const start = query.get("schedule") || "1f1b";
    $("library").value = start;
    await load(start, preset);
  })();
})();
