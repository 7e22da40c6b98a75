// The dashboard's pages: the jobs (#/), one job (#/jobs/<id>) and the workers (#/workers). Every figure
// comes from the public API (see api.js); a job's page follows its event stream, the others poll.

import { api, download, events, jobPath, token } from "./api.js";
import * as fmt from "./format.js";
import { throughputPlot } from "./plot.js";

const JOB_STATES = ["queued", "running", "cancelling", "succeeded", "partial", "failed", "cancelled"];
const TERMINAL = new Set(["succeeded", "partial", "failed", "cancelled"]);
const JOBS_PAGE = 20;
const SAMPLES_PAGE = 20;

const main = document.getElementById("main");
const who = document.getElementById("who");
const notice = document.getElementById("notice");
let access = null; // GET v1/token: {tokens_required, role}
let stopView = () => {};

// --- building the page ------------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v == null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "style") Object.assign(el.style, v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c != null && c !== false) el.append(c);
  return el;
}

// A part of a page that is drawn again whenever its data changes. Nothing is replaced when the new
// drawing is the same, and keyboard focus stays on the control with the same data-focus key.
class Slot {
  constructor() {
    this.el = h("div");
  }

  set(fresh) {
    if (this.el.isEqualNode(fresh)) return;
    const key = document.activeElement?.dataset?.focus;
    this.el.replaceWith(fresh);
    this.el = fresh;
    if (key && !document.activeElement?.dataset?.focus) {
      fresh.querySelector(`[data-focus="${CSS.escape(key)}"]`)?.focus();
    }
  }
}

const badge = (state) => h("span", { class: `badge state-${state}` }, state);
const cell = (label, ...content) => h("td", { "data-label": label }, ...content);
const table = (caption, headings, rows) =>
  h(
    "div",
    { class: "table-wrap" },
    h(
      "table",
      {},
      h("caption", { class: "visually-hidden" }, caption),
      h(
        "thead",
        {},
        h(
          "tr",
          {},
          headings.map((t) => h("th", { scope: "col" }, t)),
        ),
      ),
      h("tbody", {}, rows),
    ),
  );

function say(message, error = false) {
  notice.className = error ? "notice error" : "notice";
  notice.textContent = message;
  clearTimeout(say.timer);
  say.timer = setTimeout(() => (notice.textContent = ""), 8000);
}

// An error from the API: a refused token asks for another; anything else is said and left there.
function failed(err) {
  if (err?.name === "AbortError") return;
  if (err?.status === 401) return askToken("The service did not accept the token.");
  say(err?.message || String(err), true);
}

// Run `fn` now and every `ms` after it ends; returns the function that stops it.
function every(ms, fn) {
  let stopped = false;
  let timer;
  const tick = async () => {
    try {
      await fn();
    } catch (err) {
      failed(err);
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

// --- the token ------------------------------------------------------------------------------------

async function start() {
  try {
    access = await api("v1/token");
  } catch (err) {
    if (err.status === 401) return askToken(token.get() ? "The service did not accept the token." : null);
    main.replaceChildren(h("h1", {}, "hsx"), h("p", { class: "error" }, `The service did not answer: ${err.message}`));
    return;
  }
  showWho();
  route();
}

function askToken(message) {
  stopView();
  stopView = () => {};
  access = null;
  token.clear();
  showWho();
  document.title = "Token – hsx";
  const input = h("input", { id: "token", name: "token", type: "password", autocomplete: "off", required: true });
  const form = h(
    "form",
    {
      class: "token-form",
      onsubmit: (e) => {
        e.preventDefault();
        token.set(input.value.trim());
        start();
      },
    },
    h("label", { for: "token" }, "API token"),
    input,
    message && h("p", { class: "error", role: "alert" }, message),
    h("button", { type: "submit", class: "primary" }, "Open the dashboard"),
  );
  main.replaceChildren(
    h("h1", {}, "This service needs a token"),
    h(
      "p",
      {},
      "It was started with --api-tokens. A read token (TOKEN:read) shows everything; a full token can also " +
        "retry and cancel jobs. The token is kept in this browser tab only.",
    ),
    form,
  );
  input.focus();
}

function showWho() {
  if (!access?.tokens_required) return who.replaceChildren();
  who.replaceChildren(
    h("span", { class: "muted" }, access.role === "read" ? "Read-only token" : "Token: read and write"),
    h(
      "button",
      {
        type: "button",
        class: "link",
        onclick: () => {
          token.clear();
          askToken(null);
        },
      },
      "Forget token",
    ),
  );
}

// --- routes ---------------------------------------------------------------------------------------

function route() {
  if (!access) return;
  stopView();
  const hash = location.hash || "#/";
  const job = hash.match(/^#\/jobs\/(.+)$/);
  if (job) stopView = jobPage(decodeURIComponent(job[1]));
  else if (hash === "#/workers") stopView = workersPage();
  else stopView = jobsPage();
  for (const a of document.querySelectorAll("nav a")) {
    const current = a.getAttribute("href") === (hash.startsWith("#/workers") ? "#/workers" : "#/");
    if (current) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
}

// --- the jobs -----------------------------------------------------------------------------------

function progress(job) {
  const c = job.counts;
  const finished = c.succeeded + c.failed + c.cancelled + c.skipped;
  const pct = fmt.percent(finished, c.total);
  const part = (n, kind) =>
    n > 0 && h("span", { class: `seg seg-${kind}`, style: { width: `${(100 * n) / c.total}%` } });
  const text =
    `${fmt.count(finished)} of ${fmt.count(c.total)} samples finished` +
    (c.failed ? `, ${fmt.count(c.failed)} failed` : "") +
    (c.skipped ? `, ${fmt.count(c.skipped)} skipped` : "") +
    (c.preparing ? `, ${fmt.count(c.preparing)} conversations to render` : "");
  return h(
    "div",
    { class: "progress" },
    h(
      "div",
      {
        class: "bar",
        role: "progressbar",
        "aria-label": `Samples finished: ${job.name || job.id}`,
        "aria-valuemin": 0,
        "aria-valuemax": 100,
        "aria-valuenow": pct,
        "aria-valuetext": `${pct}%: ${text}`,
      },
      part(c.succeeded, "ok"),
      part(c.failed, "failed"),
      part(c.cancelled + c.skipped, "cancelled"),
      part(c.staged + c.running, "busy"),
    ),
    h("span", { class: "pct" }, `${pct}%`),
  );
}

const eta = (job) => (TERMINAL.has(job.state) ? "–" : fmt.duration(job.eta_s));
const extracted = (job) => job.tokens.done + job.tokens.staged;

function jobsPage() {
  document.title = "Jobs – hsx";
  const view = { state: "", cursors: [null], next: null };
  const list = new Slot();
  const filter = h(
    "select",
    {
      id: "state-filter",
      onchange: () => {
        view.state = filter.value;
        view.cursors = [null];
        refresh().catch(failed);
      },
    },
    ["", ...JOB_STATES].map((s) => h("option", { value: s }, s || "any")),
  );
  main.replaceChildren(
    h("h1", {}, "Jobs"),
    h("div", { class: "toolbar" }, h("label", { for: "state-filter" }, "State"), filter),
    list.el,
  );

  const turn = (cursors) => {
    view.cursors = cursors;
    refresh().catch(failed);
  };

  async function refresh() {
    const q = new URLSearchParams({ limit: JOBS_PAGE });
    if (view.state) q.set("state", view.state);
    if (view.cursors.at(-1)) q.set("after", view.cursors.at(-1));
    const page = await api(`v1/jobs?${q}`);
    view.next = page.next_after;
    const rows = page.data.map((job) =>
      h(
        "tr",
        {},
        cell(
          "Job",
          h("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, "data-focus": `job-${job.id}` }, job.name || job.id),
          job.name && h("div", { class: "muted mono" }, job.id),
        ),
        cell(
          "State",
          badge(job.state),
          job.waiting_reason && h("div", { class: "note" }, `Waiting: ${job.waiting_reason}`),
          job.error && h("div", { class: "note error" }, job.error),
          job.warning && h("div", { class: "note" }, `Warning: ${job.warning}`),
        ),
        cell("Progress", progress(job)),
        cell(
          "Samples",
          `${fmt.count(job.counts.succeeded)} / ${fmt.count(job.counts.total)}`,
          job.counts.failed > 0 && h("div", { class: "error" }, `${fmt.count(job.counts.failed)} failed`),
          job.attempts?.retried > 0 && h("div", { class: "muted" }, `${fmt.count(job.attempts.retried)} retried`),
        ),
        cell("Tokens", `${fmt.short(extracted(job))} / ${fmt.short(job.tokens.total)}`),
        cell("Rate", fmt.rate(job.rate_tokens_per_s)),
        cell("ETA", eta(job)),
        cell("Created", fmt.when(job.created_at)),
      ),
    );
    const pager = h(
      "div",
      { class: "pager" },
      view.cursors.length > 1 &&
        h(
          "button",
          { type: "button", "data-focus": "jobs-newer", onclick: () => turn(view.cursors.slice(0, -1)) },
          "Newer jobs",
        ),
      page.has_more &&
        h(
          "button",
          { type: "button", "data-focus": "jobs-older", onclick: () => turn([...view.cursors, view.next]) },
          "Older jobs",
        ),
    );
    list.set(
      h(
        "div",
        {},
        rows.length
          ? table(
              "Jobs, newest first",
              ["Job", "State", "Progress", "Samples", "Tokens", "Rate", "ETA", "Created"],
              rows,
            )
          : h(
              "p",
              { class: "muted" },
              view.state
                ? `No ${view.state} jobs.`
                : "No jobs yet: create one with POST /v1/jobs, the SDK or hsx submit.",
            ),
        pager,
      ),
    );
  }
  return every(2000, refresh);
}

// --- one job ------------------------------------------------------------------------------------

function jobPage(id) {
  document.title = `${id} – hsx`;
  const abort = new AbortController();
  const slots = { head: new Slot(), progress: new Slot(), counts: new Slot(), stats: new Slot(), actions: new Slot() };
  const parts = { plot: new Slot(), retries: new Slot(), failed: new Slot(), files: new Slot(), readers: new Slot() };
  const section = (key, title, slot) =>
    h("section", { "aria-labelledby": `${key}-title` }, h("h2", { id: `${key}-title` }, title), slot.el);
  main.replaceChildren(
    h("p", { class: "crumbs" }, h("a", { href: "#/" }, "← All jobs")),
    ...Object.values(slots).map((s) => s.el),
    section("plot", "Throughput", parts.plot),
    section("retries", "Attempts and retries", parts.retries),
    section("failed", "Failed samples", parts.failed),
    section("files", "Manifest and shards", parts.files),
    section("readers", "Consumers", parts.readers),
  );

  let job = null;
  let following = false;
  let plotData = null;
  let plotFinal = false; // the plot shows the finished job: no need to load it again
  let plotLoading = false;
  let seen = { failed: -1, shards: -1 };
  const failedPages = { cursors: [null], next: null };

  function show(j) {
    job = j;
    document.title = `${j.name || j.id} – hsx`;
    slots.head.set(head(j));
    slots.progress.set(progress(j));
    slots.counts.set(counts(j));
    slots.stats.set(stats(j));
    slots.actions.set(actions(j));
    parts.retries.set(retries(j));
    if (j.counts.failed !== seen.failed) loadFailed().catch(failed);
    if (j.shards_written !== seen.shards) {
      loadFiles().catch(failed);
      loadConsumers().catch(failed);
    }
    if (!TERMINAL.has(j.state)) plotFinal = false;
    if (!plotData || (TERMINAL.has(j.state) && !plotFinal)) loadPlot().catch(failed);
    seen = { failed: j.counts.failed, shards: j.shards_written };
  }

  // The stream sends the job as it is now, then at every change; it ends once the job is finished.
  // A dropped connection is opened again.
  async function follow() {
    if (following) return;
    following = true;
    try {
      while (!abort.signal.aborted) {
        try {
          for await (const ev of events(jobPath(id, "events"), abort.signal)) {
            if (ev.event === "job") show(JSON.parse(ev.data));
          }
          if (job && TERMINAL.has(job.state)) return;
        } catch (err) {
          if (abort.signal.aborted) return;
          if (err.status === 404) {
            main.replaceChildren(h("h1", {}, "No such job"), h("p", {}, h("a", { href: "#/" }, "Back to the jobs")));
            return;
          }
          if (err.status) return failed(err);
        }
        await new Promise((done) => setTimeout(done, 2000));
      }
    } finally {
      following = false;
    }
  }

  async function act(path, done) {
    try {
      show(await api(jobPath(id, path), { method: "POST" }));
      say(done);
      follow();
    } catch (err) {
      failed(err);
    }
  }

  function actions(j) {
    if (access.role !== "write") return h("div");
    // A retry queues again what the job has not stored: its failed samples, and once it is cancelled the
    // ones the cancel left unrun, so a cancelled job goes on from where it stopped.
    const resume = j.state === "cancelled";
    const n = j.counts.failed + (resume ? j.counts.cancelled : 0);
    const retry = n > 0 && j.state !== "cancelling";
    const cancel = ["queued", "running"].includes(j.state);
    const plural = n === 1 ? "" : "s";
    return h(
      "div",
      { class: "actions" },
      retry &&
        h(
          "button",
          {
            type: "button",
            class: "primary",
            "data-focus": "retry",
            onclick: () => act("retry", `${n} sample${plural} queued again.`),
          },
          resume
            ? `Resume: run ${fmt.count(n)} sample${plural} not stored`
            : `Retry ${fmt.count(n)} failed sample${plural}`,
        ),
      cancel &&
        h(
          "button",
          {
            type: "button",
            class: "danger",
            "data-focus": "cancel",
            onclick: () => {
              if (confirm("Cancel this job? Queued samples are cancelled; those in flight are stored."))
                act("cancel", "Job cancelling: queued samples are being cancelled.");
            },
          },
          "Cancel job",
        ),
    );
  }

  async function loadPlot() {
    if (plotLoading) return;
    plotLoading = true;
    try {
      const done = job && TERMINAL.has(job.state);
      plotData = await api(`${jobPath(id, "throughput")}?points=120`, { signal: abort.signal });
      plotFinal = done;
      drawPlot();
    } finally {
      plotLoading = false;
    }
  }

  function drawPlot() {
    if (!plotData) return;
    const width = main.clientWidth;
    parts.plot.set(
      h(
        "figure",
        { class: "plot-box" },
        throughputPlot(plotData, width),
        h("figcaption", { class: "muted" }, `Tokens per second in windows of ${plotData.window_s} s.`),
      ),
    );
  }

  async function loadFailed() {
    const q = new URLSearchParams({ state: "failed", limit: SAMPLES_PAGE });
    if (failedPages.cursors.at(-1)) q.set("after", failedPages.cursors.at(-1));
    const page = await api(`${jobPath(id, "samples")}?${q}`, { signal: abort.signal });
    failedPages.next = page.next_after;
    const turn = (cursors) => {
      failedPages.cursors = cursors;
      loadFailed().catch(failed);
    };
    const rows = page.data.map((s) =>
      h(
        "tr",
        {},
        cell("Sample", h("span", { class: "mono" }, s.id)),
        cell("Index", fmt.count(s.index)),
        cell("Attempts", fmt.count(s.attempts)),
        cell("Reason", h("span", { class: "reason" }, s.last_error || "–")),
      ),
    );
    parts.failed.set(
      h(
        "div",
        {},
        rows.length
          ? table("Failed samples and why", ["Sample", "Index", "Attempts", "Reason"], rows)
          : h(
              "p",
              { class: "muted" },
              failedPages.cursors.length > 1 ? "No more failed samples." : "No failed samples.",
            ),
        h(
          "div",
          { class: "pager" },
          failedPages.cursors.length > 1 &&
            h(
              "button",
              { type: "button", "data-focus": "failed-prev", onclick: () => turn(failedPages.cursors.slice(0, -1)) },
              "Previous page",
            ),
          page.has_more &&
            h(
              "button",
              {
                type: "button",
                "data-focus": "failed-next",
                onclick: () => turn([...failedPages.cursors, failedPages.next]),
              },
              "Next page",
            ),
        ),
      ),
    );
  }

  async function loadFiles() {
    const shards = await api(jobPath(id, "shards"), { signal: abort.signal });
    const manifest = jobPath(id, "manifest");
    const rows = shards.data.map((s) =>
      h(
        "tr",
        {},
        cell("Seq", fmt.count(s.seq)),
        cell(
          "Shard",
          s.deleted
            ? h("span", { class: "muted" }, `${s.name} (deleted: read by every consumer)`)
            : fileLink(jobPath(id, "shards", s.name), s.name, s.name),
        ),
        cell("Samples", fmt.count(s.num_samples)),
        cell("Tokens", fmt.count(s.num_tokens)),
        cell("Size", fmt.bytes(s.bytes)),
        cell("sha256", h("span", { class: "mono", title: s.sha256 }, `${s.sha256.slice(0, 12)}…`)),
      ),
    );
    parts.files.set(
      h(
        "div",
        {},
        h(
          "p",
          {},
          fileLink(manifest, "manifest.json", `manifest-${id}.json`),
          " – every shard with its sha256, and where each sample lies.",
        ),
        rows.length
          ? table("Shards, in the order recorded", ["Seq", "Shard", "Samples", "Tokens", "Size", "sha256"], rows)
          : h("p", { class: "muted" }, "No shard written yet."),
        shards.has_more &&
          h("p", { class: "muted" }, `The first ${fmt.count(rows.length)} of ${fmt.count(shards.committed)} shards.`),
      ),
    );
  }

  async function loadConsumers() {
    const consumers = await api(jobPath(id, "consumers"), { signal: abort.signal });
    const options = (job && job.options) || {};
    const limit = options.max_unread_bytes ? `, at most ${fmt.bytes(options.max_unread_bytes)} unread at a time` : "";
    const retention =
      options.retention === "acked" ? "a shard is deleted once every consumer has read it" : "every shard is kept";
    const rows = consumers.data.map((c) =>
      h(
        "tr",
        {},
        cell("Consumer", c.name),
        cell("Read to seq", fmt.count(c.read_seq)),
        cell("Ranks", c.world_size ? `${c.ranks.length} of ${c.world_size} acknowledged` : "none yet"),
        cell("Lag (shards)", fmt.count(c.lag_shards)),
        cell("Lag (bytes)", fmt.bytes(c.lag_bytes)),
      ),
    );
    parts.readers.set(
      h(
        "div",
        {},
        h("p", {}, `Retention: ${retention}${limit}.`),
        rows.length
          ? table("Consumers", ["Consumer", "Read to seq", "Ranks", "Lag (shards)", "Lag (bytes)"], rows)
          : h("p", { class: "muted" }, "No consumer: trainers that follow the job under a consumer name show here."),
      ),
    );
  }

  let resized;
  const onResize = () => {
    clearTimeout(resized);
    resized = setTimeout(drawPlot, 150);
  };
  window.addEventListener("resize", onResize);
  follow();
  // Every few seconds: the plot of a running job, and whether a finished one was retried elsewhere.
  const stopTimer = every(5000, async () => {
    if (job && TERMINAL.has(job.state) && !following) {
      const now = await api(jobPath(id), { signal: abort.signal });
      if (!TERMINAL.has(now.state)) {
        show(now);
        follow();
      }
    }
    if (job && !plotFinal) await loadPlot();
    if (job) await loadConsumers();
  });
  return () => {
    abort.abort();
    stopTimer();
    window.removeEventListener("resize", onResize);
  };
}

// A link to a file of the API. With a token the browser cannot send it on a plain link, so the file is
// fetched with it and saved; without one the link works as it is.
function fileLink(path, text, filename) {
  return h(
    "a",
    {
      href: path,
      "data-focus": `file-${filename}`,
      onclick: (e) => {
        if (!token.get()) return;
        e.preventDefault();
        download(path, filename).catch(failed);
      },
    },
    text,
  );
}

function head(j) {
  return h(
    "header",
    { class: "job-head" },
    h("h1", {}, j.name || j.id, " ", badge(j.state)),
    j.name && h("p", { class: "muted mono" }, j.id),
    j.waiting_reason && h("p", { class: "note", role: "status" }, `Waiting: ${j.waiting_reason}`),
    j.error && h("p", { class: "note error" }, `Failed: ${j.error}`),
    j.warning && h("p", { class: "note" }, `Warning: ${j.warning}`),
    j.disk_warning && h("p", { class: "note" }, `Disk: ${j.disk_warning}`),
  );
}

function counts(j) {
  return h(
    "ul",
    { class: "counts", "aria-label": "Samples by state" },
    JOB_STATES.filter((s) => s !== "cancelling")
      .flatMap((s) => (s === "running" ? ["running", "staged"] : [s]))
      .map((s) =>
        h("li", { class: `count state-${s}` }, h("span", { class: "n" }, fmt.count(j.counts[s])), h("span", {}, s)),
      ),
  );
}

// The job's attempts as they ended, and the retried or failed ones by reason code, live: retries show
// here while the job runs, long before a sample fails for good.
function retries(j) {
  const a = j.attempts || { total: 0, by_reason: {} };
  const reasons = Object.entries(a.by_reason || {});
  const summary = [
    `${fmt.count(a.total)} attempt${a.total === 1 ? "" : "s"} ended: ${fmt.count(a.ok)} ok, `,
    `${fmt.count(a.retried)} retried, ${fmt.count(a.failed)} failed, ${fmt.count(a.interrupted)} interrupted`,
    " (given back unspent).",
    a.waiting_retry
      ? ` ${fmt.count(a.waiting_retry)} sample${a.waiting_retry === 1 ? "" : "s"} waiting for another attempt.`
      : "",
  ].join("");
  const rows = reasons.map(([code, n]) =>
    h("tr", {}, cell("Reason", h("span", { class: "mono" }, code || "–")), cell("Attempts", fmt.count(n))),
  );
  return h(
    "div",
    {},
    h("p", { role: "status" }, summary),
    rows.length
      ? table("Retried and failed attempts by reason", ["Reason", "Attempts"], rows)
      : h("p", { class: "muted" }, "No attempt was retried or failed."),
  );
}

// How a job's shards store its hidden states (JobOptions.encoding), as the page says it.
const ENCODINGS = {
  raw: "raw (as the model server gave them)",
  lossless: "lossless (zstd, bit for bit)",
  fp8: "fp8 (e4m3, a scale per row)",
};

function stats(j) {
  const item = (term, value) => h("div", {}, h("dt", {}, term), h("dd", {}, value));
  return h(
    "dl",
    { class: "stats" },
    item("Tokens extracted", `${fmt.count(extracted(j))} of ${fmt.count(j.tokens.total)}`),
    item("In shards", fmt.count(j.tokens.done)),
    item("Rate", fmt.rate(j.rate_tokens_per_s)),
    item("ETA", eta(j)),
    item("Created", fmt.when(j.created_at)),
    item("Started", fmt.when(j.started_at)),
    item("Finished", fmt.when(j.finished_at)),
    // From its creation; preparing (conversations rendered and regenerated) and extracting apart, as they overlap.
    item("Elapsed", fmt.duration(j.elapsed_s)),
    j.preparing_s != null && item("Preparing", fmt.duration(j.preparing_s)),
    item("Extracting", fmt.duration(j.extracting_s)),
    item("Shards written", fmt.count(j.shards_written)),
    item("Estimated size", fmt.bytes(j.estimated_bytes)),
    item(
      "Layers",
      Array.isArray(j.layers) ? j.layers.join(", ") : j.layers && j.layers !== "any" ? j.layers : "the server's",
    ),
    item("Encoding", ENCODINGS[j.options?.encoding ?? "raw"] ?? j.options.encoding),
    j.model?.model_path && item("Model", h("span", { class: "mono" }, j.model.model_path)),
  );
}

// --- the workers ---------------------------------------------------------------------------------

function workersPage() {
  document.title = "Workers – hsx";
  const body = new Slot();
  main.replaceChildren(
    h("h1", {}, "Workers"),
    h(
      "p",
      { class: "muted" },
      "Every writer that reported in the last 30 seconds: one per dump root, each with its model server.",
    ),
    body.el,
  );
  return every(3000, async () => {
    const [health, running, queued] = await Promise.all([
      api("healthz"),
      api("v1/jobs?state=running&limit=100"),
      api("v1/jobs?state=queued&limit=100"),
    ]);
    const waiting = [...running.data, ...queued.data].filter((j) => j.waiting_reason);
    const rows = health.writers.map((w) =>
      h(
        "tr",
        {},
        cell("Writer", h("span", { class: "mono" }, w.identity)),
        cell(
          "Model server",
          w.server ? h("span", { class: "mono" }, w.server.url || "–") : "–",
          w.server?.model_path && h("div", { class: "muted mono" }, w.server.model_path),
          w.server?.source &&
            h(
              "div",
              { class: "muted" },
              `source: ${w.server.source}${w.server.name_by ? `, names by ${w.server.name_by}` : ""}`,
            ),
        ),
        cell("Layers", ...layersOf(w)),
        cell("State", badge(w.state), w.reason && h("div", { class: "note" }, w.reason)),
        cell("Heartbeat", h("span", { title: w.heartbeat_at }, fmt.ago(w.heartbeat_at))),
        cell("Rate", fmt.rate(w.tokens_per_s)),
      ),
    );
    body.set(
      h(
        "div",
        {},
        h("p", {}, "Service: ", badge(health.status), " database: ", h("span", { class: "mono" }, health.database)),
        (health.warnings || []).map((w) => h("p", { class: "note", role: "status" }, `Warning: ${w}`)),
        rows.length
          ? table("Writers", ["Writer", "Model server", "Layers", "State", "Heartbeat", "Rate"], rows)
          : h(
              "p",
              { class: "note" },
              "No writer has reported in the last 30 seconds: start hsx serve with a dump root against this database.",
            ),
        h("h2", {}, "Jobs that wait"),
        waiting.length
          ? h(
              "ul",
              { class: "plain" },
              waiting.map((j) =>
                h(
                  "li",
                  {},
                  h("a", { href: `#/jobs/${encodeURIComponent(j.id)}`, "data-focus": `wait-${j.id}` }, j.name || j.id),
                  `: ${j.waiting_reason}`,
                ),
              ),
            )
          : h("p", { class: "muted" }, "No job is waiting for a writer."),
      ),
    );
  });
}

// The layer sets a writer's server gives (a job asking for one runs there), its layers when it gives no named
// set, and a note when it cannot take a job of the default set: such jobs wait although it is ready.
function layersOf(w) {
  const sets = w.layer_sets || [];
  const layers = w.server?.layers;
  return [
    sets.length
      ? h("span", { class: "mono" }, sets.join(", "))
      : layers
        ? h("span", { class: "mono" }, `[${layers.join(", ")}]`)
        : "–",
    w.serves_default === false &&
      h("div", { class: "note" }, "Not the default layers (eagle3): jobs must name one of these to run here."),
  ];
}

// After a move to another page, keyboard and screen reader users start at its content.
window.addEventListener("hashchange", () => {
  route();
  main.focus({ preventScroll: true });
});
start();
