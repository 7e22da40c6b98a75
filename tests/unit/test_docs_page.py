"""/docs: Swagger UI of one pinned release, each file loaded only with its integrity hash, and a
content security policy that admits exactly those files and the page's one inline script."""

from __future__ import annotations

import base64
import hashlib
import re

from fastapi.testclient import TestClient

from hsx.api import docs_page
from hsx.api.app import create_app
from hsx.config import Settings


def test_the_docs_page_runs_only_the_pinned_files_and_its_own_script(tmp_path):
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'hsx.db'}"))
    with TestClient(app) as c:
        page = c.get("/docs")
        assert c.get("/redoc").status_code == 404
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = dict(p.split(" ", 1) for p in page.headers["content-security-policy"].split("; "))
    assert policy["default-src"] == "'none'"
    html = page.text
    external = re.findall(r'<script src="([^"]+)" integrity="(sha384-[A-Za-z0-9+/=]{64})" crossorigin', html)
    assert external == [docs_page.SCRIPT]
    assert re.findall(r'<link rel="stylesheet" href="([^"]+)" integrity="(sha384-[^"]+)"', html) == [docs_page.STYLE]
    assert f"@{docs_page.SWAGGER_UI_VERSION}/" in docs_page.SCRIPT[0], "a pinned release, not a floating one"
    inline = re.findall(r"<script>(.*?)</script>", html, re.S)
    assert len(inline) == 1 and len(re.findall(r"<script", html)) == 2
    digest = "sha256-" + base64.b64encode(hashlib.sha256(inline[0].encode()).digest()).decode()
    assert policy["script-src"].split() == [docs_page.SCRIPT[0], f"'{digest}'"]
    assert policy["style-src"].split()[0] == docs_page.STYLE[0]
