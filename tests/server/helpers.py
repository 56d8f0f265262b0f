"""Small helpers shared by the server tests: metrics scraping and output checks."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from typing import Any

import jsonschema

# Constraints whose every output is short: the tiny random model always finishes them.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["name", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = "[a-z]{2,6}"
EBNF = 'root ::= "id-" [0-9] [0-9]? [0-9]?'
EBNF_AS_REGEX = "id-[0-9]{1,3}"
LARK = 'start: "id-" /[0-9]{1,3}/'
CHOICES = ["alpha", "beta", "gamma"]

CONSTRAINTS: dict[str, dict[str, Any]] = {
    "json_schema": {"schema": SCHEMA},
    "any_json": {"any_json": True},
    "regex": {"regex": REGEX},
    "ebnf": {"ebnf": EBNF},
    "lark": {"lark": LARK},
    "choice": {"choice": CHOICES},
}


def check_output(kind: str, text: str, finish_reason: str) -> None:
    """Assert ``text`` matches the constraint of ``kind`` (any_json may run out of tokens)."""
    if kind == "any_json" and finish_reason in ("length", "length_unclosed"):
        return
    assert finish_reason in ("stop", "grammar"), (kind, finish_reason, text)
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "any_json":
        json.loads(text)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind in ("ebnf", "lark"):
        assert re.fullmatch(EBNF_AS_REGEX, text), text
    else:
        assert text in CHOICES, text


def scrape(metrics_port: int) -> dict[str, float]:
    """Sample values of the espalier_* series (labels kept in the key)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        body = reply.read().decode()
    values: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("espalier_"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def wait_until_idle(metrics_port: int, polls: int = 600) -> dict[str, float]:
    """Poll until nothing runs or waits and no KV block is held; bounded, returns the scrape."""
    for _ in range(polls):
        m = scrape(metrics_port)
        if (
            m["espalier_active_requests"] == 0
            and m["espalier_engine_running"] == 0
            and m["espalier_engine_queue_depth"] == 0
            and m["espalier_engine_kv_blocks_used"] == 0
        ):
            return m
        time.sleep(0.1)
    raise AssertionError(f"the server did not go idle: {m}")
