"""The dashboard in a real browser: Debian's Chromium, driven by Playwright, against the reference server and
the service with tokens. A job whose first sample gets a bad dump is followed live to 100% with the failed
sample and its reason on the page; a retry (by keyboard) makes it succeed; a read token sees the same and
gets no buttons. Screenshots at 1280 px and at phone width are saved in the folder the test prints."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.support.browser import (
    DESKTOP,
    PHONE,
    accessibility_faults,
    artifacts_dir,
    chromium_path,
    fits_width,
    tab_to,
)
from tests.support.samples import make_samples
from tests.support.stack import start_stack, stop_stack

sync_api = pytest.importorskip("playwright.sync_api", reason="the dashboard's test needs playwright (the [test] extra)")
expect = sync_api.expect

ADMIN, VIEWER = "dash-admin", "dash-viewer"
SLOW = 120_000  # ms: a job of a few samples on two busy cores


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    if path is None:
        pytest.skip(
            "no Chromium found: install Debian's (apt-get install -y chromium; .ci/run does) or set HSX_TEST_CHROMIUM"
        )
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=path)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, checkpoint):
    svc, ref = start_stack(
        tmp_path_factory.mktemp("dashboard"),
        checkpoint,
        ["--max-attempts", "1", "--api-tokens", f"{ADMIN},{VIEWER}:read"],
        reference_extra=["--enable-fault-injection"],
    )
    yield svc, ref
    stop_stack(svc, ref)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return artifacts_dir(tmp_path_factory.mktemp("dashboard-screenshots"))


@pytest.fixture
def open_page(browser, stack):
    """A fresh tab (its own sessionStorage) on the dashboard, signed in with a token; uncaught errors fail."""
    svc, _ = stack
    contexts, errors = [], []

    def open_with(token: str):
        context = browser.new_context(viewport=DESKTOP, accept_downloads=True)
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(svc.url + "/")
        page.get_by_label("API token").fill(token)
        page.get_by_role("button", name="Open the dashboard").click()
        expect(page.get_by_role("heading", name="Jobs", exact=True)).to_be_visible()
        return page

    yield open_with
    for context in contexts:
        context.close()
    assert not errors, errors


def set_faults(ref_url: str, settings: dict | None) -> None:
    httpx.delete(ref_url + "/admin/faults").raise_for_status()
    if settings:
        httpx.post(ref_url + "/admin/faults", json=settings).raise_for_status()


def create_job(svc, name: str, seed: int) -> dict:
    samples = make_samples(8, seed=seed, lo=8, hi=40)
    resp = svc.client.post(
        svc.url + "/v1/jobs", json={"name": name, "samples": samples}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert resp.status_code == 202, resp.text
    return resp.json()


def failed_samples(svc, job_id: str, token: str) -> list[dict]:
    resp = svc.get(f"/v1/jobs/{job_id}/samples?state=failed", headers={"Authorization": f"Bearer {token}"})
    return resp.json()["data"]


def screenshots(page, folder, name: str) -> None:
    """The page at desktop and at phone width; at both it must need no sideways scrolling, and pass the
    accessibility basics."""
    for label, size in (("desktop", DESKTOP), ("phone", PHONE)):
        page.set_viewport_size(size)
        page.wait_for_timeout(300)  # the plot redraws for the new width
        page.screenshot(path=str(folder / f"{name}-{label}.png"), full_page=True)
        assert fits_width(page), f"{name} at {label} width scrolls sideways"
        assert accessibility_faults(page) == [], f"{name} at {label} width"
    page.set_viewport_size(DESKTOP)


def test_a_failed_sample_is_followed_live_and_retried_until_the_job_succeeds(stack, open_page, artifacts, capsys):
    svc, ref = stack
    with capsys.disabled():
        print(f"\ndashboard screenshots: {artifacts}")
    # The first request's dump is malformed (one attempt allowed: the sample fails); a few are slow, so
    # that the page watches the job run.
    set_faults(ref.url, {"bad_dumps": {"count": 1, "kind": "wrong_shape"}, "delay": {"count": 6, "seconds": 0.3}})
    page = open_page(ADMIN)
    job = create_job(svc, "live-run", seed=71)

    link = page.get_by_role("link", name="live-run", exact=True)
    expect(link).to_be_visible()  # the jobs list polls
    screenshots(page, artifacts, "jobs")
    link.click()

    heading = page.get_by_role("heading", level=1)
    bar = page.get_by_role("progressbar")
    expect(bar).to_have_attribute("aria-valuenow", "100", timeout=SLOW)
    # one sample failed, the others are stored: the job is partial, not failed
    expect(heading).to_contain_text("partial", timeout=SLOW)
    (failed,) = failed_samples(svc, job["id"], ADMIN)
    assert failed["last_error"].startswith("wrong_shape"), failed
    reasons = page.get_by_role("table", name="Failed samples and why")
    expect(reasons).to_contain_text(failed["id"])
    expect(reasons).to_contain_text(failed["last_error"])
    # The job's attempts by reason, from its counters: shown while it runs, and kept after a retry.
    by_reason = page.get_by_role("table", name="Retried and failed attempts by reason")
    expect(by_reason).to_contain_text("wrong_shape")
    expect(page.get_by_text(re.compile(r"attempts ended: \d+ ok, 0 retried, 1 failed"))).to_be_visible()
    expect(page.get_by_role("img", name=re.compile("^Throughput in"))).to_be_visible()
    screenshots(page, artifacts, "job-partial")

    # The manifest link works with a token, which a plain link cannot send.
    with page.expect_download() as download:
        page.get_by_role("link", name="manifest.json").click()
    manifest = json.loads(download.value.path().read_text())
    assert manifest["job_id"] == job["id"] and manifest["num_stored"] == 7

    set_faults(ref.url, None)
    retry = page.get_by_role("button", name="Retry 1 failed sample")
    tab_to(page, retry)
    page.keyboard.press("Enter")
    expect(heading).to_contain_text("succeeded", timeout=SLOW)
    expect(bar).to_have_attribute("aria-valuenow", "100")
    expect(page.get_by_text("No failed samples.")).to_be_visible()
    expect(page.get_by_role("button", name=re.compile("Retry|Cancel"))).to_have_count(0)
    expect(page.get_by_role("link", name=re.compile(r"^shard-\d+\.safetensors$")).first).to_be_visible()
    assert svc.get(f"/v1/jobs/{job['id']}", headers={"Authorization": f"Bearer {ADMIN}"}).json()["state"] == (
        "succeeded"
    )
    screenshots(page, artifacts, "job-succeeded")

    page.get_by_role("link", name="Workers").click()
    workers = page.get_by_role("table", name="Writers")
    expect(workers).to_contain_text("ready")
    expect(workers).to_contain_text(ref.url)
    screenshots(page, artifacts, "workers")


def test_a_read_token_sees_everything_and_gets_no_buttons(stack, browser, open_page, artifacts):
    svc, ref = stack
    set_faults(ref.url, {"bad_dumps": {"count": 1, "kind": "missing_layer"}})
    job = create_job(svc, "read-only-view", seed=72)

    # A token the service does not know is refused on the page, and nothing is shown.
    context = browser.new_context(viewport=DESKTOP)
    try:
        page = context.new_page()
        page.goto(svc.url + "/")
        page.get_by_label("API token").fill("not-a-token")
        page.get_by_role("button", name="Open the dashboard").click()
        expect(page.get_by_role("alert")).to_contain_text("did not accept")
        screenshots(page, artifacts, "token")
    finally:
        context.close()

    page = open_page(VIEWER)
    expect(page.get_by_text("Read-only token")).to_be_visible()
    page.goto(f"{svc.url}/#/jobs/{job['id']}")
    expect(page.get_by_role("heading", level=1)).to_contain_text("partial", timeout=SLOW)
    (failed,) = failed_samples(svc, job["id"], VIEWER)
    expect(page.get_by_role("table", name="Failed samples and why")).to_contain_text(failed["last_error"])
    expect(page.get_by_role("table", name="Shards")).to_be_visible()
    # The only button is the one that forgets the token: no retry, no cancel.
    expect(page.get_by_role("button")).to_have_count(1)
    expect(page.get_by_role("button")).to_have_text("Forget token")
    screenshots(page, artifacts, "job-read-only")
