// Numbers, rates, durations and times as the dashboard prints them.

const integer = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const compact = new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 1 });

export const count = (n) => (n == null ? "–" : integer.format(n));
export const short = (n) => (n == null ? "–" : n < 10_000 ? integer.format(n) : compact.format(n));
export const rate = (perS) => (perS == null ? "–" : `${short(perS)} tok/s`);
export const percent = (part, whole) => (whole ? Math.floor((100 * part) / whole) : 0);

export function duration(seconds) {
  if (seconds == null) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min ${String(s % 60).padStart(2, "0")} s`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h} h ${String(m % 60).padStart(2, "0")} min`;
  return `${Math.floor(h / 24)} d ${h % 24} h`;
}

export function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = n;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${i ? v.toFixed(1) : v} ${units[i]}`;
}

// A time of today as its clock time, any other with its date: in the viewer's time zone.
export function when(iso) {
  if (!iso) return "–";
  const t = new Date(iso);
  const sameDay = t.toDateString() === new Date().toDateString();
  return sameDay
    ? t.toLocaleTimeString([], { hour12: false })
    : t.toLocaleString([], { hour12: false, dateStyle: "medium", timeStyle: "short" });
}

export const ago = (iso) => (iso ? `${duration((Date.now() - new Date(iso).getTime()) / 1000)} ago` : "–");
