/* pipec view: timelines of pipeline schedules on a <canvas>. No build step, no dependencies.
 *
 * The data (pipec/view/html.py) holds columns as deflated little-endian typed arrays in base64; events are
 * sorted by rank and start, so the visible window of a lane is found by binary search, and events narrower
 * than a pixel are merged into one rectangle (level of detail): a million ops pan and zoom smoothly.
 */
"use strict";
const PipecView = (() => {
  const TYPED = { f4: Float32Array, i4: Int32Array, i2: Int16Array, u1: Uint8Array };
  const CRITICAL = 1, PAIR_FIRST = 2, PAIR_SECOND = 4, IN_CYCLE = 8;
  const COLORS = { FWD: "#4c78a8", BWD: "#54a24b", WGRAD: "#f58518", RECOMPUTE: "#9ecae9",
    REDUCE_GRAD: "#b279a2", UNSHARD: "#72b7b2", RESHARD: "#bab0ac", OFFLOAD: "#9d755d", RELOAD: "#c9a66b" };
  const LETTER = { FWD: "F", BWD: "B", WGRAD: "W", RECOMPUTE: "R" };
  const MSG_COLORS = ["#a6c8e8", "#a9d69f"];
  const GUTTER = 74, AXIS = 22;

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

  function fmt(x) {
    if (x === null || x === undefined || Number.isNaN(x)) return "-";
    const a = Math.abs(x);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return x.toExponential(3);
    return String(+x.toPrecision(5));
  }

  function fmtMem(x, unit) {
    if (unit !== "bytes") return fmt(x) + " units";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(x) >= 1024 && i < u.length - 1) { x /= 1024; i++; }
    return (+x.toPrecision(4)) + " " + u[i];
  }

  function niceStep(raw) {
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / p;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * p;
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  class View {
    constructor(root, doc) {
      this.root = root;
      this.doc = doc;
      this.op = doc.opcodes;
      this.show = { arrows: true, critical: true, gaps: true, memory: true };
      root.textContent = "";
      root.classList.add("pv-root");
      this.build();
      this.layout();
      const end = Math.max(1e-12, ...doc.panels.map((p) => p.makespan + (p.kind === "overlay" ? 0 : 0)),
        ...doc.panels.map((p) => p.measured_makespan || 0));
      this.full = [0, end * 1.02];
      this.v0 = this.full[0];
      this.v1 = this.full[1];
      this.dirty = false;
      this.draw();
    }

    build() {
      const doc = this.doc, root = this.root;
      const head = el("div", "pv-head");
      head.appendChild(el("h1", null, doc.title));
      for (const P of doc.panels) {
        const s = el("div", "pv-summary");
        s.dataset.role = "summary";
        let text = `${P.title}: makespan ${fmt(P.makespan)}`;
        if (P.kind === "deadlock") text = `${P.title}: each rank's ops in order; the wait cycle in red`;
        else if (P.critical_length !== undefined) text += `; critical path ${fmt(P.critical_length)}`;
        if (P.kind === "overlay") {
          text += ` | measured makespan ${fmt(P.measured_makespan)}; ${P.matched} ops matched; ` +
            `mean |duration error| ${fmt(P.mean_abs_error)}`;
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
      bar.appendChild(reset);
      bar.appendChild(el("span", "pv-hint", "wheel: zoom · drag: pan · hover: details"));
      root.appendChild(bar);
      const legend = el("div", "pv-legend");
      const items = [["F", COLORS.FWD], ["B", COLORS.BWD], ["W", COLORS.WGRAD], ["recompute", COLORS.RECOMPUTE],
        ["activation msg", MSG_COLORS[0]], ["gradient msg", MSG_COLORS[1]], ["collective", COLORS.REDUCE_GRAD],
        ["host link", COLORS.OFFLOAD], ["critical path", "#d62728"], ["idle gap", "rgba(214,39,40,0.15)"],
        ["overlapped pair (&)", "#7b3294"], ["memory (device)", "#6b8fc7"], ["host pool", "#e08a2c"]];
      if (this.doc.panels.some((p) => p.kind === "overlay")) items.push(["measured (lower half)", "#2d3e50"]);
      for (const [name, c] of items) {
        const it = el("span");
        const sw = el("span", "sw");
        sw.style.background = c;
        it.append(sw, name);
        legend.appendChild(it);
      }
      root.appendChild(legend);
      const wrap = el("div", "pv-wrap");
      this.canvas = el("canvas");
      this.tip = el("div", "pv-tip");
      this.tip.id = "pipec-tip";
      wrap.append(this.canvas, this.tip);
      root.appendChild(wrap);
      this.wrap = wrap;
      this.bindEvents();
    }

    layout() {
      this.lanes = [];
      let y = AXIS;
      for (const P of this.doc.panels) {
        this.lanes.push({ P, type: "title", y, h: 18 });
        y += 18;
        const hasColl = P.colls.op.length > 0, hasHost = P.host.op.length > 0;
        const hasA2a = !!P.a2a && P.a2a.op.length > 0;
        const hasMem = this.show.memory && P.memory;
        P.maxMsg = [];
        for (let r = 0; r < P.ranks; r++) {
          let m = 0;
          for (let i = P.msg_off[r]; i < P.msg_off[r + 1]; i++) m = Math.max(m, P.msgs.arrival[i] - P.msgs.send[i]);
          P.maxMsg.push(m);
          this.lanes.push({ P, r, type: "ops", y, h: 26 }); y += 26;
          if (P.kind !== "deadlock") { this.lanes.push({ P, r, type: "p2p", y, h: 11 }); y += 11; }
          if (hasColl) { this.lanes.push({ P, r, type: "coll", y, h: 9 }); y += 9; }
          if (hasHost) { this.lanes.push({ P, r, type: "host", y, h: 9 }); y += 9; }
          if (hasA2a) { this.lanes.push({ P, r, type: "a2a", y, h: 9 }); y += 9; }
          if (hasMem) { this.lanes.push({ P, r, type: "mem", y, h: 30 }); y += 30; }
          y += 5;
        }
        y += 6;
      }
      this.height = y;
      this.resize();
    }

    resize() {
      const dpr = window.devicePixelRatio || 1;
      this.width = Math.max(300, this.wrap.clientWidth || 900);
      this.canvas.width = Math.round(this.width * dpr);
      this.canvas.height = Math.round(this.height * dpr);
      this.canvas.style.width = this.width + "px";
      this.canvas.style.height = this.height + "px";
      this.ctx = this.canvas.getContext("2d");
      this.ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    }

    x(t) { return GUTTER + (t - this.v0) / (this.v1 - this.v0) * (this.width - GUTTER - 8); }
    t(x) { return this.v0 + (x - GUTTER) / (this.width - GUTTER - 8) * (this.v1 - this.v0); }

    laneOf(P, r, type) { return this.lanes.find((l) => l.P === P && l.r === r && l.type === type); }

    /** Redraw now; returns the milliseconds it took (the benchmark reads it). */
    draw() {
      const t0 = performance.now();
      const ctx = this.ctx;
      ctx.clearRect(0, 0, this.width, this.height);
      ctx.font = "10px system-ui, sans-serif";
      this.drawAxis();
      this.visibleMsgs = [];
      ctx.save();
      ctx.beginPath();
      ctx.rect(GUTTER, 0, this.width - GUTTER, this.height);
      ctx.clip();
      for (const L of this.lanes) {
        if (L.type === "ops") this.drawOps(L);
        else if (L.type === "p2p") this.drawMsgs(L);
        else if (L.type === "coll") this.drawSpans(L, L.P.colls, L.P.coll_off);
        else if (L.type === "host") this.drawSpans(L, L.P.host, L.P.host_off);
        else if (L.type === "a2a") this.drawSpans(L, L.P.a2a, L.P.a2a_off);
        else if (L.type === "mem") this.drawMem(L);
      }
      if (this.show.arrows) this.drawArrows();
      for (const P of this.doc.panels) if (P.chain) this.drawChain(P);
      ctx.restore();
      this.drawLabels();
      const ms = performance.now() - t0;
      this.lastDraw = ms;
      return ms;
    }

    drawAxis() {
      const ctx = this.ctx, span = this.v1 - this.v0;
      const step = niceStep(span / Math.max(2, (this.width - GUTTER) / 90));
      ctx.fillStyle = "#555";
      ctx.strokeStyle = "#eef0f4";
      ctx.lineWidth = 1;
      for (let v = Math.ceil(this.v0 / step) * step; v <= this.v1; v += step) {
        const x = Math.round(this.x(v)) + 0.5;
        ctx.beginPath(); ctx.moveTo(x, AXIS - 4); ctx.lineTo(x, this.height); ctx.stroke();
        ctx.fillText(fmt(v), x + 2, 12);
      }
      const unit = this.doc.panels.some((p) => p.kind === "deadlock") ? "order" : "time (s)";
      ctx.fillText(unit, 4, 12);
    }

    drawLabels() {
      const ctx = this.ctx;
      ctx.fillStyle = "#fff";
      ctx.fillRect(0, AXIS, GUTTER - 2, this.height);
      for (const L of this.lanes) {
        ctx.fillStyle = "#333";
        if (L.type === "title") {
          ctx.font = "bold 11px system-ui, sans-serif";
          ctx.fillText(L.P.title, 4, L.y + 13);
          ctx.font = "10px system-ui, sans-serif";
        } else {
          const name = L.type === "ops" ? `rank ${L.r}` : { p2p: "send/recv", coll: "collective", host: "host link", a2a: "all-to-all", mem: "memory" }[L.type];
          ctx.fillStyle = L.type === "ops" ? "#222" : "#778";
          ctx.font = L.h < 12 ? "8px system-ui, sans-serif" : "10px system-ui, sans-serif";
          ctx.fillText(name, 4, L.y + Math.min(L.h - 1, 15));
        }
      }
    }

    label(P, i) {
      const name = this.op[P.ops.op[i]];
      return (LETTER[name] || name) + this.mbLabel(P, P.ops.mb[i]);
    }

    mbLabel(P, u) { return P.slices > 1 ? `${Math.floor(u / P.slices)}s${u % P.slices}` : String(u); }

    drawOps(L) {
      const { P, r } = L, ctx = this.ctx, O = P.ops;
      const a = P.op_off[r], b = P.op_off[r + 1];
      const overlay = P.kind === "overlay";
      const h = overlay ? (L.h - 4) / 2 : L.h - 4, y = L.y + 2;
      if (this.show.gaps && P.gap_off) this.drawGaps(L);
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
        ctx.fillStyle = COLORS[name] || "#888";
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
        if ((f & PAIR_FIRST) && i + 1 < b) {
          const x2 = this.x(Math.max(O.end[i + 1], e));
          ctx.strokeStyle = "#7b3294"; ctx.lineWidth = 2;
          ctx.strokeRect(x0 + 1, y + 1, x2 - x0 - 2, h - 2);
          ctx.fillStyle = "#7b3294";
          ctx.fillRect(x0, y + L.h - 5, x2 - x0, 2);
        }
        if (x1 - x0 > 20) {
          ctx.fillStyle = "#fff";
          const text = this.label(P, i) + (x1 - x0 > 48 ? "." + O.stage[i] : "");
          ctx.fillText(text, x0 + 3, y + (overlay ? h - 2 : h / 2 + 4));
        }
      }
      flush();
    }

    drawGaps(L) {
      const { P, r } = L, G = P.gaps, ctx = this.ctx;
      const a = P.gap_off[r], b = P.gap_off[r + 1];
      let i = Math.max(a, lowerBound(G.start, a, b, this.v0) - 1);
      ctx.fillStyle = "rgba(214,39,40,0.10)";
      for (; i < b && G.start[i] <= this.v1; i++) {
        const x0 = this.x(G.start[i]), x1 = this.x(G.end[i]);
        if (x1 - x0 >= 2) ctx.fillRect(x0, L.y + 2, x1 - x0, L.h - 4);
      }
    }

    drawMsgs(L) {
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
          if (rx0 >= 0) { ctx.fillStyle = "#9fb3c8"; ctx.fillRect(rx0, L.y + 2, rx1 - rx0, L.h - 4); }
          rx0 = x0; rx1 = x1;
          continue;
        }
        ctx.fillStyle = MSG_COLORS[M.kind[i]] || "#ccc";
        ctx.fillRect(x0, L.y + 2, x1 - x0, L.h - 4);
        if ((M.flags[i] & CRITICAL) && this.show.critical) { ctx.fillStyle = "#d62728"; ctx.fillRect(x0, L.y + L.h - 3, x1 - x0, 2); }
      }
      if (rx0 >= 0) { ctx.fillStyle = "#9fb3c8"; ctx.fillRect(rx0, L.y + 2, rx1 - rx0, L.h - 4); }
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
          ctx.fillRect(x - 1, L.y + 1, 2, L.h - 2);
        }
      }
    }

    drawArrows() {
      if (this.visibleMsgs.length > 3000) return;  // zoomed out: arrows would only hide the ops
      const ctx = this.ctx;
      for (const [P, i] of this.visibleMsgs) {
        const M = P.msgs;
        const from = this.laneOf(P, M.src[i], "p2p"), to = this.laneOf(P, M.dst[i], "ops");
        if (!from || !to) continue;
        const x0 = this.x(M.send[i]), x1 = this.x(M.arrival[i]);
        const y0 = from.y + from.h / 2, y1 = to.y + (to.y > y0 ? 2 : to.h - 2);
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

    opLaneAt(P, i) {
      let r = 0;
      while (r < P.ranks && P.op_off[r + 1] <= i) r++;
      return this.laneOf(P, r, "ops");
    }

    drawChain(P) {
      const ctx = this.ctx, O = P.ops;
      ctx.strokeStyle = "#d62728";
      ctx.lineWidth = 2;
      for (const w of P.chain) {
        if (w.needs < 0 || w.at < 0) continue;
        const Ln = this.opLaneAt(P, w.needs), La = this.opLaneAt(P, w.at);
        const x0 = this.x((O.start[w.needs] + O.end[w.needs]) / 2), x1 = this.x((O.start[w.at] + O.end[w.at]) / 2);
        const down = La.y > Ln.y;
        this.arrow(x0, down ? Ln.y + Ln.h - 2 : Ln.y + 2, x1, down ? La.y + 2 : La.y + La.h - 2);
      }
    }

    drawSpans(L, S, off) {
      const { r } = L, ctx = this.ctx;
      const a = off[r], b = off[r + 1];
      let last = -10;
      for (let i = a; i < b; i++) { // collectives and host transfers are few per rank: a plain scan
        const s = S.start[i], e = S.end[i];
        if (e < this.v0 || s > this.v1) continue;
        const x0 = this.x(s), x1 = Math.max(this.x(e), x0 + 1);
        if (x1 < last + 0.5 && x1 - x0 < 1) continue;
        last = x1;
        ctx.fillStyle = COLORS[this.op[S.op[i]]] || "#999";
        ctx.fillRect(x0, L.y + 1, x1 - x0, L.h - 2);
        if (S.flags && (S.flags[i] & CRITICAL) && this.show.critical) { ctx.fillStyle = "#d62728"; ctx.fillRect(x0, L.y, x1 - x0, 2); }
      }
    }

    drawMem(L) {
      const { P, r } = L, M = P.memory.ranks[r], ctx = this.ctx;
      const top = Math.max(M.peak, M.host_peak, M.limit || 0, M.host_limit || 0) * 1.08 || 1;
      const yOf = (v) => L.y + L.h - 2 - (v / top) * (L.h - 4);
      ctx.fillStyle = "#f7f8fb";
      ctx.fillRect(GUTTER, L.y, this.width, L.h);
      const curve = (T, V, fill, stroke) => {
        const n = T.length;
        if (!n) return;
        let i = Math.max(0, lowerBound(T, 0, n, this.v0) - 1);
        ctx.beginPath();
        let px = this.x(Math.max(T[i], this.v0)), pv = V[i];
        ctx.moveTo(px, yOf(0));
        ctx.lineTo(px, yOf(pv));
        let colMax = pv, colX = Math.floor(px);
        for (i = i + 1; i < n && T[i] <= this.v1; i++) {
          const x = this.x(T[i]);
          if (Math.floor(x) === colX) { colMax = Math.max(colMax, V[i]); pv = V[i]; continue; }
          ctx.lineTo(x, yOf(Math.max(colMax, pv)));
          ctx.lineTo(x, yOf(V[i]));
          colX = Math.floor(x); colMax = V[i]; pv = V[i];
        }
        const xe = this.x(Math.min(this.v1, Math.max(P.makespan, T[n - 1])));
        ctx.lineTo(xe, yOf(pv));
        if (fill) { ctx.lineTo(xe, yOf(0)); ctx.closePath(); ctx.fillStyle = fill; ctx.fill(); }
        ctx.strokeStyle = stroke; ctx.lineWidth = 1; ctx.stroke();
      };
      curve(M.t, M.v, "rgba(107,143,199,0.35)", "#4a6fa5");
      if (P.memory.host) curve(M.ht, M.hv, null, "#e08a2c");
      for (const [lim, color] of [[M.limit, "#d62728"], [M.host_limit, "#e08a2c"]]) {
        if (lim === null || lim === undefined) continue;
        ctx.setLineDash([4, 3]);
        ctx.strokeStyle = color;
        ctx.beginPath(); ctx.moveTo(GUTTER, yOf(lim) + 0.5); ctx.lineTo(this.width, yOf(lim) + 0.5); ctx.stroke();
        ctx.setLineDash([]);
      }
    }

    // ---- interaction ---------------------------------------------------------------------------------

    bindEvents() {
      const c = this.canvas;
      c.addEventListener("wheel", (ev) => {
        ev.preventDefault();
        const rect = c.getBoundingClientRect();
        const tm = this.t(ev.clientX - rect.left);
        const k = Math.exp(Math.max(-1, Math.min(1, ev.deltaY * 0.0015)));
        this.zoom(tm, k);
      }, { passive: false });
      let drag = null;
      c.addEventListener("mousedown", (ev) => { drag = { x: ev.clientX, v0: this.v0, v1: this.v1 }; c.classList.add("drag"); });
      window.addEventListener("mouseup", () => { drag = null; c.classList.remove("drag"); });
      c.addEventListener("mousemove", (ev) => {
        const rect = c.getBoundingClientRect();
        if (drag) {
          const dt = (ev.clientX - drag.x) / (this.width - GUTTER - 8) * (drag.v1 - drag.v0);
          this.v0 = drag.v0 - dt; this.v1 = drag.v1 - dt;
          this.request();
          return;
        }
        this.hover(ev.clientX - rect.left, ev.clientY - rect.top);
      });
      c.addEventListener("mouseleave", () => { this.tip.style.display = "none"; });
      c.addEventListener("dblclick", () => { [this.v0, this.v1] = this.full; this.request(); });
      this.onResize = () => { this.resize(); this.draw(); };
      window.addEventListener("resize", this.onResize);
    }

    zoom(tm, k) {
      const span = Math.max((this.v1 - this.v0) * k, 1e-9 * (this.full[1] - this.full[0]));
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

    hover(px, py) {
      const L = this.lanes.find((l) => py >= l.y && py < l.y + l.h);
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
      const { P, r } = L, tm = this.t(px), slack = (this.v1 - this.v0) / (this.width - GUTTER) * 3;
      if (L.type === "ops") {
        const O = P.ops, a = P.op_off[r], b = P.op_off[r + 1];
        const measured = P.kind === "overlay" && py > L.y + L.h / 2;
        const S = measured ? O.mstart : O.start, E = measured ? O.mend : O.end;
        let best = -1;
        const i0 = Math.max(a, lowerBound(O.start, a, b, tm - Math.max(slack, 0)) - 3);
        for (let i = i0; i < b && O.start[i] <= tm + slack + (measured ? P.makespan : 0); i++) {
          if (S[i] - slack <= tm && tm <= E[i] + slack) { best = i; if (S[i] <= tm && tm <= E[i]) break; }
        }
        if (best < 0) return this.describeGap(P, r, tm);
        return this.describeOp(P, best, measured);
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
        for (let i = off[r]; i < off[r + 1]; i++) {
          if (S.start[i] - slack <= tm && tm <= S.end[i] + slack) {
            const mb = S.mb ? ` micro-batch ${this.mbLabel(P, S.mb[i])}` : "";
            return [["", `${this.op[S.op[i]]}${mb} stage ${S.stage[i]} (rank ${r})`, "what"],
              ["", `start ${fmt(S.start[i])}  duration ${fmt(S.end[i] - S.start[i])}`, "time"]];
          }
        }
        return null;
      }
      if (L.type === "mem") {
        const M = P.memory.ranks[r];
        const at = (T, V) => { const i = lowerBound(T, 0, T.length, tm + 1e-12) - 1; return i >= 0 ? V[i] : 0; };
        const out = [["", `rank ${r} memory at ${fmt(tm)}`, "what"],
          ["", `device ${fmtMem(at(M.t, M.v), P.memory.unit)} (peak ${fmtMem(M.peak, P.memory.unit)}` +
            (M.limit !== null ? `, limit ${fmtMem(M.limit, P.memory.unit)})` : ", no limit)"), "device"]];
        if (P.memory.host) out.push(["", `host ${fmtMem(at(M.ht, M.hv), P.memory.unit)}`, "host"]);
        return out;
      }
      return null;
    }

    describeOp(P, i, measured) {
      const O = P.ops, name = this.op[O.op[i]], u = O.mb[i];
      const mb = P.slices > 1 ? `micro-batch ${Math.floor(u / P.slices)}  slice ${u % P.slices}` : `micro-batch ${u}`;
      const lines = [["", `${name}  ${mb}  stage ${O.stage[i]}  (rank ${O.rank[i]})`, "what"]];
      if (P.kind === "deadlock") lines.push(["", `position ${Math.round(O.start[i] - O.start[P.op_off[O.rank[i]]])} in its rank's order`, "time"]);
      else lines.push(["", `start ${fmt(O.start[i])}  duration ${fmt(O.end[i] - O.start[i])}${measured ? " (simulated)" : ""}`, "time"]);
      if (P.kind === "overlay") {
        const ms = O.mstart[i], me = O.mend[i];
        if (Number.isNaN(ms)) lines.push(["err", "measured: no such op in the run", "measured"]);
        else {
          const err = (me - ms) - (O.end[i] - O.start[i]);
          const rel = (O.end[i] - O.start[i]) > 0 ? ` (${err >= 0 ? "+" : ""}${(100 * err / (O.end[i] - O.start[i])).toFixed(1)}%)` : "";
          lines.push(["", `measured: start ${fmt(ms)}  duration ${fmt(me - ms)}`, "measured"]);
          lines.push([Math.abs(err) > 0.1 * (O.end[i] - O.start[i]) ? "err" : "", `error: duration ${err >= 0 ? "+" : ""}${fmt(err)}${rel}, start ${ms - O.start[i] >= 0 ? "+" : ""}${fmt(ms - O.start[i])}`, "error"]);
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
      const M = P.msgs;
      const what = M.kind[i] === 0 ? "activation" : "gradient";
      return [["", `${what} of micro-batch ${this.mbLabel(P, M.mb[i])} from stage ${M.stage[i]}: rank ${M.src[i]} → rank ${M.dst[i]}`, "what"],
        ["", `sent ${fmt(M.send[i])}  arrives ${fmt(M.arrival[i])}  (in flight ${fmt(M.arrival[i] - M.send[i])})`, "time"]];
    }

    describeGap(P, r, tm) {
      const G = P.gaps, a = P.gap_off[r], b = P.gap_off[r + 1];
      const i = lowerBound(G.start, a, b, tm + 1e-12) - 1;
      if (i < a || tm > G.end[i]) return null;
      const out = [["", `rank ${r} idle  ${fmt(G.start[i])} → ${fmt(G.end[i])}  (${fmt(G.end[i] - G.start[i])})`, "what"]];
      const k = G.wkind[i], j = G.widx[i];
      if (k === 1) {
        const M = P.msgs;
        out.push(["", `waits for the ${M.kind[j] === 0 ? "activation" : "gradient"} of micro-batch ${this.mbLabel(P, M.mb[j])} ` +
          `(stage ${M.stage[j]}) from rank ${M.src[j]}, which arrives at ${fmt(M.arrival[j])}`, "waits"]);
      } else if (k === 0) {
        out.push(["", `waits for ${this.label(P, j)}.${P.ops.stage[j]} on rank ${P.ops.rank[j]}, which ends at ${fmt(P.ops.end[j])}`, "waits"]);
      } else if (k === 2) out.push(["", `waits for a collective (${this.op[P.colls.op[j]]}), which ends at ${fmt(P.colls.end[j])}`, "waits"]);
      else if (k === 3) out.push(["", `waits for the host link (${this.op[P.host.op[j]]}), which ends at ${fmt(P.host.end[j])}`, "waits"]);
      else out.push(["", "waits for: not explained by the timeline", "waits"]);
      return out;
    }

    /** Where op i of panel p is drawn (page coordinates of its centre), for tests and the benchmark. */
    opPoint(p, i) {
      const P = this.doc.panels[p], L = this.opLaneAt(P, i);
      const rect = this.canvas.getBoundingClientRect();
      const x = (Math.max(this.x(P.ops.start[i]), GUTTER) + Math.min(this.x(P.ops.end[i]), this.width)) / 2;
      return { x: rect.left + window.scrollX + x, y: rect.top + window.scrollY + L.y + 6, cx: x, cy: L.y + 6 };
    }
  }

  let current = null;

  async function boot(root, doc) {
    const t0 = performance.now();
    const data = await decode(doc);
    if (current && current.onResize) window.removeEventListener("resize", current.onResize);
    current = new View(root, data);
    window.pipecView = current;
    window.pipecLoadMs = performance.now() - t0;
    root.dataset.ready = "1";
    return current;
  }

  return { boot, decode, lowerBound };
})();
