"""The interactive API documentation at /docs: Swagger UI of one pinned release, loaded from a CDN
only if its files are byte for byte the ones published (subresource integrity), under a content
security policy that lets the page run nothing else. FastAPI's own page loads a floating major
version and sets no policy, so whatever the CDN served for that name would run with the page's
origin. The hashes are those of the npm package swagger-ui-dist at SWAGGER_UI_VERSION, which the
CDN serves unmodified; the bundle is 1.5 MB, so it is not shipped in the wheel."""

from __future__ import annotations

import base64
import hashlib

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

SWAGGER_UI_VERSION = "5.32.0"
CDN = "https://cdn.jsdelivr.net"
_BASE = f"{CDN}/npm/swagger-ui-dist@{SWAGGER_UI_VERSION}"
SCRIPT = (f"{_BASE}/swagger-ui-bundle.js", "sha384-7xcoc6ZKDFF7Ek627QTC3Bg/K+5Y36NJ8MWAE43D2m6+3Sh9XO3tdsfHhrS8gNIQ")
STYLE = (f"{_BASE}/swagger-ui.css", "sha384-3nuX7df3EaAoiqLBeyS1Ola0Gpg9ryJKVtarubwfnA1cOH8AWHUdbPSIvEqPZ9VH")

_START = (
    'SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true,'
    " presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset]});"
)
_START_HASH = "sha256-" + base64.b64encode(hashlib.sha256(_START.encode()).digest()).decode()

PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>hsx API</title>
<link rel="stylesheet" href="{STYLE[0]}" integrity="{STYLE[1]}" crossorigin="anonymous">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{SCRIPT[0]}" integrity="{SCRIPT[1]}" crossorigin="anonymous"></script>
<script>{_START}</script>
</body>
</html>
"""

# Swagger UI sets inline styles and draws its icons from data: URLs; it fetches only /openapi.json.
POLICY = "; ".join(
    [
        "default-src 'none'",
        f"script-src {SCRIPT[0]} '{_START_HASH}'",
        f"style-src {STYLE[0]} 'unsafe-inline'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)


def install(app: FastAPI) -> None:
    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return HTMLResponse(PAGE, headers={"Content-Security-Policy": POLICY, "Referrer-Policy": "no-referrer"})
