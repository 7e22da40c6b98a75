"""The class of every JSON answer the API gives: JSON documents and RFC 9457 problems alike."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class NewlineJSONResponse(JSONResponse):
    """JSON that ends with a newline, as text on a terminal does: answers printed one after another
    (curl in a shell) stay on lines of their own. Content-Length counts it, being taken from the body."""

    def render(self, content: Any) -> bytes:
        return super().render(content) + b"\n"
