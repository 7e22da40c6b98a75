"""A real browser for the dashboard's tests: the system's Chromium driven by Playwright (never a browser that
Playwright downloads), and the accessibility checks run on each page it shows."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}


def chromium_path() -> str | None:
    """$HSX_TEST_CHROMIUM, else the first Chromium on PATH (Debian's package installs /usr/bin/chromium)."""
    given = os.environ.get("HSX_TEST_CHROMIUM")
    if given:
        return given
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def artifacts_dir(fallback: Path) -> Path:
    """Where screenshots go: $HSX_TEST_ARTIFACTS/dashboard when set (CI keeps it), else `fallback`."""
    root = os.environ.get("HSX_TEST_ARTIFACTS")
    folder = Path(root) / "dashboard" if root else fallback
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# WCAG 2 contrast of every visible piece of text against the first opaque background behind it:
# 4.5:1, or 3:1 for large text (24 px, or 18.66 px bold). SVG text is checked by its fill.
CONTRAST_JS = """
() => {
  const rgba = (c) => (c.match(/[\\d.]+/g) || ["0", "0", "0", "0"]).map(Number);
  const lum = ([r, g, b]) => {
    const f = (v) => ((v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4);
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const background = (el) => {
    for (let e = el; e; e = e.parentElement) {
      const c = rgba(getComputedStyle(e).backgroundColor);
      if (c.length < 4 || c[3] > 0) return c;
    }
    return [255, 255, 255];
  };
  const bad = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node; (node = walker.nextNode()); ) {
    const text = node.textContent.trim();
    const el = node.parentElement;
    if (!text || !el || !el.getClientRects().length) continue;
    const style = getComputedStyle(el);
    if (style.visibility === "hidden") continue;
    const fg = rgba(el.closest("svg") ? style.fill : style.color);
    const [hi, lo] = [lum(fg), lum(background(el))].sort((a, b) => b - a);
    const ratio = (hi + 0.05) / (lo + 0.05);
    const size = parseFloat(style.fontSize);
    const large = size >= 24 || (size >= 18.66 && parseInt(style.fontWeight, 10) >= 700);
    if (ratio < (large ? 3 : 4.5)) bad.push(`${el.tagName} "${text.slice(0, 40)}": ${ratio.toFixed(2)}:1`);
  }
  return bad;
}
"""

# Controls without a name a screen reader could say, and fields without a label.
UNNAMED_JS = """
() => [
  ...[...document.querySelectorAll("a[href], button")].filter(
    (e) => !(e.textContent.trim() || e.getAttribute("aria-label"))
  ),
  ...[...document.querySelectorAll("input, select, textarea")].filter(
    (e) => !(e.labels && e.labels.length) && !e.getAttribute("aria-label")
  ),
].map((e) => e.outerHTML.slice(0, 120))
"""


def accessibility_faults(page) -> list[str]:
    """What the page gets wrong of the basics: text contrast, names of controls, labels of fields."""
    return [f"contrast: {x}" for x in page.evaluate(CONTRAST_JS)] + [f"unnamed: {x}" for x in page.evaluate(UNNAMED_JS)]


def fits_width(page) -> bool:
    """Nothing sticks out sideways: the page needs no horizontal scrolling."""
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def tab_to(page, locator, presses: int = 80) -> None:
    """Press Tab until `locator` has the keyboard focus: it is reachable without a mouse."""
    for _ in range(presses):
        page.keyboard.press("Tab")
        if locator.evaluate("e => e === document.activeElement"):
            return
    raise AssertionError(f"{locator} is not reachable with Tab within {presses} presses")
