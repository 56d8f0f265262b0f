"""Run ``espalier.server.main`` under an audit hook that reports forbidden I/O as stdout events.

``python tests/server/audit_hook.py serve ...`` behaves as ``python -m espalier.server.main serve
...``, plus one JSON line ``{"event": "audit", ...}`` for every file opened whose path contains
:data:`TRAP` and for every socket connect made by Python code (grpc's own sockets are native and
never show), in the server and in the engine process it spawns. Tests put their bait files under
a ``TRAP`` directory and assert no audit event.
"""

from __future__ import annotations

import json
import sys
from typing import Any

TRAP = "espalier-trap"


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and args and TRAP in str(args[0]):
        print(json.dumps({"event": "audit", "what": "open", "path": str(args[0])}), flush=True)
    elif event == "socket.connect":
        print(json.dumps({"event": "audit", "what": "connect", "to": repr(args[1])}), flush=True)


if __name__ == "__mp_main__":  # a spawned child (the engine process) audits as well
    sys.addaudithook(_hook)

if __name__ == "__main__":
    sys.addaudithook(_hook)
    sys.argv = ["espalier", *sys.argv[1:]]
    # Called, not run with runpy: this module stays __main__, so the children multiprocessing
    # spawns import it (as __mp_main__) and install the hook too.
    from espalier.server.main import main

    raise SystemExit(main())
