/* pipec view: timelines of pipeline schedules on a <canvas>. No build step, no dependencies.
 *
 * The data (pipec/view/html.py) holds columns as deflated little-endian typed arrays in base64; events are
 * sorted by rank and start, so the visible window of a lane is found by binary search, and events narrower
 * than a pixel are merged into one rectangle (level of detail). Only the rows in view are drawn: the canvas
 * is the size of the window onto the rows (the time axis and the rank labels stay in view), so ten thousand
 * ranks draw as fast as ten. Memory is drawn as steps, each pixel column spanning the minimum and maximum
 * the curve takes in it (the peak is always drawn). Clicking an op selects it: its dependencies and
 * dependents (pipec.ir.rules, sent as the panel's `rules`, over the panel's stage `graph` when it has one:
 * a stage offset -1 is every input of the stage, +1 every consumer; without one the chain, s - 1 and s + 1)
 * and its micro-batch are highlighted, its details kept in the side panel. `window.pipecDebug` returns what the last draw drew (tests read it, not pixels).
 */
"use strict";
const PipecView = (() => {
  const TYPED = { f4: Float32Array, i4: Int32Array, i2: Int16Array, u1: Uint8Array };
  const CRITICAL = 1, PAIR_FIRST = 2, PAIR_SECOND = 4, IN_CYCLE = 8;
  const COLORS = { FWD: "#4c78a8", BWD: "#54a24b", WGRAD: "#f58518", RECOMPUTE: "#9ecae9",
    REDUCE_GRAD: "#b279a2", UNSHARD: "#72b7b2", RESHARD: "#bab0ac", OFFLOAD: "#9d755d", RELOAD: "#c9a66b" };
  // The legend's names, used in the tooltips and the side panel too.
  const NAME = { FWD: "F", BWD: "B", WGRAD: "W", RECOMPUTE: "recompute", REDUCE_GRAD: "reduce-grad",
    UNSHARD: "unshard", RESHARD: "reshard", OFFLOAD: "offload", RELOAD: "reload", STEP: "step" };
  const LETTER = { FWD: "F", BWD: "B", WGRAD: "W", RECOMPUTE: "R" };
  const MSG_COLORS = ["#a6c8e8", "#a9d69f"];
  const GUTTER = 84, AXIS = 22, RIGHT = 8;
  const DEP = "#e6550d", DEPENDENT = "#0b8a8a", SELECTED = "#111", MATCH = "#f2b01e";

  async function inflate(col) {
    const bin = atob(col.b64);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    const buf = await new Response(stream).arrayBuffer();
    return new TYPED[col.dtype](buf);
  }

  async function decode(obj) {
    if (Array.isArray(obj)) return Promise.all(obj.map(decode));
    if (obj && typeof obj === "object") {
      if (typeof obj.b64 === "string" && obj.dtype in TYPED) return inflate(obj);
      const out = {};
      await Promise.all(Object.keys(obj).map(async (k) => { out[k] = await decode(obj[k]); }));
      return out;
    }
    return obj;
  }

  function lowerBound(a, lo, hi, x) { // first index in [lo, hi) with a[i] >= x
    while (lo < hi) { const mid = (lo + hi) >>> 1; if (a[mid] < x) lo = mid + 1; else hi = mid; }
    return lo;
  }

  // ---- numbers ---------------------------------------------------------------------------------------

  function num(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return "-";
    const a = Math.abs(x);
    if (a !== 0 && (a < 1e-9 || a >= 1e12)) return x.toExponential(2);
    return String(+x.toPrecision(digits || 4));
  }

  const SCALES = [[1, "s"], [1e-3, "ms"], [1e-6, "µs"], [1e-9, "ns"]];
  function scaleOf(a) { for (const s of SCALES) if (a >= s[0]) return s; return SCALES[SCALES.length - 1]; }

  /** A time for people: 48.2 µs in seconds, 12.5 units otherwise, position 3 in a deadlock's order. */
  function fmtTime(x, unit) {
    if (x === null || x === undefined || Number.isNaN(x)) return "-";
    if (unit !== "s") return num(x, 5) + (unit === "units" ? "" : "");
    if (x === 0) return "0 s";
    const [k, name] = scaleOf(Math.abs(x));
    return num(x / k, 3) + " " + name;
  }

  function fmtMem(x, unit) {
    if (unit !== "bytes") return num(x, 4) + (x === 1 ? " unit" : " units");
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(x) >= 1024 && i < u.length - 1) { x /= 1024; i++; }
    return (+x.toPrecision(4)) + " " + u[i];
  }

  function pct(x) { return Number.isFinite(x) ? (100 * x).toFixed(1) + "%" : "-"; }

  function niceStep(raw) {
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / p;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * p;
  }
  function nextNice(step) {
    const p = Math.pow(10, Math.floor(Math.log10(step) + 1e-9)), f = Math.round(step / p);
    return (f === 1 ? 2 : f === 2 ? 5 : 10) * p;
  }

  /** The axis's ticks for [v0, v1] over w pixels: {scale name, labels, values}; labels carry as many
   * decimals as the step needs, so adjacent ticks always read differently. */
  function ticks(v0, v1, w, unit, measure) {
    let scale = 1, name = unit === "s" ? "s" : unit;
    if (unit === "s") [scale, name] = scaleOf(Math.max(Math.abs(v0), Math.abs(v1)) || 1);
    let step = niceStep((v1 - v0) / Math.max(2, w / 90));
    if (unit === "order") step = Math.max(1, step); // positions in a rank's order: whole numbers
    for (let tries = 0; tries < 8; tries++) {
      const dec = Math.min(12, Math.max(0, -Math.floor(Math.log10(step / scale) + 1e-9)));
      const label = (v) => { const s = (v / scale).toFixed(dec); return /^-0(\.0*)?$/.test(s) ? s.slice(1) : s; };
      const widest = Math.max(measure(label(v0)), measure(label(v1)));
      if (widest + 14 <= step / (v1 - v0) * w || tries === 7) {
        const values = [], labels = [];
        for (let k = Math.ceil(v0 / step); k * step <= v1; k++) { values.push(k * step); labels.push(label(k * step)); }
        return { name, values, labels };
      }
      step = nextNice(step);
    }
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function shade(hex, chunk) { // chunk 0: the colour; odd chunks darker, even ones lighter
    if (!chunk) return hex;
    const n = parseInt(hex.slice(1), 16);
    let r = n >> 16, g = (n >> 8) & 255, b = n & 255;
    const k = [0, -0.32, 0.35, -0.55, 0.6][Math.min(chunk, 4)];
    const f = (c) => Math.round(k < 0 ? c * (1 + k) : c + (255 - c) * k);
    r = f(r); g = f(g); b = f(b);
    return "#" + ((1 << 24) | (r << 16) | (g << 8) | b).toString(16).slice(1);
  }

  // ---- per-panel facts, computed once ------------------------------------------------------------------

  function prepare(doc) {
    for (const P of doc.panels) {
      const O = P.ops, n = O.op.length;
      if (P.memory && P.memory.off) { // one column per curve for all ranks: each rank's its slice
        const Mm = P.memory;
        Mm.ranks.forEach((M, r) => {
          M.t = Mm.t.subarray(Mm.off[r], Mm.off[r + 1]); M.v = Mm.v.subarray(Mm.off[r], Mm.off[r + 1]);
          M.ht = Mm.ht.subarray(Mm.hoff[r], Mm.hoff[r + 1]); M.hv = Mm.hv.subarray(Mm.hoff[r], Mm.hoff[r + 1]);
        });
      }
      P.unit = P.kind === "deadlock" ? "order" : (P.time_unit || "units");
      if (P.graph) { // a stage graph (pipec.ir.graph): each stage's inputs and consumers, by edge order
        P.ins = Array.from({ length: P.graph.stages }, () => []);
        P.outs = Array.from({ length: P.graph.stages }, () => []);
        for (const [u, v] of P.graph.edges) { P.outs[u].push(v); P.ins[v].push(u); }
        for (const a of P.ins) a.sort((x, y) => x - y);
      }
      // Chunks: the position of an op's stage among its rank's stages (a V or interleaved schedule's two).
      P.chunk = new Uint8Array(n);
      P.maxChunk = 0;
      P.stages = 0;
      for (let r = 0; r < P.ranks; r++) {
        const seen = new Map();
        for (let i = P.op_off[r]; i < P.op_off[r + 1]; i++) seen.set(O.stage[i], 1);
        const order = [...seen.keys()].sort((a, b) => a - b);
        const idx = new Map(order.map((s, k) => [s, k]));
        for (let i = P.op_off[r]; i < P.op_off[r + 1]; i++) P.chunk[i] = Math.min(255, idx.get(O.stage[i]));
        P.maxChunk = Math.max(P.maxChunk, order.length - 1);
        if (order.length) P.stages = Math.max(P.stages, order[order.length - 1] + 1);
      }
      // Busy time per rank (the union of its compute ops), its last end, and what is present (the legend).
      P.busy = new Float64Array(P.ranks);
      P.rankEnd = new Float64Array(P.ranks);
      P.present = new Set();
      let maxMb = 0;
      const seenOp = new Uint8Array(256);
      for (let r = 0; r < P.ranks; r++) {
        let cur = -Infinity, busy = 0, end = 0;
        for (let i = P.op_off[r]; i < P.op_off[r + 1]; i++) {
          const s = O.start[i], e = O.end[i];
          busy += Math.max(0, e - Math.max(s, cur));
          cur = Math.max(cur, e);
          end = Math.max(end, e);
          seenOp[O.op[i]] = 1;
          if (O.mb[i] > maxMb) maxMb = O.mb[i];
          if (O.flags[i] & (PAIR_FIRST | PAIR_SECOND)) P.present.add("pair");
          if (O.flags[i] & CRITICAL) P.present.add("critical");
        }
        P.busy[r] = busy;
        P.rankEnd[r] = end;
      }
      P.maxMb = maxMb;
      for (let c = 0; c < 256; c++) if (seenOp[c]) P.present.add(doc.opcodes[c]);
      for (let i = 0; i < P.msgs.kind.length; i++) { P.present.add("msg" + P.msgs.kind[i]); if (P.present.has("msg0") && P.present.has("msg1")) break; }
      for (let i = 0; i < P.msgs.flags.length && !P.present.has("critical"); i++) if (P.msgs.flags[i] & CRITICAL) P.present.add("critical");
      for (const S of [P.colls, P.host, P.a2a]) if (S) for (let i = 0; i < S.op.length; i++) P.present.add(doc.opcodes[S.op[i]]);
      if (P.gaps.start.length) P.present.add("gap");
      if (P.memory) { P.present.add("memory"); if (P.memory.host) P.present.add("host pool"); }
      P.maxMsg = new Float64Array(P.ranks);
      for (let r = 0; r < P.ranks; r++) {
        let m = 0;
        for (let i = P.msg_off[r]; i < P.msg_off[r + 1]; i++) m = Math.max(m, P.msgs.arrival[i] - P.msgs.send[i]);
        P.maxMsg[r] = m;
      }
      const total = P.ranks * P.makespan;
      let sumBusy = 0;
      for (let r = 0; r < P.ranks; r++) sumBusy += P.busy[r];
      P.bubble = total > 0 ? 1 - sumBusy / total : NaN;
    }
  }

  class View {
    constructor(root, doc) {
      this.root = root;
      this.doc = doc;
      this.op = doc.opcodes;
      this.show = { arrows: true, critical: true, gaps: true, memory: true };
      this.collapsed = new Set(); // "p:r"
      this.sel = null;            // {p, i, deps, dependents, mb}
      this.matches = [];          // [[p, i], ...]
      this.matchAt = -1;
      this.dbg = { ticks: null, mem: new Map(), highlight: null };
      prepare(doc);
      root.textContent = "";
      root.classList.add("pv-root");
      const end = Math.max(1e-12, ...doc.panels.map((p) => p.makespan), ...doc.panels.map((p) => p.measured_makespan || 0));
      this.full = [0, end * 1.02];
      this.v0 = this.full[0];
      this.v1 = this.full[1];
      this.sy = 0;
      this.dirty = false;
      this.build();
      this.layout();
      this.draw();
    }

    get unit() { return this.doc.panels.some((p) => p.kind === "deadlock") ? "order" : this.doc.panels[0].unit; }

    build() {
      const doc = this.doc, root = this.root;
      const head = el("div", "pv-head");
      head.appendChild(el("h1", null, doc.title));
      for (const P of doc.panels) {
        const s = el("div", "pv-summary");
        s.dataset.role = "summary";
        let text = `${P.title}: makespan ${fmtTime(P.makespan, P.unit)}`;
        if (P.kind === "deadlock") text = `${P.title}: each rank's ops in order; the wait cycle in red`;
        else if (P.critical_length !== undefined) text += `; critical path ${fmtTime(P.critical_length, P.unit)}`;
        if (P.graph) text += `; stage graph: ${P.graph.text}`;
        if (P.kind === "overlay") {
          text += ` | measured makespan ${fmtTime(P.measured_makespan, P.unit)}; ${P.matched} ops matched; ` +
            `mean |duration error| ${fmtTime(P.mean_abs_error, P.unit)}`;
        }
        s.textContent = text;
        head.appendChild(s);
        if (P.diagnostic) head.appendChild(el("pre", "pv-diag", P.diagnostic));
      }
      root.appendChild(head);
      const bar = el("div", "pv-bar");
      for (const key of Object.keys(this.show)) {
        const lab = el("label");
        const cb = el("input");
        cb.type = "checkbox";
        cb.checked = true;
        cb.dataset.toggle = key;
        cb.addEventListener("change", () => { this.show[key] = cb.checked; this.layout(); this.draw(); });
        lab.append(cb, " " + { arrows: "messages", critical: "critical path", gaps: "idle gaps", memory: "memory" }[key]);
        bar.appendChild(lab);
      }
      const reset = el("button", null, "reset zoom");
      reset.addEventListener("click", () => { [this.v0, this.v1] = this.full; this.draw(); });
      const fold = el("button", null, "collapse ranks");
      fold.dataset.role = "collapse-all";
      fold.addEventListener("click", () => {
        const any = this.collapsed.size > 0;
        this.collapsed.clear();
        if (!any) this.doc.panels.forEach((P, p) => { for (let r = 0; r < P.ranks; r++) this.collapsed.add(p + ":" + r); });
        fold.textContent = any ? "collapse ranks" : "expand ranks";
        this.layout(); this.draw();
      });
      const search = el("input", "pv-search");
      search.type = "search";
      search.placeholder = "search: F3, mb 3, stage 2, 1f1b.pipe:17, text";
      search.dataset.role = "search";
      this.searchBox = search;
      const count = el("span", "pv-hint");
      count.dataset.role = "search-count";
      this.searchCount = count;
      let timer = null;
      search.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(() => this.search(search.value, true), 150); });
      search.addEventListener("keydown", (ev) => {
        if (ev.key === "Enter") { ev.preventDefault(); clearTimeout(timer); this.search(search.value, false); this.nextMatch(ev.shiftKey ? -1 : 1); }
        else if (ev.key === "Escape") { search.value = ""; this.search("", true); search.blur(); }
      });
      bar.append(reset, fold, search, count,
        el("span", "pv-hint", "wheel or W/S: zoom · drag or A/D: pan · shift+wheel or ↑/↓: ranks · click: select · Esc: clear"));
      root.appendChild(bar);
      this.legendBox = el("div", "pv-legend");
      this.legendBox.dataset.role = "legend";
      root.appendChild(this.legendBox);
      this.legend();
      const main = el("div", "pv-main");
      const left = el("div", "pv-left");
      this.overview = el("canvas", "pv-overview");
      this.overview.title = "the whole step: each column's share of busy ranks; the box is the window in view (click or drag to move it)";
      const stage = el("div", "pv-stage");
      const wrap = el("div", "pv-wrap");
      this.canvas = el("canvas");
      this.spacer = el("div", "pv-spacer");
      wrap.append(this.canvas, this.spacer);
      this.tip = el("div", "pv-tip");
      this.tip.id = "pipec-tip";
      stage.append(wrap, this.tip);
      left.append(this.overview, stage);
      this.side = el("div", "pv-side");
      main.append(left, this.side);
      root.appendChild(main);
      this.wrap = wrap;
      this.left = left;
      this.renderSide();
      this.bindEvents();
    }

    /** The legend: only what the view holds; the selection's and the search's marks only while there is one. */
    legend() {
      const legend = this.legendBox;
      legend.textContent = "";
      const has = (k) => this.doc.panels.some((P) => P.present.has(k));
      const items = [];
      for (const k of ["FWD", "BWD", "WGRAD", "RECOMPUTE"]) if (has(k)) items.push([NAME[k], COLORS[k]]);
      if (this.doc.panels.some((P) => P.maxChunk > 0)) {
        for (let c = 0; c <= Math.min(4, Math.max(...this.doc.panels.map((P) => P.maxChunk))); c++) items.push([`chunk ${c}`, shade("#4c78a8", c)]);
      }
      if (has("msg0")) items.push(["activation msg", MSG_COLORS[0]]);
      if (has("msg1")) items.push(["gradient msg", MSG_COLORS[1]]);
      for (const k of ["REDUCE_GRAD", "UNSHARD", "RESHARD", "OFFLOAD", "RELOAD"]) if (has(k)) items.push([NAME[k], COLORS[k]]);
      if (has("critical")) items.push(["critical path", "#d62728"]);
      if (has("gap")) items.push(["idle gap", "rgba(214,39,40,0.15)"]);
      if (has("pair")) items.push(["overlapped pair (&)", "#7b3294", true]);
      if (has("memory")) items.push(["memory (device)", "#6b8fc7"]);
      if (has("host pool")) items.push(["host pool", "#e08a2c"]);
      if (this.doc.panels.some((p) => p.kind === "overlay")) items.push(["measured (lower half)", "#2d3e50"]);
      if (this.doc.panels.some((p) => p.kind === "deadlock")) items.push(["wait cycle", "#d62728", true]);
      const graphs = [...new Set(this.doc.panels.filter((P) => P.graph).map((P) => P.graph.text))];
      if (graphs.length) items.push(["stage graph", null, false, "stage graph: " + graphs.join(" | ")]);
      if (this.sel) items.push(["selected", SELECTED, true], ["depends on (selected)", DEP, true], ["depended on by", DEPENDENT, true], ["its micro-batch", "#333", true]);
      if (this.matches.length) items.push(["search match", MATCH, true]);
      for (const [name, c, outline, text] of items) {
        const it = el("span");
        it.dataset.legend = name;
        if (c === null) { it.append(text || name); legend.appendChild(it); continue; } // words only, no swatch
        const sw = el("span", "sw" + (outline ? " outline" : ""));
        if (outline) sw.style.borderColor = c; else sw.style.background = c;
        it.append(sw, name);
        legend.appendChild(it);
      }
      return legend;
    }

    // ---- the side panel: summary, selection --------------------------------------------------------------

    renderSide() {
      const side = this.side;
      side.textContent = "";
      const P0 = this.doc.panels;
      const sum = el("div", "pv-box");
      sum.dataset.role = "stats";
      sum.appendChild(el("h2", null, "summary"));
      for (const [p, P] of P0.entries()) {
        if (P0.length > 1) sum.appendChild(el("div", "pv-sub", P.title));
        if (P.kind === "deadlock") { sum.appendChild(el("div", "pv-hint", "refused: nothing was timed")); continue; }
        const t = el("table", "pv-stats");
        const row = (k, v, role) => { const tr = el("tr"); tr.append(el("th", null, k), el("td", null, v)); if (role) tr.dataset.role = role + (p ? "-" + p : ""); t.appendChild(tr); };
        row("makespan", fmtTime(P.makespan, P.unit), "makespan");
        row("bubble rate", pct(P.bubble), "bubble");
        if (P.memory) row("peak memory", fmtMem(P.memory.ranks.reduce((m, x) => Math.max(m, x.peak), 0), P.memory.unit), "peak");
        if (P.kind === "overlay") row("measured", fmtTime(P.measured_makespan, P.unit));
        sum.appendChild(t);
        sum.appendChild(this.rankTable(P, p));
      }
      if (P0.length === 2 && P0.every((P) => P.kind !== "deadlock")) sum.appendChild(this.deltaTable(P0[0], P0[1]));
      side.appendChild(sum);
      const det = el("div", "pv-box pv-detail");
      det.dataset.role = "detail";
      this.detail = det;
      this.renderDetail();
      side.appendChild(det);
    }

    rankTable(P, p) {
      // Per rank: busy share (a bar) and peak memory. Many ranks: the least busy ones and the spread.
      const box = el("div", "pv-ranks");
      const ranks = [...Array(P.ranks).keys()];
      let shown = ranks, note = null;
      if (P.ranks > 16) {
        shown = ranks.slice().sort((a, b) => P.busy[a] - P.busy[b]).slice(0, 8).sort((a, b) => a - b);
        const shares = ranks.map((r) => P.busy[r] / (P.makespan || 1)).sort((a, b) => a - b);
        note = `${P.ranks.toLocaleString()} ranks: busy ${pct(shares[0])} to ${pct(shares[shares.length - 1])} (median ${pct(shares[shares.length >> 1])}); the 8 least busy:`;
      }
      if (note) box.appendChild(el("div", "pv-hint", note));
      const t = el("table", "pv-stats pv-rank-table");
      const h = el("tr");
      h.append(el("th", null, "rank"), el("th", null, "busy"), el("th", null, P.memory ? "peak" : ""));
      t.appendChild(h);
      for (const r of shown) {
        const tr = el("tr");
        tr.dataset.rank = String(r);
        if (p) tr.dataset.panel = String(p);
        const share = P.makespan > 0 ? P.busy[r] / P.makespan : NaN;
        const bar = el("td", "pv-busy");
        const fill = el("span", "fill");
        fill.style.width = (Number.isFinite(share) ? 100 * share : 0).toFixed(1) + "%";
        bar.append(fill, el("span", "v", pct(share)));
        tr.append(el("td", null, String(r)), bar, el("td", null, P.memory ? fmtMem(P.memory.ranks[r].peak, P.memory.unit) : ""));
        tr.addEventListener("click", () => this.scrollToRank(p, r));
        t.appendChild(tr);
      }
      box.appendChild(t);
      return box;
    }

    /** The second panel minus the first (pipec view --compare, the playground's compare mode): makespan,
     * bubble rate, and per rank its end and its peak memory (past 16 ranks: the 16 that moved most). */
    deltaTable(A, B) {
      const box = el("div", "pv-delta");
      box.dataset.role = "delta";
      box.appendChild(el("h2", null, "second minus first"));
      box.appendChild(el("div", "pv-hint", `${B.title} minus ${A.title}`));
      const sign = (x, f) => (x > 0 ? "+" : x < 0 ? "−" : "±") + f(Math.abs(x));
      const t = el("table", "pv-stats");
      const row = (k, v, cls, role) => {
        const tr = el("tr", cls); tr.append(el("th", null, k), el("td", cls, v));
        if (role) tr.dataset.role = role;
        t.appendChild(tr);
        return tr;
      };
      const dMake = B.makespan - A.makespan, dBubble = B.bubble - A.bubble;
      row("makespan", sign(dMake, (x) => fmtTime(x, A.unit)) + ` (${pct(A.makespan ? dMake / A.makespan : NaN)})`, "", "delta-makespan").dataset.value = String(dMake);
      row("bubble rate", sign(100 * dBubble, (x) => x.toFixed(1) + " pt"), "", "delta-bubble").dataset.value = String(dBubble);
      const mem = !!(A.memory && B.memory);
      if (mem) {
        const peak = (P) => P.memory.ranks.reduce((m, x) => Math.max(m, x.peak), 0);
        row("peak memory", sign(peak(B) - peak(A), (x) => fmtMem(x, A.memory.unit)), "", "delta-peak").dataset.value = String(peak(B) - peak(A));
      }
      const both = Math.min(A.ranks, B.ranks), eps = 1e-9 * (A.makespan || 1);
      const dEnd = (r) => B.rankEnd[r] - A.rankEnd[r];
      const dPeak = (r) => (mem ? B.memory.ranks[r].peak - A.memory.ranks[r].peak : 0);
      const endMoved = (r) => Math.abs(dEnd(r)) > eps;
      const peakMoved = (r) => Math.abs(dPeak(r)) > 1e-9 * (A.memory ? A.memory.ranks[r].peak || 1 : 1);
      const moved = (r) => endMoved(r) || peakMoved(r);
      let ranks = [...Array(both).keys()];
      if (both > 16) {
        const size = (r) => Math.abs(dEnd(r)) / (A.makespan || 1) + (mem ? Math.abs(dPeak(r)) / (A.memory.ranks[r].peak || 1) : 0);
        const differ = ranks.filter(moved).length;
        box.appendChild(el("div", "pv-hint", `${differ.toLocaleString()} of ${both.toLocaleString()} ranks differ; the 16 that moved most:`));
        ranks = ranks.slice().sort((a, b) => size(b) - size(a) || a - b).slice(0, 16).sort((a, b) => a - b);
      }
      if (A.ranks !== B.ranks) row("ranks", `${A.ranks} and ${B.ranks}`, "diff");
      box.appendChild(t);
      const rt = el("table", "pv-stats pv-rank-table");
      const h = el("tr");
      h.append(el("th", null, "rank"), el("th", null, "end"), el("th", null, mem ? "peak" : ""));
      rt.appendChild(h);
      for (const r of ranks) {
        const tr = el("tr", moved(r) ? "diff" : "");
        // a moved rank's row is marked; only the figures that moved are red (an unchanged peak beside a moved end is not)
        tr.append(el("td", null, String(r)), el("td", endMoved(r) ? "diff" : null, sign(dEnd(r), (x) => fmtTime(x, A.unit))),
          el("td", mem && peakMoved(r) ? "diff" : null, mem ? sign(dPeak(r), (x) => fmtMem(x, A.memory.unit)) : ""));
        tr.dataset.rank = String(r);
        tr.dataset.dend = String(dEnd(r));
        if (mem) tr.dataset.dpeak = String(dPeak(r));
        tr.addEventListener("click", () => this.scrollToRank(1, r));
        rt.appendChild(tr);
      }
      box.appendChild(rt);
      return box;
    }

    renderDetail() {
      const det = this.detail;
      det.textContent = "";
      det.appendChild(el("h2", null, "selection"));
      if (!this.sel) { det.appendChild(el("div", "pv-hint", "click an op to see what it waits for and what waits for it")); return; }
      const { p, i } = this.sel, P = this.doc.panels[p];
      for (const [cls, text, role] of this.describeOp(P, i, false)) {
        const d = el("div", cls, text);
        if (role) d.dataset.role = "sel-" + role;
        det.appendChild(d);
      }
      const why = this.whyHere(P, i);
      if (why) { const d = el("div", "pv-why", why.text); d.dataset.role = "sel-why"; if (why.op >= 0) this.linkTo(d, p, why.op); det.appendChild(d); }
      const list = (title, items, color, role) => {
        const h = el("div", "pv-sub", `${title} (${items.length})`);
        h.style.borderLeftColor = color;
        det.appendChild(h);
        const ul = el("ul", "pv-list");
        ul.dataset.role = role;
        for (const j of items.slice(0, 50)) {
          const li = el("li", null, `${this.label(P, j)}.${P.ops.stage[j]} on rank ${P.ops.rank[j]} · ${fmtTime(P.ops.start[j], P.unit)} → ${fmtTime(P.ops.end[j], P.unit)}`);
          this.linkTo(li, p, j);
          ul.appendChild(li);
        }
        det.appendChild(ul);
      };
      list("depends on", this.sel.deps, DEP, "sel-deps");
      list("depended on by", this.sel.dependents, DEPENDENT, "sel-dependents");
      det.appendChild(el("div", "pv-hint", `micro-batch ${this.mbOf(P, P.ops.mb[i])}: ${this.sel.mb.length} ops, outlined everywhere`));
    }

    linkTo(node, p, j) {
      node.classList.add("pv-link");
      node.addEventListener("click", () => { this.select(p, j); this.reveal(p, j); });
    }

    // ---- layout: rows, the scrolled window onto them -------------------------------------------------------

    layout() {
      this.lanes = [];
      this.laneMap = new Map();
      let y = 0;
      const add = (L) => { this.lanes.push(L); if (L.r !== undefined) this.laneMap.set(L.p + ":" + L.r + ":" + L.type, L); };
      this.doc.panels.forEach((P, p) => {
        add({ P, p, type: "title", y, h: 18 });
        y += 18;
        const hasColl = P.colls.op.length > 0, hasHost = P.host.op.length > 0;
        const hasA2a = !!P.a2a && P.a2a.op.length > 0;
        const hasMem = this.show.memory && P.memory;
        for (let r = 0; r < P.ranks; r++) {
          if (this.collapsed.has(p + ":" + r)) { add({ P, p, r, type: "ops", y, h: 12, collapsed: true }); y += 14; continue; }
          add({ P, p, r, type: "ops", y, h: 26 }); y += 26;
          if (P.kind !== "deadlock") { add({ P, p, r, type: "p2p", y, h: 11 }); y += 11; }
          if (hasColl) { add({ P, p, r, type: "coll", y, h: 9 }); y += 9; }
          if (hasHost) { add({ P, p, r, type: "host", y, h: 9 }); y += 9; }
          if (hasA2a) { add({ P, p, r, type: "a2a", y, h: 9 }); y += 9; }
          if (hasMem) { add({ P, p, r, type: "mem", y, h: 30 }); y += 30; }
          y += 5;
        }
        y += 6;
      });
      this.height = y;
      this.resize();
    }

    resize() {
      const dpr = window.devicePixelRatio || 1;
      this.width = Math.max(300, this.left.clientWidth || 900);
      const top = this.wrap.getBoundingClientRect().top + window.scrollY;
      const room = Math.max(260, (window.innerHeight || 800) - Math.max(0, top - window.scrollY) - 14);
      this.viewH = Math.min(AXIS + this.height, Math.max(260, room));
      this.wrap.style.height = this.viewH + "px";
      this.spacer.style.height = Math.max(0, AXIS + this.height - this.viewH) + "px";
      this.canvas.width = Math.round(this.width * dpr);
      this.canvas.height = Math.round(this.viewH * dpr);
      this.canvas.style.width = this.width + "px";
      this.canvas.style.height = this.viewH + "px";
      this.ctx = this.canvas.getContext("2d");
      this.ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      this.sy = Math.min(this.wrap.scrollTop, Math.max(0, AXIS + this.height - this.viewH));
      this.overview.width = Math.round(this.width * dpr);
      this.overview.height = Math.round(34 * dpr);
      this.overview.style.width = this.width + "px";
      this.overview.style.height = "34px";
      this.octx = this.overview.getContext("2d");
      this.octx.setTransform(dpr, 0, 0, dpr, 0, 0);
      this.density = null;
    }

    x(t) { return GUTTER + (t - this.v0) / (this.v1 - this.v0) * (this.width - GUTTER - RIGHT); }
    t(x) { return this.v0 + (x - GUTTER) / (this.width - GUTTER - RIGHT) * (this.v1 - this.v0); }
    sy_(L) { return AXIS + L.y - this.sy; } // a lane's top on the canvas

    laneOf(P, r, type) { return this.laneMap.get(this.doc.panels.indexOf(P) + ":" + r + ":" + type); }

    visibleLanes() {
      const lo = this.sy, hi = this.sy + this.viewH - AXIS;
      let a = 0, b = this.lanes.length;
      while (a < b) { const m = (a + b) >>> 1; if (this.lanes[m].y + this.lanes[m].h < lo) a = m + 1; else b = m; }
      const out = [];
      for (let k = a; k < this.lanes.length && this.lanes[k].y < hi; k++) out.push(this.lanes[k]);
      return out;
    }

    /** Redraw now; returns the milliseconds it took (the benchmark reads it). */
    draw() {
      const t0 = performance.now();
      const ctx = this.ctx;
      ctx.clearRect(0, 0, this.width, this.viewH);
      ctx.font = "10px system-ui, sans-serif";
      this.visibleMsgs = [];
      this.dbg.mem = new Map();
      const lanes = this.visibleLanes();
      this.shown = lanes;
      this.drawGrid();
      ctx.save();
      ctx.beginPath();
      ctx.rect(GUTTER, AXIS, this.width - GUTTER, this.viewH - AXIS);
      ctx.clip();
      for (const L of lanes) {
        const y = this.sy_(L);
        if (L.type === "ops") this.drawOps(L, y);
        else if (L.type === "p2p") this.drawMsgs(L, y);
        else if (L.type === "coll") this.drawSpans(L, y, L.P.colls, L.P.coll_off);
        else if (L.type === "host") this.drawSpans(L, y, L.P.host, L.P.host_off);
        else if (L.type === "a2a") this.drawSpans(L, y, L.P.a2a, L.P.a2a_off);
        else if (L.type === "mem") this.drawMem(L, y);
      }
      if (this.show.arrows) this.drawArrows(); else this.dbg.arrows = [];
      for (const P of this.doc.panels) if (P.chain) this.drawChain(P);
      this.drawHighlights(lanes);
      ctx.restore();
      this.drawLabels(lanes);
      this.drawAxis();
      this.drawOverview();
      const ms = performance.now() - t0;
      this.lastDraw = ms;
      return ms;
    }

    drawGrid() {
      const ctx = this.ctx;
      this.tk = ticks(this.v0, this.v1, this.width - GUTTER - RIGHT, this.unit, (s) => ctx.measureText(s).width);
      ctx.strokeStyle = "#eef0f4";
      ctx.lineWidth = 1;
      for (const v of this.tk.values) {
        const x = Math.round(this.x(v)) + 0.5;
        ctx.beginPath(); ctx.moveTo(x, AXIS - 4); ctx.lineTo(x, this.viewH); ctx.stroke();
      }
    }

    drawAxis() {
      const ctx = this.ctx, tk = this.tk;
      ctx.fillStyle = "#fff";
      ctx.fillRect(0, 0, this.width, AXIS - 1);
      ctx.fillStyle = "#d5d9e0";
      ctx.fillRect(0, AXIS - 1, this.width, 1);
      ctx.font = "10px system-ui, sans-serif";
      ctx.fillStyle = "#555";
      ctx.save();
      ctx.beginPath(); ctx.rect(GUTTER, 0, this.width - GUTTER, AXIS); ctx.clip();
      const drawn = [];
      tk.values.forEach((v, k) => {
        const x = Math.round(this.x(v)) + 0.5;
        ctx.fillRect(x - 0.5, AXIS - 5, 1, 4);
        if (x + 2 + ctx.measureText(tk.labels[k]).width > this.width - 1) return; // a label the edge would cut: its tick only
        ctx.fillText(tk.labels[k], x + 2, 12);
        drawn.push(tk.labels[k]);
      });
      ctx.restore();
      const name = this.unit === "order" ? "order" : `time (${tk.name})`;
      ctx.fillStyle = "#333";
      ctx.fillText(name, 4, 12);
      this.dbg.ticks = { unit: tk.name, labels: drawn, values: tk.values.slice() };
    }

    drawLabels(lanes) {
      const ctx = this.ctx;
      ctx.fillStyle = "#fff";
      ctx.fillRect(0, AXIS, GUTTER - 2, this.viewH);
      for (const L of lanes) {
        const y = this.sy_(L);
        ctx.fillStyle = "#333";
        if (L.type === "title") {
          ctx.font = "bold 11px system-ui, sans-serif";
          ctx.save(); ctx.beginPath(); ctx.rect(0, AXIS, this.width, this.viewH); ctx.clip();
          ctx.fillText(L.P.title, 4, y + 13);
          ctx.restore();
          ctx.font = "10px system-ui, sans-serif";
        } else if (L.type === "ops") {
          ctx.fillStyle = "#222";
          ctx.font = "10px system-ui, sans-serif";
          ctx.fillText((L.collapsed ? "▸ " : "▾ ") + `rank ${L.r}`, 4, y + Math.min(L.h - 1, 15));
        } else if (L.type === "mem") {
          const M = L.P.memory.ranks[L.r], top = this.memTop(M);
          const yp = Math.round(y + L.h - 2 - (M.peak / top) * (L.h - 4));
          ctx.fillStyle = "#778";
          ctx.font = "8px system-ui, sans-serif";
          ctx.fillText("memory", 4, y + 9);
          ctx.fillStyle = "#556";  // the lane's scale: its peak (the faint line across the lane) and 0
          ctx.fillText(fmtMem(M.peak, L.P.memory.unit), 4, Math.max(y + 18, yp + 4));
          ctx.fillText("0", GUTTER - 10, y + L.h - 2);
          ctx.fillRect(GUTTER - 5, yp, 4, 1);
          ctx.fillRect(GUTTER - 5, y + L.h - 2, 4, 1);
        } else {
          ctx.fillStyle = "#778";
          ctx.font = "8px system-ui, sans-serif";
          ctx.fillText({ p2p: "send/recv", coll: "collective", host: "host link", a2a: "all-to-all" }[L.type], 4, y + Math.min(L.h - 1, 15));
        }
      }
      ctx.font = "10px system-ui, sans-serif";
    }

    label(P, i) {
      const name = this.op[P.ops.op[i]];
      return (LETTER[name] || name) + this.mbLabel(P, P.ops.mb[i]);
    }

    mbLabel(P, u) { return P.slices > 1 ? `${Math.floor(u / P.slices)}s${u % P.slices}` : String(u); }
    mbOf(P, u) { return P.slices > 1 ? Math.floor(u / P.slices) : u; }
    color(P, i) { return shade(COLORS[this.op[P.ops.op[i]]] || "#888888", P.chunk[i]); }

    drawOps(L, y0) {
      const { P, r } = L, ctx = this.ctx, O = P.ops;
      const a = P.op_off[r], b = P.op_off[r + 1];
      const overlay = P.kind === "overlay";
      const h = overlay ? (L.h - 4) / 2 : L.h - 4, y = y0 + 2;
      if (this.show.gaps && P.gap_off && !L.collapsed) this.drawGaps(L, y0);
      let i = Math.max(a, lowerBound(O.start, a, b, this.v0) - 2);
      let rx0 = -1, rx1 = -1, rcrit = false;
      const flush = () => {
        if (rx0 < 0) return;
        ctx.fillStyle = "#7d8aa0";
        ctx.fillRect(rx0, y, Math.max(1, rx1 - rx0), h);
        if (rcrit && this.show.critical) { ctx.fillStyle = "#d62728"; ctx.fillRect(rx0, y - 2, Math.max(1, rx1 - rx0), 2); }
        rx0 = -1; rcrit = false;
      };
      for (; i < b; i++) {
        const s = O.start[i];
        if (s > this.v1) break;
        const e = O.end[i];
        if (e < this.v0) continue;
        const x0 = this.x(s), x1 = this.x(e), f = O.flags[i];
        if (x1 - x0 < 1.5) {
          if (rx0 >= 0 && x0 <= rx1 + 1) { rx1 = Math.max(rx1, x1); rcrit = rcrit || (f & CRITICAL) !== 0; continue; }
          flush();
          rx0 = x0; rx1 = Math.max(x1, x0 + 1); rcrit = (f & CRITICAL) !== 0;
          continue;
        }
        flush();
        const name = this.op[O.op[i]];
        ctx.fillStyle = this.color(P, i);
        ctx.fillRect(x0, y, x1 - x0, h);
        if (x1 - x0 > 4) { ctx.strokeStyle = "#fff"; ctx.lineWidth = 1; ctx.strokeRect(x0 + 0.5, y + 0.5, x1 - x0 - 1, h - 1); }
        if (overlay && !Number.isNaN(O.mstart[i])) {
          const m0 = this.x(O.mstart[i]), m1 = this.x(O.mend[i]);
          ctx.fillStyle = COLORS[name] || "#888";
          ctx.fillRect(m0, y + h, Math.max(1, m1 - m0), h);
          ctx.fillStyle = "rgba(20,30,50,0.35)";
          ctx.fillRect(m0, y + h, Math.max(1, m1 - m0), h);
        }
        if ((f & CRITICAL) && this.show.critical) {
          ctx.fillStyle = "#d62728";
          ctx.fillRect(x0, y - 2, x1 - x0, 3);
        }
        if (f & IN_CYCLE) {
          ctx.strokeStyle = "#d62728"; ctx.lineWidth = 3;
          ctx.strokeRect(x0 + 1.5, y + 1.5, x1 - x0 - 3, h - 3);
        }
        if ((f & PAIR_FIRST) && i + 1 < b && !L.collapsed) {
          const x2 = this.x(Math.max(O.end[i + 1], e));
          ctx.strokeStyle = "#7b3294"; ctx.lineWidth = 2;
          ctx.strokeRect(x0 + 1, y + 1, x2 - x0 - 2, h - 2);
          ctx.fillStyle = "#7b3294";
          ctx.fillRect(x0, y + L.h - 5, x2 - x0, 2);
        }
        const lx0 = Math.max(x0, GUTTER), lx1 = Math.min(x1, this.width - RIGHT); // the part in view: at deep
        if (lx1 - lx0 > 20 && !L.collapsed) { // zoom an op wider than the window still says what it is
          ctx.fillStyle = P.chunk[i] === 2 || name === "RECOMPUTE" ? "#123" : "#fff";
          const text = this.label(P, i) + (lx1 - lx0 > 48 ? "." + O.stage[i] : "");
          ctx.fillText(text, lx0 + 3, y + (overlay ? h - 2 : h / 2 + 4));
        }
      }
      flush();
    }

    drawGaps(L, y0) {
      const { P, r } = L, G = P.gaps, ctx = this.ctx;
      const a = P.gap_off[r], b = P.gap_off[r + 1];
      let i = Math.max(a, lowerBound(G.start, a, b, this.v0) - 1);
      ctx.fillStyle = "rgba(214,39,40,0.10)";
      for (; i < b && G.start[i] <= this.v1; i++) {
        const x0 = this.x(G.start[i]), x1 = this.x(G.end[i]);
        if (x1 - x0 >= 2) ctx.fillRect(x0, y0 + 2, x1 - x0, L.h - 4);
      }
    }

    drawMsgs(L, y0) {
      const { P, r } = L, M = P.msgs, ctx = this.ctx;
      const a = P.msg_off[r], b = P.msg_off[r + 1];
      let i = lowerBound(M.send, a, b, this.v0 - P.maxMsg[r]);
      let rx0 = -1, rx1 = -1;
      for (; i < b; i++) {
        const s = M.send[i];
        if (s > this.v1) break;
        const e = M.arrival[i];
        if (e < this.v0) continue;
        const x0 = this.x(s), x1 = Math.max(this.x(e), x0 + 1);
        if (this.visibleMsgs.length <= 4000) this.visibleMsgs.push([P, i]);
        if (x1 - x0 < 1.5) {
          if (rx0 >= 0 && x0 <= rx1 + 1) { rx1 = Math.max(rx1, x1); continue; }
          if (rx0 >= 0) { ctx.fillStyle = "#9fb3c8"; ctx.fillRect(rx0, y0 + 2, rx1 - rx0, L.h - 4); }
          rx0 = x0; rx1 = x1;
          continue;
        }
        ctx.fillStyle = MSG_COLORS[M.kind[i]] || "#ccc";
        ctx.fillRect(x0, y0 + 2, x1 - x0, L.h - 4);
        if ((M.flags[i] & CRITICAL) && this.show.critical) { ctx.fillStyle = "#d62728"; ctx.fillRect(x0, y0 + L.h - 3, x1 - x0, 2); }
      }
      if (rx0 >= 0) { ctx.fillStyle = "#9fb3c8"; ctx.fillRect(rx0, y0 + 2, rx1 - rx0, L.h - 4); }
      // Receives: a tick at each arrival on the receiver's lane.
      const R = M.recv, c = P.recv_off[r], d = P.recv_off[r + 1];
      if (d - c > 0) {
        ctx.fillStyle = "#34495e";
        let lo = c, hi = d;
        while (lo < hi) { const mid = (lo + hi) >>> 1; if (M.arrival[R[mid]] < this.v0) lo = mid + 1; else hi = mid; }
        let last = -10;
        for (let k = lo; k < d; k++) {
          const t = M.arrival[R[k]];
          if (t > this.v1) break;
          const x = this.x(t);
          if (x - last < 1) continue;
          last = x;
          ctx.fillRect(x - 1, y0 + 1, 2, L.h - 2);
        }
      }
    }

    drawArrows() {
      this.dbg.arrows = [];
      if (this.visibleMsgs.length > 3000) return;  // zoomed out: arrows would only hide the ops
      const ctx = this.ctx;
      for (const [P, i] of this.visibleMsgs) {
        const M = P.msgs;
        const from = this.laneOf(P, M.src[i], "p2p"), to = this.laneOf(P, M.dst[i], "ops");
        if (!from || !to) continue;
        this.dbg.arrows.push([this.doc.panels.indexOf(P), i]);
        const x0 = this.x(M.send[i]), x1 = this.x(M.arrival[i]);
        const fy = this.sy_(from), ty = this.sy_(to);
        const y0 = fy + from.h / 2, y1 = ty + (ty > y0 ? 2 : to.h - 2);
        const crit = (M.flags[i] & CRITICAL) && this.show.critical;
        ctx.strokeStyle = crit ? "rgba(214,39,40,0.9)" : "rgba(52,73,94,0.45)";
        ctx.lineWidth = crit ? 1.5 : 1;
        this.arrow(x0, y0, x1, y1);
      }
    }

    arrow(x0, y0, x1, y1) {
      const ctx = this.ctx;
      ctx.beginPath(); ctx.moveTo(x0, y0); ctx.lineTo(x1, y1); ctx.stroke();
      const ang = Math.atan2(y1 - y0, x1 - x0), s = 5;
      ctx.beginPath();
      ctx.moveTo(x1, y1);
      ctx.lineTo(x1 - s * Math.cos(ang - 0.4), y1 - s * Math.sin(ang - 0.4));
      ctx.lineTo(x1 - s * Math.cos(ang + 0.4), y1 - s * Math.sin(ang + 0.4));
      ctx.closePath();
      ctx.fillStyle = ctx.strokeStyle;
      ctx.fill();
    }

    rankOf(P, i) { // op i's rank: a binary search over the rank offsets
      let lo = 0, hi = P.ranks;
      while (lo < hi) { const m = (lo + hi) >>> 1; if (P.op_off[m + 1] <= i) lo = m + 1; else hi = m; }
      return lo;
    }

    opLaneAt(P, i) { return this.laneOf(P, this.rankOf(P, i), "ops"); }

    drawChain(P) {
      const ctx = this.ctx, O = P.ops;
      ctx.strokeStyle = "#d62728";
      ctx.lineWidth = 2;
      for (const w of P.chain) {
        if (w.needs < 0 || w.at < 0) continue;
        const Ln = this.opLaneAt(P, w.needs), La = this.opLaneAt(P, w.at);
        const yn = this.sy_(Ln), ya = this.sy_(La);
        const x0 = this.x((O.start[w.needs] + O.end[w.needs]) / 2), x1 = this.x((O.start[w.at] + O.end[w.at]) / 2);
        const down = ya > yn;
        this.arrow(x0, down ? yn + Ln.h - 2 : yn + 2, x1, down ? ya + 2 : ya + La.h - 2);
      }
    }

    drawSpans(L, y0, S, off) {
      const { r } = L, ctx = this.ctx;
      const a = off[r], b = off[r + 1];
      let last = -10;
      for (let i = Math.max(a, lowerBound(S.start, a, b, this.v0) - 64); i < b; i++) {
        const s = S.start[i], e = S.end[i];
        if (s > this.v1) break;
        if (e < this.v0) continue;
        const x0 = this.x(s), x1 = Math.max(this.x(e), x0 + 1);
        if (x1 < last + 0.5 && x1 - x0 < 1) continue;
        last = x1;
        ctx.fillStyle = COLORS[this.op[S.op[i]]] || "#999";
        ctx.fillRect(x0, y0 + 1, x1 - x0, L.h - 2);
        if (S.flags && (S.flags[i] & CRITICAL) && this.show.critical) { ctx.fillStyle = "#d62728"; ctx.fillRect(x0, y0, x1 - x0, 2); }
      }
    }

    memTop(M) { return Math.max(M.peak, M.host_peak, M.limit || 0, M.host_limit || 0) * 1.08 || 1; }

    /** The polyline of a stepped curve over the window: per pixel column, the vertical span from the least
     * to the greatest value the curve takes in it, then flat at its last value to the next column. Points
     * are [x pixel, value]; consecutive points share x (a riser) or value (a tread). */
    steps(T, V, end) {
      const n = T.length;
      if (!n) return [];
      const tEnd = Math.max(end, T[n - 1]);
      if (this.v0 >= tEnd) return [];
      let i = lowerBound(T, 0, n, this.v0);
      let last = i > 0 ? V[i - 1] : 0;
      const xs = this.x(Math.max(this.v0, i > 0 ? this.v0 : T[0]));
      const pts = [[xs, last]];
      let col = NaN, cx = 0, mn = 0, mx = 0, enter = last;
      const flush = () => {
        if (Number.isNaN(col)) return;
        pts.push([cx, enter]);
        const up = Math.abs(last - mx) < Math.abs(last - mn); // end the riser at the column's last value
        if (up) { pts.push([cx, mn], [cx, mx]); } else { pts.push([cx, mx], [cx, mn]); }
        pts.push([cx, last]);
      };
      for (; i < n && T[i] <= this.v1; i++) {
        const x = this.x(T[i]), c = Math.floor(x);
        if (c !== col) { flush(); col = c; cx = Math.max(x, xs); enter = last; mn = Math.min(enter, V[i]); mx = Math.max(enter, V[i]); }
        else { mn = Math.min(mn, V[i]); mx = Math.max(mx, V[i]); }
        last = V[i];
      }
      flush();
      pts.push([this.x(Math.min(this.v1, tEnd)), last]);
      // drop repeated points (a riser of no height, a tread of no length)
      const out = [pts[0]];
      for (let k = 1; k < pts.length; k++) {
        const q = out[out.length - 1], p = pts[k];
        if (p[0] === q[0] && p[1] === q[1]) continue;
        if (out.length >= 2) { const o = out[out.length - 2]; if ((o[0] === q[0] && q[0] === p[0]) && ((q[1] - o[1]) * (p[1] - q[1]) >= 0)) { out[out.length - 1] = p; continue; } }
        out.push(p);
      }
      return out;
    }

    drawMem(L, y0) {
      const { P, r } = L, M = P.memory.ranks[r], ctx = this.ctx;
      const top = this.memTop(M);
      const yOf = (v) => y0 + L.h - 2 - (v / top) * (L.h - 4);
      ctx.fillStyle = "#f7f8fb";
      ctx.fillRect(GUTTER, y0, this.width, L.h);
      ctx.fillStyle = "#e3e7ee";
      ctx.fillRect(GUTTER, Math.round(yOf(M.peak)), this.width, 1);
      const curve = (T, V, fill, stroke) => {
        const pts = this.steps(T, V, P.makespan);
        if (!pts.length) return pts;
        ctx.beginPath();
        ctx.moveTo(pts[0][0], yOf(pts[0][1]));
        for (let k = 1; k < pts.length; k++) ctx.lineTo(pts[k][0], yOf(pts[k][1]));
        ctx.strokeStyle = stroke; ctx.lineWidth = 1; ctx.stroke();
        if (fill) {
          ctx.lineTo(pts[pts.length - 1][0], yOf(0)); ctx.lineTo(pts[0][0], yOf(0)); ctx.closePath();
          ctx.fillStyle = fill; ctx.fill();
        }
        return pts;
      };
      const dev = curve(M.t, M.v, "rgba(107,143,199,0.35)", "#4a6fa5");
      const host = P.memory.host ? curve(M.ht, M.hv, null, "#e08a2c") : [];
      this.dbg.mem.set(L.p + ":" + r, { device: dev, host });
      for (const [lim, color] of [[M.limit, "#d62728"], [M.host_limit, "#e08a2c"]]) {
        if (lim === null || lim === undefined) continue;
        ctx.setLineDash([4, 3]);
        ctx.strokeStyle = color;
        ctx.beginPath(); ctx.moveTo(GUTTER, yOf(lim) + 0.5); ctx.lineTo(this.width, yOf(lim) + 0.5); ctx.stroke();
        ctx.setLineDash([]);
      }
    }

    // ---- the overview strip --------------------------------------------------------------------------------

    drawOverview() {
      const ctx = this.octx, w = this.width, H = 34;
      if (!this.density) {
        const bins = Math.max(1, Math.floor(w - GUTTER - RIGHT)), d = new Float64Array(bins);
        const span = this.full[1] - this.full[0], bw = span / bins;
        let ranks = 0;
        for (const P of this.doc.panels) {
          ranks += P.ranks;
          const O = P.ops;
          for (let i = 0; i < O.start.length; i++) {
            const s = O.start[i], e = O.end[i];
            let k = Math.max(0, Math.floor(s / bw));
            const k1 = Math.min(bins - 1, Math.floor(e / bw));
            for (; k <= k1; k++) d[k] += Math.max(0, Math.min(e, (k + 1) * bw) - Math.max(s, k * bw));
          }
        }
        for (let k = 0; k < bins; k++) d[k] /= Math.max(1, ranks) * bw;
        this.density = d;
      }
      ctx.clearRect(0, 0, w, H);
      ctx.fillStyle = "#f3f5f9";
      ctx.fillRect(GUTTER, 0, w - GUTTER - RIGHT, H);
      ctx.fillStyle = "#8797b2";
      const d = this.density;
      for (let k = 0; k < d.length; k++) { const hh = Math.min(1, d[k]) * (H - 6); ctx.fillRect(GUTTER + k, H - 3 - hh, 1, hh); }
      ctx.fillStyle = "#556";
      ctx.font = "10px system-ui, sans-serif";
      ctx.fillText("overview", 4, 14);
      ctx.fillText("(busy share)", 4, 26);
      const span = this.full[1] - this.full[0], W = w - GUTTER - RIGHT;
      const a = GUTTER + Math.max(0, (this.v0 - this.full[0]) / span) * W, b = GUTTER + Math.min(1, (this.v1 - this.full[0]) / span) * W;
      ctx.fillStyle = "rgba(30,60,120,0.12)";
      ctx.fillRect(a, 0, Math.max(2, b - a), H);
      ctx.strokeStyle = "#1e3c78";
      ctx.lineWidth = 1.5;
      ctx.strokeRect(a + 0.5, 1, Math.max(2, b - a) - 1, H - 2);
    }

    // ---- selection, dependencies, search ------------------------------------------------------------------

    index(P) { // (kind, unit, stage) -> op index, built on the first selection
      if (P.keyIndex) return P.keyIndex;
      const O = P.ops, kindOf = this.doc.kind_of, S = P.stages + 1, U = P.maxMb + 2, m = new Map();
      for (let i = O.op.length - 1; i >= 0; i--) {
        const k = kindOf[O.op[i]];
        if (k >= 0) m.set((k * S + O.stage[i]) * U + O.mb[i], i);
      }
      P.keyIndex = { m, S, U };
      return P.keyIndex;
    }

    find(P, k, u, s) {
      const X = this.index(P);
      if (s < 0 || s >= P.stages || u < 0 || u > P.maxMb) return -1;
      const j = X.m.get((k * X.S + s) * X.U + u);
      return j === undefined ? -1 : j;
    }

    /** The stages across a rule's stage offset d from stage s (pipec.ir.rules._across): s itself (0); on a
     * graph its inputs (d < 0) or consumers (d > 0); on the chain s + d. */
    across(P, s, d) {
      if (d === 0) return [s];
      if (P.graph) return (d < 0 ? P.ins[s] : P.outs[s]) || [];
      return s + d >= 0 && s + d < P.stages ? [s + d] : [];
    }

    /** The ops op i needs and the ops that need it, by the panel's rules (pipec.ir.rules) over its graph. */
    relations(P, i) {
      const k = this.doc.kind_of[P.ops.op[i]], u = P.ops.mb[i], s = P.ops.stage[i];
      const slices = P.slices || 1, j = u % slices, deps = [], dependents = [];
      if (k < 0 || !P.rules) return { deps, dependents };
      for (const [kind, needs, ds, du] of P.rules) {
        if (kind === k && j + du >= 0 && j + du < slices) {
          for (const t of this.across(P, s, ds)) { const x = this.find(P, needs, u + du, t); if (x >= 0) deps.push(x); }
        }
        if (needs === k && j - du >= 0 && j - du < slices) {
          for (const t of this.across(P, s, -ds)) { const x = this.find(P, kind, u - du, t); if (x >= 0) dependents.push(x); }
        }
      }
      return { deps, dependents };
    }

    /** A message's edge, `0 → 3` (its producer first), on a graph; "" on the chain (its neighbour). */
    edgeOf(P, j) {
      const M = P.msgs;
      if (!M.to || M.to[j] < 0) return "";
      const a = M.kind[j] === 0 ? M.stage[j] : M.to[j], b = M.kind[j] === 0 ? M.to[j] : M.stage[j];
      return ` along edge ${a} → ${b}`;
    }

    select(p, i) {
      if (p === null || p === undefined || i < 0) { this.sel = null; this.renderDetail(); this.legend(); this.request(); return; }
      const P = this.doc.panels[p], O = P.ops;
      const { deps, dependents } = this.relations(P, i);
      const want = this.mbOf(P, O.mb[i]), mb = [];
      for (let j = 0; j < O.mb.length; j++) if (this.mbOf(P, O.mb[j]) === want) mb.push(j);
      this.sel = { p, i, deps, dependents, mb };
      this.renderDetail();
      this.legend();
      this.request();
      return this.sel;
    }

    /** Why op i starts when it does: the event that ends as it starts (its rank's gap attribution), or the
     * op before it on its rank. */
    whyHere(P, i) {
      if (P.kind === "deadlock") return null;
      const O = P.ops, r = O.rank[i], G = P.gaps, a = P.gap_off[r], b = P.gap_off[r + 1], eps = 1e-6 * (P.makespan || 1);
      const g = lowerBound(G.end, a, b, O.start[i] - eps);
      if (g < b && Math.abs(G.end[g] - O.start[i]) <= eps) {
        const k = G.wkind[g], j = G.widx[g];
        if (k === 1) {
          const M = P.msgs, dep = this.find(P, this.doc.kind_of[P.ops.op[i]] === 0 ? 0 : 1, M.mb[j], M.stage[j]);
          return { text: `why here: it waited ${fmtTime(G.end[g] - G.start[g], P.unit)} for the ${M.kind[j] === 0 ? "activation" : "gradient"} of micro-batch ${this.mbLabel(P, M.mb[j])} from rank ${M.src[j]} (stage ${M.stage[j]}${this.edgeOf(P, j)}), arriving at ${fmtTime(M.arrival[j], P.unit)}`, op: dep };
        }
        if (k === 0) return { text: `why here: it waited for ${this.label(P, j)}.${O.stage[j]} on rank ${O.rank[j]}`, op: j };
        if (k === 2) return { text: `why here: it waited for a collective (${NAME[this.op[P.colls.op[j]]] || this.op[P.colls.op[j]]})`, op: -1 };
        if (k === 3) return { text: `why here: it waited for the host link (${NAME[this.op[P.host.op[j]]] || this.op[P.host.op[j]]})`, op: -1 };
        return { text: "why here: the rank was idle; nothing in the timeline ends as it starts", op: -1 };
      }
      if (i > P.op_off[r]) return { text: `why here: it follows ${this.label(P, i - 1)}.${O.stage[i - 1]} on its rank, with no wait`, op: i - 1 };
      return { text: "why here: the first op of its rank, at the step's start", op: -1 };
    }

    /** Ops matching a query: `F3` / `B(3, 1)` (kind, micro-batch, stage), `mb 3`, `stage 2`, `rank 1`,
     * `path:17` or `:17` or `line 17` (the source line), else text in the op's source line. */
    matchesOf(q) {
      q = q.trim();
      const out = [];
      if (!q) return out;
      let test = null, m;
      const src = this.doc.sources;
      if ((m = q.match(/^([FBWR])\s*\(?\s*(\d+)(?:\s*[,.]\s*(?:stage\s*)?(\d+))?\s*\)?$/i))) {
        const op = { F: "FWD", B: "BWD", W: "WGRAD", R: "RECOMPUTE" }[m[1].toUpperCase()];
        const mb = +m[2], st = m[3] === undefined ? -1 : +m[3];
        test = (P, i) => this.op[P.ops.op[i]] === op && this.mbOf(P, P.ops.mb[i]) === mb && (st < 0 || P.ops.stage[i] === st);
      } else if ((m = q.match(/^(?:mb|micro-?batch|m)\s*[= ]?\s*(\d+)$/i))) {
        const mb = +m[1]; test = (P, i) => this.mbOf(P, P.ops.mb[i]) === mb;
      } else if ((m = q.match(/^(?:stage|s)\s*[= ]?\s*(\d+)$/i))) {
        const st = +m[1]; test = (P, i) => P.ops.stage[i] === st;
      } else if ((m = q.match(/^(?:rank|r)\s*[= ]?\s*(\d+)$/i))) {
        const rk = +m[1]; test = (P, i) => P.ops.rank[i] === rk;
      } else if ((m = q.match(/^(.*?)(?::|\bline\s*)(\d+)$/i))) {
        const path = m[1].trim(), line = +m[2];
        const ok = new Set(src.map((s, k) => [s, k]).filter(([s]) => s[1] === line && (!path || s[0].endsWith(path))).map(([, k]) => k));
        test = (P, i) => ok.has(P.ops.src[i]);
      } else {
        const low = q.toLowerCase();
        const ok = new Set(src.map((s, k) => [s, k]).filter(([s]) => `${s[0]}:${s[1]}: ${s[2]}`.toLowerCase().includes(low)).map(([, k]) => k));
        test = (P, i) => ok.has(P.ops.src[i]);
      }
      this.doc.panels.forEach((P, p) => { for (let i = 0; i < P.ops.op.length; i++) if (test(P, i)) out.push([p, i]); });
      return out;
    }

    search(q, quiet) {
      this.matches = this.matchesOf(q);
      this.matchAt = -1;
      this.matchSet = new Set(this.matches.map(([p, i]) => p + ":" + i));
      this.legend();
      this.searchCount.textContent = q.trim() ? `${this.matches.length.toLocaleString()} ops` + (this.matches.length ? " (Enter: next)" : "") : "";
      if (!quiet && this.matches.length === 0) this.searchCount.textContent = "no op matches";
      this.request();
      return this.matches.length;
    }

    nextMatch(dir) {
      if (!this.matches.length) return null;
      this.matchAt = (this.matchAt + dir + this.matches.length) % this.matches.length;
      const [p, i] = this.matches[this.matchAt];
      this.select(p, i);
      this.reveal(p, i);
      this.searchCount.textContent = `${this.matchAt + 1} of ${this.matches.length.toLocaleString()} ops`;
      return [p, i];
    }

    /** Bring op i of panel p into view: its rank's rows scrolled to, the window moved (and zoomed in
     * when the op would be under a few pixels wide). */
    reveal(p, i) {
      const P = this.doc.panels[p], O = P.ops;
      const s = O.start[i], e = O.end[i];
      let span = this.v1 - this.v0;
      if ((e - s) / span * (this.width - GUTTER) < 6) span = Math.max((e - s) * 40, 1e-7 * (this.full[1] - this.full[0]));
      if (s < this.v0 || e > this.v1 || span !== this.v1 - this.v0) { this.v0 = (s + e) / 2 - span / 2; this.v1 = this.v0 + span; }
      this.scrollToRank(p, this.rankOf(P, i));
    }

    scrollToRank(p, r) {
      const L = this.laneMap.get(p + ":" + r + ":ops");
      if (!L) return;
      const top = L.y, bottom = L.y + 80;
      if (top < this.sy || bottom > this.sy + this.viewH - AXIS) this.wrap.scrollTop = Math.max(0, top - 30);
      this.sy = Math.min(this.wrap.scrollTop, Math.max(0, AXIS + this.height - this.viewH));
      this.draw();
    }

    drawHighlights(lanes) {
      const ctx = this.ctx, drawn = { selected: -1, deps: [], dependents: [], mb: [], matches: 0 };
      const visible = new Set(lanes.filter((L) => L.type === "ops").map((L) => L.p + ":" + L.r));
      const box = (P, p, i, color, width, fill) => {
        const r = P.ops.rank[i];
        if (!visible.has(p + ":" + r)) return false;
        const L = this.laneMap.get(p + ":" + r + ":ops"), y = this.sy_(L) + 2, h = L.h - 4;
        const s = P.ops.start[i], e = P.ops.end[i];
        if (e < this.v0 || s > this.v1) return false;
        let x0 = this.x(s), x1 = this.x(e);
        if (x1 - x0 < 3) { const c = (x0 + x1) / 2; x0 = c - 1.5; x1 = c + 1.5; }
        if (fill) { ctx.fillStyle = this.color(P, i); ctx.fillRect(x0, y, x1 - x0, h); }
        ctx.strokeStyle = color; ctx.lineWidth = width;
        ctx.strokeRect(x0 + width / 2, y + width / 2, Math.max(1, x1 - x0 - width), h - width);
        const lx0 = Math.max(x0, GUTTER), lx1 = Math.min(x1, this.width - RIGHT);
        if (fill && lx1 - lx0 > 20 && !L.collapsed) { // the label again, over the fill (as drawOps writes it)
          ctx.fillStyle = P.chunk[i] === 2 || this.op[P.ops.op[i]] === "RECOMPUTE" ? "#123" : "#fff";
          ctx.font = "10px system-ui, sans-serif";
          ctx.fillText(this.label(P, i) + (lx1 - lx0 > 48 ? "." + P.ops.stage[i] : ""), lx0 + 3 + width / 2, y + h / 2 + 4);
        }
        return true;
      };
      if (this.matches.length) {
        let k = 0;
        for (const [p, i] of this.matches) { if (k > 20000) break; if (box(this.doc.panels[p], p, i, MATCH, 2, false)) { k++; } }
        drawn.matches = k;
      }
      if (this.sel) {
        const { p, i, deps, dependents, mb } = this.sel, P = this.doc.panels[p];
        // everything else fades: a wash over the visible compute lanes, then the micro-batch redrawn
        ctx.fillStyle = "rgba(255,255,255,0.6)";
        for (const L of lanes) if (L.type === "ops" && L.p === p) ctx.fillRect(GUTTER, this.sy_(L), this.width, L.h);
        for (const j of mb) if (j !== i && box(P, p, j, "#333", 1, true)) drawn.mb.push(j);
        const centre = (j) => {
          const L = this.laneMap.get(p + ":" + P.ops.rank[j] + ":ops");
          return [this.x((Math.max(P.ops.start[j], this.v0) + Math.min(P.ops.end[j], this.v1)) / 2), this.sy_(L) + L.h / 2];
        };
        for (const j of deps) if (box(P, p, j, DEP, 3, true)) drawn.deps.push(j);
        for (const j of dependents) if (box(P, p, j, DEPENDENT, 3, true)) drawn.dependents.push(j);
        if (box(P, p, i, SELECTED, 3, true)) drawn.selected = i;
        ctx.lineWidth = 2;
        const [xi, yi] = centre(i);
        for (const j of deps) { const [x, y] = centre(j); ctx.strokeStyle = DEP; this.arrow(Math.min(x, this.x(P.ops.end[j])), y, this.x(P.ops.start[i]), yi); }
        for (const j of dependents) { const [x, y] = centre(j); ctx.strokeStyle = DEPENDENT; this.arrow(this.x(P.ops.end[i]), yi, Math.max(this.x(P.ops.start[j]), Math.min(x, xi + 4)), y); }
      }
      this.dbg.highlight = drawn;
    }

    // ---- interaction ---------------------------------------------------------------------------------

    bindEvents() {
      const c = this.canvas;
      c.addEventListener("wheel", (ev) => {
        ev.preventDefault();
        const rect = c.getBoundingClientRect();
        const px = ev.clientX - rect.left;
        if (ev.shiftKey || px < GUTTER) { this.wrap.scrollTop += ev.deltaY || ev.deltaX; return; }
        const tm = this.t(px);
        const k = Math.exp(Math.max(-1, Math.min(1, ev.deltaY * 0.0015)));
        this.zoom(tm, k);
      }, { passive: false });
      this.wrap.addEventListener("scroll", () => { this.sy = this.wrap.scrollTop; this.request(); });
      let drag = null;
      c.addEventListener("mousedown", (ev) => { drag = { x: ev.clientX, y: ev.clientY, v0: this.v0, v1: this.v1, moved: false }; c.classList.add("drag"); });
      this.onUp = (ev) => {
        if (drag && !drag.moved && ev.target === c) this.click(ev);
        drag = null; c.classList.remove("drag");
      };
      window.addEventListener("mouseup", this.onUp);
      c.addEventListener("mousemove", (ev) => {
        const rect = c.getBoundingClientRect();
        if (drag) {
          if (Math.abs(ev.clientX - drag.x) + Math.abs(ev.clientY - drag.y) > 3) drag.moved = true;
          if (!drag.moved) return;
          const dt = (ev.clientX - drag.x) / (this.width - GUTTER - RIGHT) * (drag.v1 - drag.v0);
          this.v0 = drag.v0 - dt; this.v1 = drag.v1 - dt;
          this.tip.style.display = "none";
          this.request();
          return;
        }
        this.hover(ev.clientX - rect.left, ev.clientY - rect.top);
      });
      c.addEventListener("mouseleave", () => { this.tip.style.display = "none"; });
      c.addEventListener("dblclick", () => { [this.v0, this.v1] = this.full; this.request(); });
      let odrag = false;
      const ov = (ev) => {
        const rect = this.overview.getBoundingClientRect(), W = this.width - GUTTER - RIGHT;
        const t = this.full[0] + (ev.clientX - rect.left - GUTTER) / W * (this.full[1] - this.full[0]), span = this.v1 - this.v0;
        this.v0 = t - span / 2; this.v1 = t + span / 2;
        this.request();
      };
      this.overview.addEventListener("mousedown", (ev) => { odrag = true; ov(ev); });
      this.overview.addEventListener("mousemove", (ev) => { if (odrag) ov(ev); });
      this.onOvUp = () => { odrag = false; };
      window.addEventListener("mouseup", this.onOvUp);
      this.onKey = (ev) => this.key(ev);
      window.addEventListener("keydown", this.onKey);
      this.onResize = () => { this.resize(); this.draw(); };
      window.addEventListener("resize", this.onResize);
    }

    destroy() {
      window.removeEventListener("resize", this.onResize);
      window.removeEventListener("keydown", this.onKey);
      window.removeEventListener("mouseup", this.onUp);
      window.removeEventListener("mouseup", this.onOvUp);
    }

    key(ev) {
      const t = ev.target;
      if (t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.tagName === "SELECT" || t.isContentEditable)) return;
      if (ev.ctrlKey || ev.metaKey || ev.altKey) return;
      const span = this.v1 - this.v0, mid = (this.v0 + this.v1) / 2;
      const k = ev.key;
      if (k === "w" || k === "W" || k === "+" || k === "=") this.zoom(mid, 0.7);
      else if (k === "s" || k === "S" || k === "-" || k === "_") this.zoom(mid, 1 / 0.7);
      else if (k === "a" || k === "A" || k === "ArrowLeft") { this.v0 -= span * 0.15; this.v1 -= span * 0.15; this.request(); }
      else if (k === "d" || k === "D" || k === "ArrowRight") { this.v0 += span * 0.15; this.v1 += span * 0.15; this.request(); }
      else if (k === "ArrowDown") this.wrap.scrollTop += 60;
      else if (k === "ArrowUp") this.wrap.scrollTop -= 60;
      else if (k === "PageDown") this.wrap.scrollTop += this.viewH * 0.8;
      else if (k === "PageUp") this.wrap.scrollTop -= this.viewH * 0.8;
      else if (k === "0" || k === "Home") { [this.v0, this.v1] = this.full; this.request(); }
      else if (k === "Escape") this.select(null);
      else if (k === "/") { this.searchBox.focus(); }
      else if (k === "n" && this.matches.length) this.nextMatch(ev.shiftKey ? -1 : 1);
      else return;
      ev.preventDefault();
    }

    click(ev) {
      const rect = this.canvas.getBoundingClientRect(), px = ev.clientX - rect.left, py = ev.clientY - rect.top;
      const L = this.laneAt(py);
      if (L && px < GUTTER && L.type === "ops") { // the label: fold or unfold the rank
        const key = L.p + ":" + L.r;
        if (this.collapsed.has(key)) this.collapsed.delete(key); else this.collapsed.add(key);
        this.layout(); this.draw();
        return;
      }
      if (!L || L.type !== "ops") return;
      const i = this.opAt(L, px, py);
      if (i >= 0) this.select(L.p, i); else this.select(null);
    }

    zoom(tm, k) {
      const span = Math.min(Math.max((this.v1 - this.v0) * k, 1e-7 * (this.full[1] - this.full[0])), 50 * (this.full[1] - this.full[0]));
      const f = (tm - this.v0) / (this.v1 - this.v0);
      this.v0 = tm - f * span;
      this.v1 = this.v0 + span;
      this.request();
    }

    /** Show the window [v0, v1] and draw now; returns the milliseconds the draw took. */
    setWindow(v0, v1) { this.v0 = v0; this.v1 = v1; return this.draw(); }

    request() {
      if (this.dirty) return;
      this.dirty = true;
      requestAnimationFrame(() => { this.dirty = false; this.draw(); });
    }

    laneAt(py) {
      if (py < AXIS) return null;
      const y = py - AXIS + this.sy;
      let a = 0, b = this.lanes.length;
      while (a < b) { const m = (a + b) >>> 1; if (this.lanes[m].y + this.lanes[m].h <= y) a = m + 1; else b = m; }
      const L = this.lanes[a];
      return L && y >= L.y && y < L.y + L.h ? L : null;
    }

    opAt(L, px, py) {
      const { P, r } = L, tm = this.t(px), slack = (this.v1 - this.v0) / (this.width - GUTTER) * 3;
      const O = P.ops, a = P.op_off[r], b = P.op_off[r + 1];
      const measured = P.kind === "overlay" && py > this.sy_(L) + L.h / 2;
      const S = measured ? O.mstart : O.start, E = measured ? O.mend : O.end;
      let best = -1;
      const i0 = Math.max(a, lowerBound(O.start, a, b, tm - Math.max(slack, 0)) - 3);
      for (let i = i0; i < b && O.start[i] <= tm + slack + (measured ? P.makespan : 0); i++) {
        if (S[i] - slack <= tm && tm <= E[i] + slack) { best = i; if (S[i] <= tm && tm <= E[i]) break; }
      }
      return best;
    }

    hover(px, py) {
      const L = this.laneAt(py);
      if (!L || px < GUTTER || L.type === "title") { this.tip.style.display = "none"; return; }
      const lines = this.describe(L, px, py);
      if (!lines) { this.tip.style.display = "none"; return; }
      this.tip.textContent = "";
      for (const [cls, text, role] of lines) {
        const d = el("div", cls, text);
        if (role) d.dataset.role = role;
        this.tip.appendChild(d);
      }
      this.tip.style.display = "block";
      const left = Math.min(px + 14, this.width - this.tip.offsetWidth - 4);
      this.tip.style.left = Math.max(0, left) + "px";
      this.tip.style.top = (py + 16) + "px";
    }

    /** The tooltip's lines for the point (px, py) of lane L: [class, text, role]. */
    describe(L, px, py) {
      const { P, r } = L, tm = this.t(px), slack = (this.v1 - this.v0) / (this.width - GUTTER) * 3, u = P.unit;
      if (L.type === "ops") {
        const best = this.opAt(L, px, py);
        if (best < 0) return this.describeGap(P, r, tm);
        return this.describeOp(P, best, P.kind === "overlay" && py > this.sy_(L) + L.h / 2);
      }
      if (L.type === "p2p") {
        const M = P.msgs, a = P.msg_off[r], b = P.msg_off[r + 1];
        for (let i = lowerBound(M.send, a, b, tm - P.maxMsg[r] - slack); i < b && M.send[i] <= tm + slack; i++) {
          if (M.send[i] - slack <= tm && tm <= M.arrival[i] + slack) return this.describeMsg(P, i);
        }
        return null;
      }
      if (L.type === "coll" || L.type === "host" || L.type === "a2a") {
        const S = { coll: P.colls, host: P.host, a2a: P.a2a }[L.type];
        const off = { coll: P.coll_off, host: P.host_off, a2a: P.a2a_off }[L.type];
        for (let i = Math.max(off[r], lowerBound(S.start, off[r], off[r + 1], tm - slack) - 64); i < off[r + 1]; i++) {
          if (S.start[i] - slack <= tm && tm <= S.end[i] + slack) {
            const mb = S.mb ? ` micro-batch ${this.mbLabel(P, S.mb[i])}` : "";
            const name = this.op[S.op[i]];
            return [["", `${NAME[name] || name}${mb} stage ${S.stage[i]} (rank ${r})`, "what"],
              ["", `start ${fmtTime(S.start[i], u)}  duration ${fmtTime(S.end[i] - S.start[i], u)}`, "time"]];
          }
        }
        return null;
      }
      if (L.type === "mem") {
        const M = P.memory.ranks[r];
        const at = (T, V) => { const i = lowerBound(T, 0, T.length, tm + 1e-12) - 1; return i >= 0 ? V[i] : 0; };
        const out = [["", `rank ${r} memory at ${fmtTime(tm, u)}`, "what"],
          ["", `device ${fmtMem(at(M.t, M.v), P.memory.unit)} (peak ${fmtMem(M.peak, P.memory.unit)}` +
            (M.limit !== null ? `, limit ${fmtMem(M.limit, P.memory.unit)})` : ", no limit)"), "device"]];
        if (P.memory.host) out.push(["", `host ${fmtMem(at(M.ht, M.hv), P.memory.unit)}`, "host"]);
        return out;
      }
      return null;
    }

    describeOp(P, i, measured) {
      const O = P.ops, name = this.op[O.op[i]], u = O.mb[i], U = P.unit;
      const mb = P.slices > 1 ? `micro-batch ${Math.floor(u / P.slices)}  slice ${u % P.slices}` : `micro-batch ${u}`;
      const chunk = P.maxChunk > 0 ? `  chunk ${P.chunk[i]}` : "";
      const lines = [["", `${NAME[name] || name}  ${mb}  stage ${O.stage[i]}${chunk}  (rank ${O.rank[i]})`, "what"]];
      if (P.kind === "deadlock") lines.push(["", `position ${Math.round(O.start[i] - O.start[P.op_off[O.rank[i]]])} in its rank's order`, "time"]);
      else lines.push(["", `start ${fmtTime(O.start[i], U)}  duration ${fmtTime(O.end[i] - O.start[i], U)}${measured ? " (simulated)" : ""}`, "time"]);
      if (P.kind === "overlay") {
        const ms = O.mstart[i], me = O.mend[i];
        if (Number.isNaN(ms)) lines.push(["err", "measured: no such op in the run", "measured"]);
        else {
          const err = (me - ms) - (O.end[i] - O.start[i]);
          const rel = (O.end[i] - O.start[i]) > 0 ? ` (${err >= 0 ? "+" : ""}${(100 * err / (O.end[i] - O.start[i])).toFixed(1)}%)` : "";
          lines.push(["", `measured: start ${fmtTime(ms, U)}  duration ${fmtTime(me - ms, U)}`, "measured"]);
          lines.push([Math.abs(err) > 0.1 * (O.end[i] - O.start[i]) ? "err" : "", `error: duration ${err >= 0 ? "+" : "-"}${fmtTime(Math.abs(err), U)}${rel}, start ${ms - O.start[i] >= 0 ? "+" : "-"}${fmtTime(Math.abs(ms - O.start[i]), U)}`, "error"]);
        }
      }
      const f = O.flags[i];
      if (f & PAIR_FIRST) lines.push(["", "overlapped (&) with the next op", "pair"]);
      if (f & PAIR_SECOND) lines.push(["", "overlapped (&) with the op before", "pair"]);
      if (f & CRITICAL) lines.push(["err", "on the critical path", "critical"]);
      if (f & IN_CYCLE) lines.push(["err", "in the wait cycle (deadlock)", "cycle"]);
      const s = O.src[i];
      if (s >= 0) {
        const [path, line, text] = this.doc.sources[s];
        lines.push(["src", `${path}:${line}: ${text}`, "source"]);
      } else lines.push(["", "source line: unknown", "source"]);
      return lines;
    }

    describeMsg(P, i) {
      const M = P.msgs, u = P.unit;
      const what = M.kind[i] === 0 ? "activation" : "gradient";
      return [["", `${what} of micro-batch ${this.mbLabel(P, M.mb[i])} from stage ${M.stage[i]}${this.edgeOf(P, i)}: rank ${M.src[i]} → rank ${M.dst[i]}`, "what"],
        ["", `sent ${fmtTime(M.send[i], u)}  arrives ${fmtTime(M.arrival[i], u)}  (in flight ${fmtTime(M.arrival[i] - M.send[i], u)})`, "time"]];
    }

    describeGap(P, r, tm) {
      const G = P.gaps, a = P.gap_off[r], b = P.gap_off[r + 1], u = P.unit;
      const i = lowerBound(G.start, a, b, tm + 1e-12) - 1;
      if (i < a || tm > G.end[i]) return null;
      const out = [["", `rank ${r} idle  ${fmtTime(G.start[i], u)} → ${fmtTime(G.end[i], u)}  (${fmtTime(G.end[i] - G.start[i], u)})`, "what"]];
      const k = G.wkind[i], j = G.widx[i];
      if (k === 1) {
        const M = P.msgs;
        out.push(["", `waits for the ${M.kind[j] === 0 ? "activation" : "gradient"} of micro-batch ${this.mbLabel(P, M.mb[j])} ` +
          `(stage ${M.stage[j]}${this.edgeOf(P, j)}) from rank ${M.src[j]}, which arrives at ${fmtTime(M.arrival[j], u)}`, "waits"]);
      } else if (k === 0) {
        out.push(["", `waits for ${this.label(P, j)}.${P.ops.stage[j]} on rank ${P.ops.rank[j]}, which ends at ${fmtTime(P.ops.end[j], u)}`, "waits"]);
      } else if (k === 2) out.push(["", `waits for a collective (${NAME[this.op[P.colls.op[j]]] || this.op[P.colls.op[j]]}), which ends at ${fmtTime(P.colls.end[j], u)}`, "waits"]);
      else if (k === 3) out.push(["", `waits for the host link (${NAME[this.op[P.host.op[j]]] || this.op[P.host.op[j]]}), which ends at ${fmtTime(P.host.end[j], u)}`, "waits"]);
      else out.push(["", "waits for: not explained by the timeline", "waits"]);
      return out;
    }

    /** Where op i of panel p is drawn (page coordinates of its centre; cx, cy: on the canvas), its rank's
     * rows scrolled into view first; for tests and the benchmark. */
    opPoint(p, i) {
      const P = this.doc.panels[p];
      this.scrollToRank(p, this.rankOf(P, i));
      const L = this.opLaneAt(P, i);
      const rect = this.canvas.getBoundingClientRect();
      const x = (Math.max(this.x(P.ops.start[i]), GUTTER) + Math.min(this.x(P.ops.end[i]), this.width - RIGHT)) / 2;
      const cy = this.sy_(L) + 6;
      return { x: rect.left + window.scrollX + x, y: rect.top + window.scrollY + cy, cx: x, cy };
    }
  }

  let current = null;

  async function boot(root, doc) {
    const t0 = performance.now();
    const data = await decode(doc);
    if (current) current.destroy();
    current = new View(root, data);
    window.pipecView = current;
    window.pipecLoadMs = performance.now() - t0;
    root.dataset.ready = "1";
    return current;
  }

  /** What the last draw drew, for tests: the tick labels, each visible rank's memory polyline ([x, value]
   * points), the highlighted ops, the messages drawn as arrows. memory(p, r) scrolls rank r of panel p into view and draws first. */
  window.pipecDebug = {
    ticks: () => current && current.dbg.ticks,
    memory: (p, r) => { if (!current) return null; current.scrollToRank(p, r); const m = current.dbg.mem.get(p + ":" + r); return m || null; },
    highlight: () => current && current.dbg.highlight,
    arrows: () => current && current.dbg.arrows,  // the messages drawn as arrows: [panel, message index]
    selection: () => current && current.sel && { p: current.sel.p, i: current.sel.i, deps: current.sel.deps, dependents: current.sel.dependents },
  };

  return { boot, decode, lowerBound, ticks, fmtTime };
})();
