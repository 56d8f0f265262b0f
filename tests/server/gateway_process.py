"""The real SMG gateway binary in front of a worker on 127.0.0.1, for tests.

``SmgGateway(worker_port)`` starts ``smg launch`` (installed by scripts/setup.sh, the project's
``gateway`` extra) on a free port and waits until its ``/readiness`` probe says the worker and its
tokenizer are registered; ``base_url`` is then the OpenAI API root.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# Bounds against hangs only: registration fetches the worker's 262k-token tokenizer bundle.
READY_TIMEOUT_S = 300.0


def smg_binary() -> str | None:
    """The ``smg`` launcher next to this interpreter (the venv's), else on PATH."""
    local = Path(sys.executable).parent / "smg"
    return str(local) if local.exists() else shutil.which("smg")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class SmgGateway:
    """``with SmgGateway(worker_port) as gw: OpenAI(base_url=gw.base_url, api_key="-")``"""

    def __init__(self, worker_port: int) -> None:
        binary = smg_binary()
        if binary is None:
            raise FileNotFoundError("smg is not installed (scripts/setup.sh installs it)")
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        args = ["launch", "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--worker-urls", f"grpc://127.0.0.1:{worker_port}", "--backend", "vllm"]
        # SMG's Prometheus endpoint defaults to 0.0.0.0:29000: loopback, a free port.
        args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        self.proc = subprocess.Popen(
            [binary, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, NO_COLOR="1"),
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        url = f"http://127.0.0.1:{self.port}/readiness"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.close()
        raise TimeoutError(f"smg not ready after {READY_TIMEOUT_S} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> SmgGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
