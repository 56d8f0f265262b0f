"""Try each compile first in a child process that is killed when it runs past its timeout.

A grammar compile cannot be interrupted from Python: run on a thread and abandoned at its timeout,
it keeps running (some for many minutes, a few forever), stealing a core and the GIL from whatever
runs next. ``bench/tree.py`` measures sub-millisecond fills on a 2-core machine, so it asks
:class:`CompileProbe` first and compiles in-process only what the child finished in time.

Protocol (one JSON object a line): the child prints ``{"ready": true}`` once its tokenizer is
loaded, then answers each ``{"backend", "kind", "source"}`` request with ``{"ok", "seconds"}``
(``ok`` false with ``"error"`` when the backend refuses the grammar). Run the child as
``python bench/compile_probe.py BACKENDS [TOKENIZER_DIR]`` (comma-separated backend
names, built before ``ready``; no folder: the embedded default tokenizer).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from espalier.constrained.spec import GrammarKind, GrammarSpec

READY_TIMEOUT_S = 600.0
"""How long a starting child may take to load its tokenizer (the default one takes 10-20 s)."""


@dataclass
class ProbeResult:
    """One probed compile: ``ok`` (compiled within the timeout), wall ``seconds`` in the child
    (the timeout when it was killed), ``timed_out``, and the backend's error if it refused."""

    ok: bool
    seconds: float
    timed_out: bool = False
    error: str = ""


class CompileProbe:
    """A persistent child process that compiles grammars on request, restarted after a kill.

    Args:
        backends: the backends the child builds at start (their tokenizer tables take seconds,
            which must not count against a compile's timeout).
        tokenizer_dir: a Hugging Face tokenizer folder the child loads
            (``TokenizerInfo.from_pretrained``); ``None`` for the embedded default tokenizer.
    """

    def __init__(self, backends: list[str], tokenizer_dir: str | None = None) -> None:
        self.backends = backends
        self.tokenizer_dir = tokenizer_dir
        self.kills = 0
        self._child: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    def compile(self, backend: str, spec: GrammarSpec, timeout: float) -> ProbeResult:
        """Compile ``spec`` with ``backend`` in the child; kill the child past ``timeout`` s
        (also when its reply says the compile took longer: it came in while this thread was not
        looking)."""
        child = self._ready_child()
        request = {"backend": backend, "kind": spec.kind.name, "source": spec.source}
        assert child.stdin is not None
        child.stdin.write(json.dumps(request) + "\n")
        child.stdin.flush()
        line = self._next_line(timeout)
        reply = json.loads(line) if line is not None else None
        # a reply can be waiting already when this thread first looks (it was descheduled
        # while the child compiled): the compile's own time decides, as the wait would have
        if reply is None or float(reply["seconds"]) > timeout:
            self._kill()
            return ProbeResult(False, timeout, timed_out=True)
        return ProbeResult(bool(reply["ok"]), float(reply["seconds"]), error=reply.get("error", ""))

    def close(self) -> None:
        """Stop the child (idempotent)."""
        child, self._child = self._child, None
        if child is not None and child.poll() is None:
            assert child.stdin is not None
            child.stdin.close()
            try:
                child.wait(5.0)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def __enter__(self) -> CompileProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The running child's process id (``None`` before the first compile or after a kill)."""
        return None if self._child is None else self._child.pid

    def _ready_child(self) -> subprocess.Popen[str]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        command = [sys.executable, str(Path(__file__).resolve()), ",".join(self.backends)]
        if self.tokenizer_dir is not None:
            command.append(self.tokenizer_dir)
        child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._child, self._lines = child, queue.Queue()
        assert child.stdout is not None
        threading.Thread(target=_pump, args=(child.stdout, self._lines), daemon=True).start()
        line = self._next_line(READY_TIMEOUT_S)
        if line is None or not json.loads(line).get("ready"):
            self._kill()
            raise RuntimeError("the compile probe's child did not start")
        return child

    def _next_line(self, timeout: float) -> str | None:
        """The child's next output line, or None on timeout or when it died."""
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def _kill(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()
            self.kills += 1


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """Forward the child's stdout lines (``None`` at its end) so reads can time out."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def serve(names: list[str], tokenizer_dir: str | None, stdin: IO[str], stdout: IO[str]) -> None:
    """The child's loop: load the tokenizer, then compile each request line, reply in order."""
    from espalier.constrained.backends import get_backend
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.server.default_model import default_tokenizer

    if tokenizer_dir is None:
        tokenizer = default_tokenizer()
    else:
        tokenizer = TokenizerInfo.from_pretrained(tokenizer_dir)
    backends: dict[str, Any] = {name: get_backend(name, tokenizer) for name in names}
    print(json.dumps({"ready": True}), file=stdout, flush=True)
    for line in stdin:
        request = json.loads(line)
        name = request["backend"]
        spec = GrammarSpec(GrammarKind[request["kind"]], request["source"])
        start = time.perf_counter()
        reply: dict[str, Any] = {"ok": True}
        try:
            backends[name].compile(spec)
        except Exception as exc:  # a grammar the backend refuses: reported, the child goes on
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        reply["seconds"] = time.perf_counter() - start
        print(json.dumps(reply), file=stdout, flush=True)


if __name__ == "__main__":
    names = [name for name in sys.argv[1].split(",") if name]
    serve(names, sys.argv[2] if len(sys.argv) > 2 else None, sys.stdin, sys.stdout)
