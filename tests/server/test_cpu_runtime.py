"""``espalier serve`` sets passive OpenMP waiting before torch loads, unless the user chose how
OpenMP threads wait (``server/cpu_runtime.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from espalier.server.cpu_runtime import apply_runtime_env, runtime_env


def test_passive_waiting_by_default() -> None:
    environ = {"PATH": "/usr/bin"}
    assert apply_runtime_env(environ) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert environ == {"PATH": "/usr/bin", "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize(
    "given", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": ""}, {"GOMP_SPINCOUNT": "10000"}]
)
def test_a_users_choice_is_kept(given: dict[str, str]) -> None:
    environ = dict(given)
    assert runtime_env(environ) == {}
    assert apply_runtime_env(environ) == {}
    assert environ == given


def test_serve_sets_it_before_torch_is_imported() -> None:
    """The setting only works if nothing on the way to ``cli_serve.run`` imported torch (libgomp
    reads the environment when it is loaded): parse ``serve``'s flags, apply, then import."""
    code = (
        "import os, sys\n"
        "os.environ.pop('OMP_WAIT_POLICY', None); os.environ.pop('GOMP_SPINCOUNT', None)\n"
        "from espalier.server.main import build_parser\n"
        "build_parser().parse_args(['serve', '--model', 'tiny-random'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported before serve could set OpenMP up'\n"
        "from espalier.server.cpu_runtime import apply_runtime_env\n"
        "apply_runtime_env(os.environ)\n"
        "import torch\n"
        "print(os.environ['OMP_WAIT_POLICY'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "PASSIVE"
