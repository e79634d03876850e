// deltarun graph page: draws the layout computed by deltarun/apps/graph_page.py on a canvas.
// Only what is in view is drawn (viewport culling); collapsing a layer only moves bands, so no
// layout runs here. No library, no network access: the data are in the #graph-data element.
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("graph-data").textContent);
  const NODE_W = 180, NODE_H = 36, RANK_H = 64, BAND_HEAD = 30, BAND_GAP = 18, GROUP_H = 48, GROUP_W = 540;
  const MIN_SCALE = 0.004, MAX_SCALE = 4;
  const canvas = document.getElementById("canvas");
  const ctx = canvas.getContext("2d");
  const $ = (id) => document.getElementById(id);
  const api = { ready: false, firstPaintMs: null, drawnTensors: 0, lastFrameMs: 0 };
  window.graphPage = api;

  // ---------------------------------------------------------------------------------------------
  // State
  // ---------------------------------------------------------------------------------------------
  let G = null;                 // the graph shown: one of DATA.graphs
  let byId = new Map();         // id -> tensor
  let consumers = new Map();    // id -> [tensor]
  let collapsed = [];           // per band
  let bandY = [], worldW = 0, worldH = 0, bandX = [];
  let boxes = [];               // visible boxes {x, y, w, h, t (tensor) | band (collapsed band index)}
  let edges = [];               // {x1, y1, x2, y2, dashed, from, to}
  let view = { x: 0, y: 0, s: 1 };  // screen = (world - view.xy) * s
  let selected = null, matches = new Set(), colourMode = "op";
  let legendInfo = null;
  let dirty = true;

  // ---------------------------------------------------------------------------------------------
  // Colours
  // ---------------------------------------------------------------------------------------------
  function hashHue(s) {
    let h = 2166136261;
    for (let i = 0; i < s.length; i++) { h ^= s.charCodeAt(i); h = Math.imul(h, 16777619); }
    return ((h >>> 0) % 360);
  }
  const PALETTE = ["#4fc3f7", "#ffb74d", "#81c784", "#e57373", "#ba68c8", "#fff176", "#4db6ac", "#a1887f"];
  // distinct light colours for the most frequent ops (then a hash of the name)
  const OP_COLOURS = ["#f8bbd0", "#b3e5fc", "#c5e1a5", "#ffe082", "#d1c4e9", "#ffccbc", "#b2dfdb", "#f0f4c3",
    "#bbdefb", "#ffab91", "#ce93d8", "#a5d6a7", "#fff59d", "#90caf9", "#e6ee9c", "#80deea", "#f48fb1", "#bcaaa4",
    "#9fa8da", "#ffcc80", "#80cbc4", "#e1bee7", "#dcedc8", "#b0bec5"];
  const LEAF_FILL = { weight: "#fff2cc", input: "#d5f5d5", memory: "#dae8fc", other: "#eeeeee" };
  function lerp(a, b, t) { return a + (b - a) * t; }
  function ramp(stops, t) {  // stops: [[r,g,b], ...] evenly spaced
    t = Math.max(0, Math.min(1, t));
    const p = t * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(p)), f = p - i;
    const c = [0, 1, 2].map((k) => Math.round(lerp(stops[i][k], stops[i + 1][k], f)));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }
  // light enough for dark text: small values blue, large ones orange
  const VALUES_RAMP = [[189, 215, 238], [158, 202, 225], [161, 217, 155], [254, 224, 139], [252, 141, 89]];
  const ERRRAMP = [[102, 187, 106], [212, 225, 87], [255, 202, 40], [255, 138, 101]];
  const FAIL = new Set(["exceeds", "nan", "inf_mismatch", "shape_mismatch", "index_mismatch"]);
  const SKIP = new Set(["only_a", "not_read", "not_observed"]);

  function leafKind(t) {
    if (t.is_weight || t.input_kind === "weight") return "weight";
    if (t.is_memory || t.input_kind === "memory") return "memory";
    if (t.is_input || t.input_kind === "input") return "input";
    return "other";
  }
  function num(x) { return typeof x === "number" ? x : (x === "inf" ? Infinity : (x === "nan" ? NaN : null)); }
  function fmt(x) {
    if (x === null || x === undefined) return "-";
    if (typeof x === "string") return x;
    if (typeof x === "boolean") return x ? "yes" : "no";
    if (Number.isInteger(x)) return String(x);
    if (x === 0) return "0";
    return Math.abs(x) >= 1e-3 && Math.abs(x) < 1e5 ? x.toPrecision(4) : x.toExponential(2);
  }

  function buildLegend() {
    const ts = G.tensors.filter((t) => t.kind === "node");
    if (colourMode === "op" || colourMode === "backend") {
      const key = colourMode === "op" ? (t) => t.op : (t) => t.backend || "(none)";
      const counts = new Map();
      for (const t of ts) counts.set(key(t), (counts.get(key(t)) || 0) + 1);
      const names = [...counts.keys()].sort((a, b) => counts.get(b) - counts.get(a) || (a < b ? -1 : 1));
      const colour = new Map(names.map((n, i) => [n, colourMode === "op" ? (i < OP_COLOURS.length ? OP_COLOURS[i] : `hsl(${hashHue(n)},55%,80%)`)
        : (n === "(none)" ? "#cfcfcf" : PALETTE[i % PALETTE.length])]));
      legendInfo = { kind: "categorical", names, counts, colour, key };
    } else if (colourMode === "values") {
      let lo = Infinity, hi = -Infinity;
      for (const t of ts) {
        const v = t.values;
        if (v && v.observed && v.rms !== null && v.rms > 0) { const l = Math.log10(v.rms); lo = Math.min(lo, l); hi = Math.max(hi, l); }
      }
      if (!(hi >= lo)) { lo = 0; hi = 1; }
      legendInfo = { kind: "values", lo, hi };
    } else {
      legendInfo = { kind: "nmse" };
    }
  }

  function fillOf(t) {
    if (t.kind !== "node") return LEAF_FILL[leafKind(t)];
    const L = legendInfo;
    if (L.kind === "categorical") return L.colour.get(L.key(t));
    if (L.kind === "values") {
      const v = t.values;
      if (!v || !v.observed) return "#eeeeee";
      if (v.n_nan || v.n_inf) return "#e53935";
      if (v.rms === null) return "#eeeeee";
      if (v.rms === 0) return ramp(VALUES_RAMP, 0);
      return ramp(VALUES_RAMP, L.hi > L.lo ? (Math.log10(v.rms) - L.lo) / (L.hi - L.lo) : 0.5);
    }
    // nmse against the limit
    if (FAIL.has(t.status)) return t.status === "exceeds" ? "#e53935" : "#8e24aa";
    if (SKIP.has(t.status) || t.status === undefined) return "#d6d6d6";
    const e = num(t.nmse), lim = t.limit || 1;
    if (e === null) return "#d6d6d6";
    if (e === 0) return ramp(ERRRAMP, 0);
    return ramp(ERRRAMP, (Math.log10(e / lim) + 8) / 8);  // 1e-8 of the limit .. the limit
  }

  // ---------------------------------------------------------------------------------------------
  // Geometry
  // ---------------------------------------------------------------------------------------------
  function selectGraph(i) {
    G = DATA.graphs[i];
    byId = new Map(G.tensors.map((t) => [t.id, t]));
    consumers = new Map();
    for (const t of G.tensors) {
      for (const s of t.src_ids || []) { if (!consumers.has(s)) consumers.set(s, []); consumers.get(s).push(t); }
    }
    const nLayers = G.bands.filter((b) => b.layer !== null).length;
    collapsed = G.bands.map((b) => b.layer !== null && nLayers > 8);
    selected = null;
    buildLegend();
    rebuild();
  }

  function rebuild() {
    worldW = Math.max(GROUP_W, ...G.bands.map((b) => b.width)) + 40;
    bandY = []; bandX = [];
    let y = 0;
    G.bands.forEach((b, i) => {
      bandY.push(y);
      bandX.push((worldW - b.width) / 2);
      y += BAND_HEAD + (collapsed[i] ? GROUP_H : b.n_ranks * RANK_H) + BAND_GAP;
    });
    worldH = y;
    boxes = [];
    const boxOf = new Map();
    G.bands.forEach((b, i) => {
      if (collapsed[i]) {
        const box = { x: (worldW - GROUP_W) / 2, y: bandY[i] + BAND_HEAD, w: GROUP_W, h: GROUP_H - 12, band: i };
        boxes.push(box);
      }
    });
    const groupBox = new Map(boxes.map((bx) => [bx.band, bx]));
    for (const t of G.tensors) {
      if (collapsed[t.band]) { boxOf.set(t.id, groupBox.get(t.band)); continue; }
      const box = { x: bandX[t.band] + t.x, y: bandY[t.band] + BAND_HEAD + t.rank * RANK_H, w: NODE_W, h: NODE_H, t };
      boxes.push(box); boxOf.set(t.id, box);
    }
    edges = [];
    const seen = new Set();
    const bandOf = (bx) => (bx.t ? bx.t.band : bx.band);
    function addEdge(a, b, dashed, from, to) {
      if (!a || !b || a === b) return;
      if (a.band !== undefined || b.band !== undefined) {
        const k = (a.t ? a.t.id : "g" + a.band) + ">" + (b.t ? b.t.id : "g" + b.band);
        if (seen.has(k)) return;
        seen.add(k);
      }
      const far = Math.abs(bandOf(a) - bandOf(b)) > 1;  // e.g. a graph input read by every layer: drawn faint
      edges.push({ x1: a.x + a.w / 2, y1: a.y + a.h, x2: b.x + b.w / 2, y2: b.y, dashed, far, from, to });
    }
    for (const t of G.tensors) {
      const b = boxOf.get(t.id);
      for (const s of t.src_ids || []) addEdge(boxOf.get(s), b, false, s, t.id);
      if (t.view_of_id && !(t.src_ids || []).includes(t.view_of_id)) addEdge(boxOf.get(t.view_of_id), b, true, t.view_of_id, t.id);
    }
    api.boxOf = boxOf;
    dirty = true;
    updateStatus();
  }

  // ---------------------------------------------------------------------------------------------
  // Drawing
  // ---------------------------------------------------------------------------------------------
  let cssW = 0, cssH = 0, charW = 7.2;
  function resize() {
    const r = canvas.getBoundingClientRect();
    const dpr = window.devicePixelRatio || 1;
    cssW = r.width; cssH = r.height;
    canvas.width = Math.max(1, Math.round(r.width * dpr));
    canvas.height = Math.max(1, Math.round(r.height * dpr));
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.font = "12px ui-monospace, monospace";
    charW = ctx.measureText("m").width || 7.2;
    dirty = true;
  }

  function clip(s, n) { return s.length <= n ? s : s.slice(0, Math.max(1, n - 1)) + "\u2026"; }

  function draw() {
    const t0 = performance.now();
    const s = view.s, vx = view.x, vy = view.y;
    const x0 = vx, y0 = vy, x1 = vx + cssW / s, y1 = vy + cssH / s;
    ctx.save();
    ctx.clearRect(0, 0, cssW, cssH);
    ctx.fillStyle = "#fafafa";
    ctx.fillRect(0, 0, cssW, cssH);
    ctx.translate(-vx * s, -vy * s);
    ctx.scale(s, s);
    // bands
    G.bands.forEach((b, i) => {
      const top = bandY[i], h = BAND_HEAD + (collapsed[i] ? GROUP_H : b.n_ranks * RANK_H);
      if (top > y1 || top + h < y0) return;
      ctx.fillStyle = i % 2 ? "#f1f4f6" : "#e9eef1";
      ctx.fillRect(0, top, worldW, h);
      if (s * BAND_HEAD > 7) {
        ctx.fillStyle = "#37474f";
        ctx.font = `600 ${Math.min(15, 13 / Math.max(s, 0.87))}px system-ui, sans-serif`;
        const txt = `${collapsed[i] ? "\u25b8" : "\u25be"} ${b.label}  \u00b7  ${b.n_nodes} nodes, ${b.n_leafs} leafs`;
        ctx.fillText(txt, Math.max(8, x0 + 8 / s), top + 20);
      }
    });
    // edges: one path per style
    const sel = selected;
    const strokeEdges = (list, colour, width, dash) => {
      if (!list.length) return;
      ctx.beginPath();
      for (const e of list) {
        const dy = (e.y2 - e.y1) / 2;
        ctx.moveTo(e.x1, e.y1);
        ctx.bezierCurveTo(e.x1, e.y1 + Math.max(dy, 20), e.x2, e.y2 - Math.max(dy, 20), e.x2, e.y2);
      }
      ctx.strokeStyle = colour; ctx.lineWidth = width; ctx.setLineDash(dash);
      ctx.stroke();
    };
    const plain = [], dashed = [], hot = [], faint = [];
    for (const e of edges) {
      if (Math.max(e.x1, e.x2) < x0 || Math.min(e.x1, e.x2) > x1 || Math.max(e.y1, e.y2) < y0 || Math.min(e.y1, e.y2) > y1) continue;
      if (sel && (e.from === sel || e.to === sel)) hot.push(e);
      else (e.dashed ? dashed : (e.far ? faint : plain)).push(e);
    }
    const thin = 1 / Math.max(s, 0.5);
    strokeEdges(plain, s < 0.1 ? "rgba(80,90,100,0.25)" : "rgba(80,90,100,0.55)", thin, []);
    strokeEdges(faint, "rgba(80,90,100,0.16)", thin, []);
    strokeEdges(dashed, "rgba(120,120,120,0.6)", thin, [4, 3]);
    strokeEdges(hot, "#1e88e5", 2.5 / Math.max(s, 0.5), []);
    ctx.setLineDash([]);
    // boxes
    const text = s > 0.42;
    const maxChars = Math.floor((NODE_W - 10) / charW);
    let drawn = 0;
    ctx.lineWidth = 1 / Math.max(s, 0.5);
    for (const b of boxes) {
      if (b.x > x1 || b.x + b.w < x0 || b.y > y1 || b.y + b.h < y0) continue;
      const t = b.t;
      if (!t) {  // a collapsed layer
        const band = G.bands[b.band];
        ctx.fillStyle = "#cfd8dc";
        ctx.fillRect(b.x, b.y, b.w, b.h);
        ctx.strokeStyle = "#546e7a"; ctx.strokeRect(b.x, b.y, b.w, b.h);
        if (s * b.h > 10) {
          ctx.fillStyle = "#263238"; ctx.font = "12px ui-monospace, monospace";
          const ops = Object.entries(band.ops).map(([k, v]) => `${k} ${v}`).join(", ");
          const n = Math.floor((b.w - 16) / charW);
          ctx.fillText(clip(`${band.label}: ${band.n_nodes} nodes (click to expand)`, n), b.x + 8, b.y + 15);
          ctx.fillStyle = "#546e7a"; ctx.fillText(clip(ops, n), b.x + 8, b.y + 30);
        }
        continue;
      }
      drawn++;
      ctx.fillStyle = fillOf(t);
      ctx.fillRect(b.x, b.y, b.w, b.h);
      if (s * b.h > 5) {
        ctx.strokeStyle = t.kind === "node" ? "#455a64" : "#9e9e9e";
        ctx.strokeRect(b.x, b.y, b.w, b.h);
      }
      if (text) {
        ctx.fillStyle = "#111"; ctx.font = "600 12px ui-monospace, monospace";
        ctx.fillText(clip(t.name, maxChars), b.x + 5, b.y + 14);
        ctx.fillStyle = "#37474f"; ctx.font = "11px ui-monospace, monospace";
        const ne = t.ne ? "[" + t.ne.slice(0, Math.max(1, lastDim(t.ne))).join(",") + "]" : "";
        ctx.fillText(clip(`${t.op} ${t.type} ${ne}`, maxChars + 1), b.x + 5, b.y + 29);
      }
    }
    // marks: search matches, the first failure, the selection
    const mark = (id, colour, width, label) => {
      const b = api.boxOf.get(id);
      if (!b) return;
      ctx.strokeStyle = colour; ctx.lineWidth = width / Math.max(s, 0.25);
      const p = 3 / Math.max(s, 0.25);
      ctx.strokeRect(b.x - p, b.y - p, b.w + 2 * p, b.h + 2 * p);
      if (label) {
        ctx.fillStyle = colour; ctx.font = `600 ${12 / Math.max(s, 0.6)}px system-ui, sans-serif`;
        ctx.fillText(label, b.x, b.y - p - 4 / Math.max(s, 0.25));
      }
    };
    for (const id of matches) mark(id, "#fdd835", 3);
    if (G.first_failure) mark(G.first_failure, "#b71c1c", 4, "first node over its limit");
    if (sel) mark(sel, "#1e88e5", 3);
    ctx.restore();
    api.drawnTensors = drawn;
    canvas.dataset.drawnTensors = String(drawn);
    api.lastFrameMs = performance.now() - t0;
    if (api.firstPaintMs === null) {
      api.firstPaintMs = performance.now();
      api.ready = true;
      document.body.dataset.ready = "1";
    }
  }
  function lastDim(ne) { let n = ne.length; while (n > 1 && ne[n - 1] === 1) n--; return n; }

  function frame() {
    if (dirty) { dirty = false; draw(); }
    requestAnimationFrame(frame);
  }

  // ---------------------------------------------------------------------------------------------
  // View
  // ---------------------------------------------------------------------------------------------
  function fit() {
    const s = Math.min(cssW / worldW, cssH / worldH) * 0.97;
    view.s = Math.max(MIN_SCALE, Math.min(1.2, s));
    view.x = (worldW - cssW / view.s) / 2;
    view.y = (worldH - cssH / view.s) / 2;
    dirty = true;
  }
  function fitWidthTop() {
    view.s = Math.max(0.3, Math.min(1, cssW / worldW));
    view.x = (worldW - cssW / view.s) / 2;
    view.y = -10;
    dirty = true;
  }
  function centreOn(id, scale) {
    const b = api.boxOf.get(id);
    if (!b) return;
    if (scale) view.s = scale;
    view.x = b.x + b.w / 2 - cssW / 2 / view.s;
    view.y = b.y + b.h / 2 - cssH / 2 / view.s;
    dirty = true;
  }
  function toWorld(px, py) { return [view.x + px / view.s, view.y + py / view.s]; }
  function hit(px, py) {
    const [wx, wy] = toWorld(px, py);
    for (const b of boxes) if (wx >= b.x && wx <= b.x + b.w && wy >= b.y && wy <= b.y + b.h) return b;
    for (let i = 0; i < G.bands.length; i++) {
      if (wy >= bandY[i] && wy <= bandY[i] + BAND_HEAD) return { header: i };
    }
    return null;
  }
  function reveal(id) {
    const t = byId.get(id);
    if (t && collapsed[t.band]) { collapsed[t.band] = false; rebuild(); }
  }
  function select(id, centre) {
    if (id !== null && !byId.has(id)) return;
    selected = id;
    if (id !== null) {
      reveal(id);
      if (centre) centreOn(id, Math.max(view.s, 0.8));
    }
    showDetails();
    dirty = true;
  }
  api.select = (id) => select(id, true);
  api.tensorIds = () => G.tensors.map((t) => t.id);
  api.tensor = (id) => byId.get(id);
  api.screenPos = (id) => {
    const b = api.boxOf.get(id);
    if (!b) return null;
    return { x: (b.x + b.w / 2 - view.x) * view.s, y: (b.y + b.h / 2 - view.y) * view.s, w: cssW, h: cssH };
  };
  api.fit = () => { fit(); };
  api.setCollapsed = (on) => { collapsed = G.bands.map((b) => on && b.layer !== null); rebuild(); };
  api.redrawMs = (n) => {  // mean time of n full redraws at the current view (for the benchmark)
    const t0 = performance.now();
    for (let i = 0; i < n; i++) draw();
    return (performance.now() - t0) / n;
  };

  // mouse
  let drag = null;
  canvas.addEventListener("mousedown", (e) => {
    drag = { x: e.clientX, y: e.clientY, vx: view.x, vy: view.y, moved: false };
    canvas.classList.add("dragging");
  });
  canvas.addEventListener("mousemove", (e) => {  // hover: a tooltip with what the box is
    if (drag) return;
    const r = canvas.getBoundingClientRect();
    const h = hit(e.clientX - r.left, e.clientY - r.top);
    const tip = !h ? "" : h.t ? `${h.t.name}\n${h.t.op} ${h.t.type || ""} ${dims(h.t.ne)}` + (h.t.backend ? `\non ${h.t.backend}` : "")
      : h.band !== undefined ? `${G.bands[h.band].label}: click to expand` : h.header !== undefined ? "click to collapse or expand" : "";
    if (canvas.title !== tip) canvas.title = tip;
  });
  window.addEventListener("mousemove", (e) => {
    if (!drag) return;
    const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 3) drag.moved = true;
    view.x = drag.vx - dx / view.s; view.y = drag.vy - dy / view.s;
    dirty = true;
  });
  window.addEventListener("mouseup", (e) => {
    if (!drag) return;
    const moved = drag.moved;
    drag = null;
    canvas.classList.remove("dragging");
    if (moved) return;
    const r = canvas.getBoundingClientRect();
    const h = hit(e.clientX - r.left, e.clientY - r.top);
    if (!h) { select(null); return; }
    if (h.header !== undefined) { collapsed[h.header] = !collapsed[h.header]; rebuild(); return; }
    if (h.band !== undefined) { collapsed[h.band] = false; rebuild(); return; }
    select(h.t.id, false);
  });
  canvas.addEventListener("wheel", (e) => {
    e.preventDefault();
    const r = canvas.getBoundingClientRect();
    const px = e.clientX - r.left, py = e.clientY - r.top;
    const [wx, wy] = toWorld(px, py);
    const k = Math.exp(-e.deltaY * (e.deltaMode === 1 ? 0.05 : 0.0015));
    view.s = Math.max(MIN_SCALE, Math.min(MAX_SCALE, view.s * k));
    view.x = wx - px / view.s; view.y = wy - py / view.s;
    dirty = true;
  }, { passive: false });
  window.addEventListener("keydown", (e) => {
    if (e.target === $("search")) return;
    if (e.key === "/") { e.preventDefault(); $("search").focus(); }
    else if (e.key === "f") fit();
    else if (e.key === "Escape") select(null);
  });
  new ResizeObserver(() => { resize(); }).observe($("view"));

  // ---------------------------------------------------------------------------------------------
  // Panel
  // ---------------------------------------------------------------------------------------------
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k === "onclick") e.onclick = v; else e.setAttribute(k, v);
    }
    for (const k of kids) if (k !== null && k !== undefined) e.append(k instanceof Node ? k : String(k));
    return e;
  }
  function link(id, text) {
    const t = byId.get(id);
    return el("a", { "data-id": id, onclick: () => select(id, true) }, text || (t ? t.name : id));
  }
  function row(label, value, field) {
    return el("tr", field ? { "data-field": field } : {}, el("td", {}, label), el("td", {}, value));
  }
  function dims(v) { return v ? "[" + v.join(", ") + "]" : "-"; }

  function showDetails() {
    const box = $("details");
    box.replaceChildren();
    if (selected === null) {
      box.append(el("p", { class: "hint" }, "Click a node for its details. Drag to pan, wheel to zoom, click a layer's header to collapse or expand it."));
      return;
    }
    const t = byId.get(selected);
    box.append(el("h2", { id: "details-name" }, t.name));
    const tb = el("table", { id: "details-table" });
    tb.append(row("id", t.id, "id"), row("kind", t.kind === "node" ? "node" : (t.input_kind || leafKind(t)), "kind"),
      row("op", t.op, "op"), row("type", t.type || "-", "type"), row("shape (ne)", dims(t.ne), "ne"));
    if (t.nb) tb.append(row("strides (nb)", dims(t.nb), "nb"));
    if (t.nbytes !== undefined) tb.append(row("bytes", t.nbytes.toLocaleString("en-US") + (t.contiguous === false ? " (strided)" : ""), "nbytes"));
    if (t.view_of_id || t.view_of) tb.append(row("view of", el("span", {}, t.view_of_id ? link(t.view_of_id, t.view_of) : t.view_of, ` + ${t.view_offs || 0} bytes`), "view_of"));
    if (DATA.mode === "compare" && t.kind === "node") {
      tb.append(row("ran on", `a ${t.backend_a || "-"}, b ${t.backend_b || "-"}`, "backend"));
    } else {
      tb.append(row("backend", t.backend || "(none: not scheduled)", "backend"));
      if (t.buffer) tb.append(row("buffer", t.buffer, "buffer"));
    }
    if (t.split !== undefined) tb.append(row("split", `${t.split} (run of nodes on one backend)`, "split"));
    tb.append(row("layer", t.layer === null || t.layer === undefined ? "-" : t.layer, "layer"));
    const flags = ["is_input", "is_output", "is_weight", "is_memory"].filter((f) => t[f]).map((f) => f.slice(3));
    if (flags.length) tb.append(row("flags", flags.join(", "), "flags"));
    if (DATA.mode === "compare" && t.status !== undefined) {
      const bad = FAIL.has(t.status);
      tb.append(row("status", el("span", { class: bad ? "bad" : "" }, t.status), "status"));
      if (t.kind === "node") {
        const e = num(t.nmse);
        tb.append(row("NMSE", fmt(t.nmse), "nmse"), row("limit", fmt(t.limit), "limit"));
        if (e !== null && t.limit) tb.append(row("NMSE / limit", fmt(e / t.limit), "ratio"));
        tb.append(row("max |a-b|", fmt(t.max_abs_err), "max_abs_err"));
        if (t.note) tb.append(row("note", t.note, "note"));
      }
    }
    box.append(tb);
    if (t.values) {
      const v = t.values, vt = el("table", { id: "details-values" });
      box.append(el("h3", {}, "values"));
      if (!v.observed) vt.append(row("note", v.note || "not observed"));
      else {
        vt.append(row("min", fmt(v.min)), row("max", fmt(v.max)), row("mean", fmt(v.mean)), row("rms", fmt(v.rms)),
          row("NaN / Inf", `${v.n_nan} / ${v.n_inf}`), row("first", "[" + v.first.map(fmt).join(", ") + "]"));
        if (v.note) vt.append(row("note", v.note));
      }
      box.append(vt);
    }
    box.append(el("h3", {}, `inputs (${(t.src_ids || []).length})`));
    const ul = el("ul", { id: "details-inputs" });
    (t.src_ids || []).forEach((s, i) => {
      const src = byId.get(s);
      const li = el("li", {}, `${i}: `, link(s, (t.src || [])[i]));
      if (DATA.mode === "compare" && src) {
        li.append(src.kind === "node" ? `  NMSE ${fmt(src.nmse)} (${src.status})` : `  (${src.input_kind}${src.status === "exact" ? ", exact" : ""})`);
      } else if (src) li.append(`  ${src.op} ${dims(src.ne)}`);
      ul.append(li);
    });
    box.append(ul);
    const used = consumers.get(t.id) || [];
    box.append(el("h3", {}, `consumers (${used.length})`));
    const uc = el("ul", {});
    for (const c of used.slice(0, 40)) uc.append(el("li", {}, link(c.id), `  ${c.op}`));
    if (used.length > 40) uc.append(el("li", {}, `\u2026 ${used.length - 40} more`));
    box.append(uc);
  }

  function showLegend() {
    const box = $("legend");
    box.replaceChildren(el("h2", {}, "colour"));
    const L = legendInfo;
    if (L.kind === "categorical") {
      for (const n of L.names) {
        box.append(el("div", { class: "legend-row" }, el("span", { class: "swatch", style: `background:${L.colour.get(n)}` }), `${n} (${L.counts.get(n)})`));
      }
    } else if (L.kind === "values") {
      box.append(el("div", {}, "rms of the recorded values, log scale"));
      box.append(el("div", { class: "gradient", style: `background:linear-gradient(to right, ${[0, .25, .5, .75, 1].map((x) => ramp(VALUES_RAMP, x)).join(",")})` }));
      box.append(el("div", { class: "legend-row" }, `${fmt(Math.pow(10, L.lo))} \u2026 ${fmt(Math.pow(10, L.hi))}; red: NaN or Inf; grey: not recorded`));
    } else {
      box.append(el("div", {}, "NMSE of side b against side a, relative to the node's limit (log scale)"));
      box.append(el("div", { class: "gradient", style: `background:linear-gradient(to right, ${[0, .33, .66, 1].map((x) => ramp(ERRRAMP, x)).join(",")})` }));
      box.append(el("div", { class: "legend-row" }, "1e-8 \u00d7 limit \u2026 the limit"));
      box.append(el("div", { class: "legend-row" }, el("span", { class: "swatch", style: "background:#e53935" }), "over its limit"));
      box.append(el("div", { class: "legend-row" }, el("span", { class: "swatch", style: "background:#8e24aa" }), "NaN, Inf, shape or index mismatch"));
      box.append(el("div", { class: "legend-row" }, el("span", { class: "swatch", style: "background:#d6d6d6" }), "not compared"));
    }
    for (const [k, c] of Object.entries(LEAF_FILL)) {
      if (k !== "other") box.append(el("div", { class: "legend-row" }, el("span", { class: "swatch", style: `background:${c}` }), `${k} (leaf)`));
    }
  }

  function showSummary() {
    const box = $("summary");
    box.replaceChildren(el("h2", {}, "graph"));
    const tb = el("table", {});
    tb.append(row("model", DATA.model), row("tensors", `${G.tensors.length} (${G.tensors.filter((t) => t.kind === "node").length} nodes, ${G.tensors.filter((t) => t.kind !== "node").length} leafs)`, "n_tensors"));
    if (G.shape) {
      const sh = G.shape;
      tb.append(row("ubatch", `${sh.n_seq_tokens} token(s) x ${sh.n_seqs} seq(s), ${sh.n_outputs} output(s), past ${sh.n_past}, n_kv ${sh.n_kv}, rs_slots ${sh.rs_slots}, delta-net ${sh.delta_net}`));
    }
    if (G.summary) {
      const s = G.summary;
      if (s.n_splits !== undefined) tb.append(row("splits", `${s.n_splits} (scheduler)`));
      if (s.compute_buffer_bytes) tb.append(row("compute buffer", Object.entries(s.compute_buffer_bytes).map(([k, v]) => `${k} ${(v / 1048576).toFixed(1)} MiB`).join(", ")));
      if (s.n_compared !== undefined) tb.append(row("compared", `${s.n_compared}, failed ${s.n_failed}, skipped ${s.n_skipped}; matched by ${s.matched_by}`));
    }
    if (G.splits) tb.append(row("splits", `a ${G.splits.a}, b ${G.splits.b}`));
    if (G.values) tb.append(row("values", `${G.values.n_observed} of ${G.values.n_selected} nodes recorded; ` + (G.values.image ? `image ${G.values.image}` : `prompt ${G.values.tokens.length} tokens`)));
    box.append(tb);
  }

  function showReport() {
    if (DATA.mode !== "compare") return;
    const C = DATA.compare, box = $("report");
    box.hidden = false;
    box.replaceChildren(el("h2", {}, "comparison"));
    box.append(el("div", { id: "verdict", class: "verdict " + (C.passed ? "good" : "bad") }, C.passed ? `PASS: every node and the ${C.embeddings ? "embeddings" : "logits"} are within their limits` : "FAIL"));
    if (!C.passed) { const ul = el("ul", {}); for (const f of C.failures) ul.append(el("li", {}, f)); box.append(ul); }
    const tb = el("table", {});
    for (const s of C.sides) tb.append(row(`side ${s.label}`, `${s.model.split("/").pop()} on ${s.backend} (${s.device}); ` + (s.delta_net ? `delta-net ${s.delta_net}; ` : "") + Object.entries(s.weight_types).map(([k, v]) => `${k} x${v}`).join(", ")));
    if (C.image) tb.append(row("image", `${C.image.file || "random pixels"}: ${C.image.image[0]} x ${C.image.image[1]} pixels, ${C.image.n_tokens} image tokens`));
    box.append(tb);
    const ff = G.first_failure ? byId.get(G.first_failure) : null;
    const fb = el("div", { id: "first-failure" });
    if (ff) {
      fb.append(el("h3", {}, `first node over its limit (${G.name} graph)`), el("div", { class: "mono" }, link(ff.id, ff.name), ` ${ff.op}: NMSE ${fmt(ff.nmse)} > ${fmt(ff.limit)}`));
      const ul = el("ul", {});
      (ff.src_ids || []).forEach((s, i) => {
        const src = byId.get(s);
        ul.append(el("li", {}, link(s, ff.src[i]), src && src.kind === "node" ? ` NMSE ${fmt(src.nmse)} (limit ${fmt(src.limit)}, ${src.status})` : ` (${src && src.input_kind}${src && src.status === "exact" ? ", exact" : ""})`));
      });
      fb.append(el("div", {}, "its inputs:"), ul);
    } else {
      fb.append(el("h3", {}, `${G.name} graph`), el("div", { class: "good" }, "every compared node is within its limit"));
    }
    box.append(fb);
    if (C.embeddings) {     // a vision tower's report (deltarun.apps.vision_graph)
      const e = C.embeddings, et = el("table", { id: "embeddings" });
      et.append(row("embeddings NMSE", el("span", { class: e.status === "ok" ? "good" : "bad" }, `${fmt(e.nmse)} (limit ${fmt(e.limit)}): ${e.status}`), "embeddings_nmse"),
        row("max |a-b| / max |a|", fmt(e.max_rel_err)), row("shape", `${e.n_tokens} x ${e.dim}`));
      box.append(el("h3", {}, "embeddings"), et);
      return;
    }
    const lg = C.logits, gr = C.greedy;
    const lt = el("table", { id: "logits" });
    lt.append(row("logits NMSE", el("span", { class: lg.status === "ok" ? "good" : "bad" }, `${fmt(lg.nmse)} (limit ${fmt(lg.limit)}): ${lg.status}`), "logits_nmse"),
      row("worst position", fmt(lg.max_position_nmse)),
      row("top-1 agreement", `${lg.top1.filter((x) => x).length}/${lg.top1.length}`, "top1"),
      row("KL(a||b)", `mean ${fmt(lg.kl_mean)}, max ${fmt(lg.kl_max)} nats`, "kl"),
      row("positions", `${lg.n_prompt} prompt + ${lg.n_positions - lg.n_prompt} decode`),
      row("greedy", gr.match ? `${gr.steps} steps: match` : `differ from step ${gr.first_divergence}`, "greedy"));
    box.append(el("h3", {}, "logits"), lt);
  }

  function updateStatus() {
    const n = G.tensors.length, nb = G.bands.length, nc = collapsed.filter((c) => c).length;
    $("status").textContent = `${n} tensors in ${nb} bands` + (nc ? `, ${nc} collapsed` : "");
  }

  // ---------------------------------------------------------------------------------------------
  // Search
  // ---------------------------------------------------------------------------------------------
  const search = $("search"), results = $("search-results");
  function runSearch() {
    const q = search.value.trim().toLowerCase();
    matches = new Set();
    results.replaceChildren();
    if (!q) { results.hidden = true; dirty = true; return; }
    const found = G.tensors.filter((t) => t.name.toLowerCase().includes(q) || t.id === q);
    for (const t of found) matches.add(t.id);
    for (const t of found.slice(0, 200)) {
      const li = el("li", { "data-id": t.id }, el("span", { class: "name" }, t.name), el("span", { class: "op" }, `${t.op} ${t.id}`));
      li.addEventListener("mousedown", (e) => { e.preventDefault(); results.hidden = true; select(t.id, true); });
      results.append(li);
    }
    if (!found.length) results.append(el("li", { class: "none" }, "no match"));
    else if (found.length > 200) results.append(el("li", { class: "none" }, `\u2026 ${found.length - 200} more`));
    results.hidden = false;
    const r = search.getBoundingClientRect();
    results.style.left = r.left + "px"; results.style.top = r.bottom + 2 + "px";
    dirty = true;
  }
  search.addEventListener("input", runSearch);
  search.addEventListener("focus", () => { if (search.value.trim()) runSearch(); });
  search.addEventListener("blur", () => { results.hidden = true; });
  search.addEventListener("keydown", (e) => {
    if (e.key === "Enter") {
      const first = results.querySelector("li[data-id]");
      if (first) { results.hidden = true; select(first.dataset.id, true); }
    } else if (e.key === "Escape") { search.value = ""; runSearch(); search.blur(); }
  });

  // ---------------------------------------------------------------------------------------------
  // Controls and start
  // ---------------------------------------------------------------------------------------------
  const modes = DATA.mode === "compare" ? [["nmse", "NMSE / limit"], ["op", "op"], ["backend", "backend"]]
    : [["op", "op"], ["backend", "backend"]].concat(DATA.has_values ? [["values", "value statistics (rms)"]] : []);
  const modeSel = $("colour-mode");
  for (const [v, label] of modes) modeSel.append(el("option", { value: v }, label));
  colourMode = modes[0][0];
  if (DATA.has_values) colourMode = "values";
  modeSel.value = colourMode;
  modeSel.addEventListener("change", () => { colourMode = modeSel.value; buildLegend(); showLegend(); dirty = true; });
  const graphSel = $("graph-select");
  DATA.graphs.forEach((g, i) => graphSel.append(el("option", { value: String(i) }, `${g.name} graph`)));
  graphSel.hidden = DATA.graphs.length < 2;
  graphSel.addEventListener("change", () => start(Number(graphSel.value)));
  $("fit").addEventListener("click", fit);
  $("collapse-all").addEventListener("click", () => { api.setCollapsed(true); });
  $("expand-all").addEventListener("click", () => { api.setCollapsed(false); });

  function start(i) {
    selectGraph(i);
    showLegend(); showSummary(); showReport();
    resize();
    if (G.first_failure) select(G.first_failure, true);
    else {
      showDetails();
      const fitted = Math.min(cssW / worldW, cssH / worldH);
      if (fitted >= 0.3) fit(); else fitWidthTop();
    }
  }
  const firstFailing = DATA.graphs.findIndex((g) => g.first_failure);
  start(firstFailing >= 0 ? firstFailing : 0);
  graphSel.value = String(firstFailing >= 0 ? firstFailing : 0);
  requestAnimationFrame(frame);
})();
