"""Server settings that silently break dumps are detected here, never assumed away."""

from __future__ import annotations


def dump_breaking_settings(server_info: dict) -> list[str]:
    """Reasons this server's settings would produce partial or split dumps (empty: fine)."""
    problems = []
    if server_info.get("disable_radix_cache") is False:
        problems.append(
            "the server's prefix (radix) cache is on, so dumps may miss cached prompt rows; "
            "restart it with --disable-radix-cache"
        )
    chunk = server_info.get("chunked_prefill_size")
    if isinstance(chunk, int) and chunk > 0:
        problems.append(
            f"the server splits prompts into chunks of {chunk} tokens (chunked prefill), so one "
            "prompt would be dumped in pieces; restart it with --chunked-prefill-size -1"
        )
    return problems
