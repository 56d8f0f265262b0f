"""A real ``espalier serve`` process on 127.0.0.1 with free ports, driven through its stdout events.

The server announces phases as JSON lines (``listening`` with the ports, ``tokenizer_loaded``,
``serving`` or ``load_failed``, ``draining``, ``stopped``); tests wait on those, never on time.
It runs under ``audit_hook.py``: Python-level file opens of bait paths and socket connects come
back as ``audit`` events (:meth:`ServerProcess.audit_events`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TEST_MODEL = "tiny-random"
# Bounds against hangs only (the tokenizer alone takes ~20 s on a loaded 2-core machine).
START_TIMEOUT_S = 600.0


class ServerProcess:
    """``with ServerProcess("--auth-token", "t") as srv: srv.address``"""

    def __init__(self, *args: str, model: str = TEST_MODEL) -> None:
        self.args = ["--model", model, "--port", "0", "--metrics-port", "0", *args]
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._stderr = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("audit_hook.py")), "serve", *self.args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            cwd=str(REPO),
            env=env,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        listening = self.wait_event("listening")
        self.port: int = listening["port"]
        self.metrics_port: int | None = listening["metrics_port"]
        self.smg_port: int | None = listening.get("smg_port")
        self.address = f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()
        with self._cond:
            self.events.append({"event": "exited"})
            self._cond.notify_all()

    def wait_event(self, *names: str, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        """The first event named one of ``names`` (or ``exited``); fails after ``timeout``."""
        wanted = {*names, "exited"}
        with self._cond:
            found = self._cond.wait_for(
                lambda: any(e["event"] in wanted for e in self.events), timeout=timeout
            )
            if not found:
                raise TimeoutError(f"no {names} event; stderr:\n{self.stderr()[-3000:]}")
            event = next(e for e in self.events if e["event"] in wanted)
        if event["event"] == "exited" and "exited" not in names:
            raise RuntimeError(f"server exited early; stderr:\n{self.stderr()[-3000:]}")
        return event

    def wait_loaded(self) -> bool:
        """Wait for the model; True when SERVING, False when the engine could not load."""
        return self.wait_event("serving", "load_failed")["event"] == "serving"

    def has_event(self, name: str) -> bool:
        with self._cond:
            return any(e["event"] == name for e in self.events)

    def audit_events(self) -> list[dict[str, Any]]:
        """Forbidden I/O the server made so far (see ``audit_hook.py``)."""
        with self._cond:
            return [e for e in self.events if e["event"] == "audit"]

    def stderr(self) -> str:
        self._stderr.flush()
        return Path(self._stderr.name).read_text(errors="replace")

    def terminate(self, timeout: float = 120.0) -> int:
        """SIGTERM (graceful drain) and wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def close(self) -> None:
        """Stop the server; a server that does not exit 0 after its drain fails the test."""
        code = self.terminate()
        log = self.discard()
        assert code == 0, f"the server exited with status {code} after SIGTERM:\n{log}"

    def discard(self) -> str:
        """Stop the server (if it still runs) whatever its exit status; returns its stderr tail."""
        self.terminate()
        log = self.stderr()[-4000:]
        self._stderr.close()
        os.unlink(self._stderr.name)
        return log

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
