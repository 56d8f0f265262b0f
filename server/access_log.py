"""The access log: one JSON line per RPC on stderr (id, method, status, tokens, seconds).

No prompt, grammar or output text is ever logged: only what an operator needs to trace a call.
"""

from __future__ import annotations

import json
import sys


def log_request(
    method: str,
    request_id: str,
    code: str,
    prompt_tokens: int,
    completion_tokens: int,
    seconds: float,
) -> None:
    """Write one access line; ``request_id`` is cut to 128 printable characters."""
    safe_id = "".join(c for c in request_id[:128] if c.isprintable())
    line = {
        "event": "request",
        "id": safe_id,
        "method": method,
        "status": code,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "seconds": round(seconds, 4),
    }
    print(json.dumps(line), file=sys.stderr, flush=True)
