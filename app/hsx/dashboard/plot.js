// The throughput plot: tokens per second in each window of GET /v1/jobs/{id}/throughput, drawn as SVG
// bars at the width of its container (so that labels keep their size on a phone).

import { rate, short, when } from "./format.js";

const SVG = "http://www.w3.org/2000/svg";
const HEIGHT = 200;
const PAD = { left: 64, right: 12, top: 12, bottom: 30 };

function node(name, attrs = {}, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text != null) el.textContent = text;
  return el;
}

const tick = (v) => (v >= 10_000 ? short(v) : new Intl.NumberFormat("en-US", { maximumFractionDigits: 1 }).format(v));

// The smallest 1, 2, 2.5 or 5 times a power of ten that is at least `v`.
function roundUp(v) {
  if (v <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 2.5, 5, 10].map((m) => m * p).find((c) => c >= v);
}

export function describe(throughput) {
  const pts = throughput.points;
  if (!pts.length) return "Throughput: nothing extracted yet.";
  const peak = Math.max(...pts.map((p) => p.tokens_per_s));
  const last = pts[pts.length - 1].tokens_per_s;
  return (
    `Throughput in ${pts.length} windows of ${throughput.window_s} s from ${when(pts[0].start)}: ` +
    `peak ${rate(peak)}, latest ${rate(last)}.`
  );
}

export function throughputPlot(throughput, width) {
  const w = Math.max(280, Math.floor(width));
  const label = describe(throughput);
  const svg = node("svg", { class: "plot", width: w, height: HEIGHT, viewBox: `0 0 ${w} ${HEIGHT}`, role: "img" });
  svg.setAttribute("aria-label", label);
  svg.append(node("title", {}, label));
  const pts = throughput.points;
  const plotW = w - PAD.left - PAD.right;
  const plotH = HEIGHT - PAD.top - PAD.bottom;
  const top = roundUp(Math.max(0, ...pts.map((p) => p.tokens_per_s)));
  const y = (v) => PAD.top + plotH - (v / top) * plotH;

  for (let i = 0; i <= 4; i += 1) {
    const v = (top * i) / 4;
    svg.append(node("line", { class: "grid", x1: PAD.left, x2: w - PAD.right, y1: y(v), y2: y(v) }));
    svg.append(node("text", { class: "axis", x: PAD.left - 6, y: y(v) + 4, "text-anchor": "end" }, tick(v)));
  }
  const mid = PAD.top + plotH / 2;
  svg.append(
    node(
      "text",
      { class: "axis", x: 12, y: mid, "text-anchor": "middle", transform: `rotate(-90 12 ${mid})` },
      "tok/s",
    ),
  );
  if (!pts.length) {
    svg.append(
      node(
        "text",
        { class: "axis", x: PAD.left + plotW / 2, y: PAD.top + plotH / 2, "text-anchor": "middle" },
        "nothing extracted yet",
      ),
    );
    return svg;
  }
  const step = plotW / pts.length;
  pts.forEach((p, i) => {
    const h = PAD.top + plotH - y(p.tokens_per_s);
    const bar = node("rect", {
      class: "column",
      x: PAD.left + i * step + (step > 4 ? 1 : 0),
      y: y(p.tokens_per_s),
      width: Math.max(1, step - (step > 4 ? 2 : 0)),
      height: Math.max(p.tokens > 0 ? 1 : 0, h),
    });
    bar.append(
      node(
        "title",
        {},
        `${when(p.start)}: ${rate(p.tokens_per_s)}, ${short(p.samples)} samples, ${short(p.tokens)} tokens`,
      ),
    );
    svg.append(bar);
  });
  // Window edges: the first window's start, one in the middle, the last window's end.
  const edge = (i) => new Date(new Date(pts[0].start).getTime() + i * throughput.window_s * 1000).toISOString();
  const marks = [
    [0, "start"],
    [Math.round(pts.length / 2), "middle"],
    [pts.length, "end"],
  ];
  for (const [i, anchor] of pts.length >= 4 ? marks : [marks[0], marks[2]]) {
    svg.append(
      node("text", { class: "axis", x: PAD.left + i * step, y: HEIGHT - 8, "text-anchor": anchor }, when(edge(i))),
    );
  }
  return svg;
}
