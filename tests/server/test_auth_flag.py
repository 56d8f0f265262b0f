"""``--auth-token`` and ``ESPALIER_AUTH_TOKEN`` given empty are refused, never read as "no token"
(a deployment whose secret is missing must not start without authentication)."""

from __future__ import annotations

import pytest

from espalier.server.cli_serve import AUTH_TOKEN_ENV, config_from_args
from espalier.server.main import build_parser


def problems(monkeypatch: pytest.MonkeyPatch, env: str | None, *argv: str) -> list[str]:
    if env is None:
        monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(AUTH_TOKEN_ENV, env)
    args = build_parser().parse_args(["serve", *argv])
    return config_from_args(args).validate()


def test_an_empty_token_flag_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "the auth token must not be empty" in problems(monkeypatch, None, "--auth-token", "")


def test_an_empty_token_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "the auth token must not be empty" in problems(monkeypatch, "")


def test_a_token_secures_the_smg_port_check(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ("--smg-port", "50052", "--smg-host", "0.0.0.0")
    assert problems(monkeypatch, None, *argv) == []
    refused = problems(monkeypatch, "secret", *argv)
    assert any("bind --smg-host to loopback" in p for p in refused)
    assert problems(monkeypatch, None, "--auth-token", "secret") == []
