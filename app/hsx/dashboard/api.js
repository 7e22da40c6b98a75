// The hsx API as the dashboard calls it: the same public endpoints any client uses, with the bearer
// token the user gave (kept in sessionStorage: gone when the tab closes). URLs are relative, so the
// page also works behind a reverse proxy that serves the service under a path prefix.

const TOKEN_KEY = "hsx.token";

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

export class ApiError extends Error {
  constructor(status, problem) {
    super(problem.detail || problem.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

function headers(extra = {}) {
  const out = { Accept: "application/json", ...extra };
  const value = token.get();
  if (value) out.Authorization = `Bearer ${value}`;
  return out;
}

async function failure(resp) {
  let problem = {};
  try {
    problem = await resp.json();
  } catch {
    problem = { title: resp.statusText };
  }
  return new ApiError(resp.status, problem);
}

export async function api(path, { method = "GET", signal } = {}) {
  const resp = await fetch(path, { method, headers: headers(), signal, cache: "no-store" });
  if (!resp.ok) throw await failure(resp);
  return resp.status === 204 ? null : resp.json();
}

export const jobPath = (id, ...rest) => `v1/jobs/${[id, ...rest].map(encodeURIComponent).join("/")}`;

// GET .../events as server-sent events. EventSource cannot send an Authorization header, so the stream
// is read with fetch and parsed here: yields {event, data} for each event until the server ends it.
export async function* events(path, signal) {
  const resp = await fetch(path, { headers: headers({ Accept: "text/event-stream" }), signal, cache: "no-store" });
  if (!resp.ok) throw await failure(resp);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).replace(/\r$/, "");
      buffer = buffer.slice(end + 1);
      if (line === "") {
        if (data.length) yield { event: event || "message", data: data.join("\n") };
        event = "";
        data = [];
      } else if (!line.startsWith(":")) {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") event = text;
        else if (field === "data") data.push(text);
      }
    }
  }
}

// A file behind the token (the manifest, a shard): fetched with the header, then saved from memory.
// Without a token the link's own href works and the browser streams the file itself.
export async function download(path, filename) {
  const resp = await fetch(path, { headers: headers({ Accept: "*/*" }), cache: "no-store" });
  if (!resp.ok) throw await failure(resp);
  const url = URL.createObjectURL(await resp.blob());
  const link = Object.assign(document.createElement("a"), { href: url, download: filename });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}
