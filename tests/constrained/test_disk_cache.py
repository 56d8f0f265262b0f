"""The on-disk compile cache: an xgrammar grammar compiled before a restart is loaded, not
compiled, and masks exactly like a fresh compile; bad files (truncated, garbage, foreign,
tampered, another tokenizer's) are misses that never crash; the directory stays bounded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.disk_cache import DiskCacheConfig, GrammarDiskCache
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import ConstraintOptions
from espalier.engine.constraints import GrammarService

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0},
    },
    "required": ["ok", "color"],
    "additionalProperties": False,
}
XGR = ConstraintOptions(backend="xgrammar", allow_weakening=True)


def service(
    tokenizer: Any, directory: Path, max_bytes: int = 64 << 20, preload_bytes: int = 64 << 20
) -> GrammarService:
    """A fresh grammar service (empty in-memory cache): what a restarted server has."""
    config = DiskCacheConfig(str(directory), max_bytes, preload_bytes)
    disk = GrammarDiskCache(config, tokenizer)
    return GrammarService(tokenizer, compile_timeout_s=60.0, disk_cache=disk)


def compile_once(grammar: GrammarService, spec: GrammarSpec, options: Any = XGR) -> Any:
    try:
        return grammar.submit(spec, options).result(timeout=120)
    finally:
        grammar.close()


def mask_walk(compiled: Any, tokens: list[int], vocab_size: int) -> list[torch.Tensor]:
    """The bitmask before each token of ``tokens`` (each must be accepted) and after the last."""
    matcher = compiled.matcher()
    rows = bm.allocate(1, vocab_size)
    masks = []
    for token in [*tokens, None]:
        matcher.fill_bitmask(rows, 0)
        masks.append(rows[0].clone())
        if token is not None:
            assert matcher.accept(token)
    return masks


def test_restart_loads_instead_of_compiling_and_masks_the_same(
    toy_tokenizer: Any, tmp_path: Path
) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    first = service(toy_tokenizer, tmp_path)
    compiled, report = compile_once(first, spec)
    assert report.backend == "xgrammar" and not report.cache_hit
    assert first.disk_cache is not None and first.disk_cache.stats.stores == 1
    assert len(list(tmp_path.glob("*.xgrammar"))) == 1

    second = service(toy_tokenizer, tmp_path)
    loaded, again = compile_once(second, spec)
    assert second.disk_cache is not None and second.disk_cache.stats.hits == 1
    assert again.cache_hit and again.backend == "xgrammar"
    assert again.cache_key == report.cache_key and again.weakened == report.weakened
    text = '{"ok": true, "color": "green", "n": 42}'
    tokens = toy_tokenizer.hf.encode(text, add_special_tokens=False)
    fresh = mask_walk(compiled, tokens, toy_tokenizer.vocab_size)
    restored = mask_walk(loaded, tokens, toy_tokenizer.vocab_size)
    assert all(torch.equal(a, b) for a, b in zip(fresh, restored))


@pytest.mark.parametrize("preload", [True, False])
def test_first_request_after_a_restart_neither_compiles_nor_builds_a_compiler(
    toy_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preload: bool
) -> None:
    """With the preload (default), the grammar is deserialized before the request comes (the
    request finds it ready); without, the request reads its file. Either way: no compile."""
    from espalier.constrained import compile as compile_module
    from espalier.constrained.backends import clear_backend_cache
    from espalier.constrained.backends import xgrammar as xgrammar_backend

    spec = GrammarSpec.json_schema(SCHEMA)
    compile_once(service(toy_tokenizer, tmp_path), spec)
    clear_backend_cache()  # a restart: no xgrammar Backend (compiler, child processes) built yet
    calls: list[str] = []

    def refuse(name: str) -> Any:
        def called(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called although the grammar is on disk")

        return called

    monkeypatch.setattr(compile_module, "compile_grammar", refuse("compile_grammar"))
    monkeypatch.setattr(xgrammar_backend, "Backend", refuse("xgrammar Backend"))
    restarted = service(toy_tokenizer, tmp_path, preload_bytes=(64 << 20) if preload else 0)
    disk = restarted.disk_cache
    assert disk is not None
    disk.flush()  # the server was up (vocabulary view built, files preloaded) before the request
    assert disk.stats.preloaded == (1 if preload else 0)
    try:  # the engine's path: compile, then the request's own matcher
        _compiled, report, matcher = restarted.submit_request(spec, XGR).result(timeout=120)
    finally:
        restarted.close()
    assert calls == []
    assert report.cache_hit and report.backend == "xgrammar"
    assert disk.stats.hits == 1 and disk.stats.preloaded_hits == (1 if preload else 0)
    tokens = toy_tokenizer.hf.encode('{"ok":true,"color":"blue"}', add_special_tokens=False)
    assert all(matcher.accept(token) for token in tokens) and matcher.can_terminate()


def test_llguidance_results_are_not_stored(toy_tokenizer: Any, tmp_path: Path) -> None:
    grammar = service(toy_tokenizer, tmp_path)
    _, report = compile_once(grammar, GrammarSpec.regex("[a-c]{2,5}"), ConstraintOptions())
    assert report.backend != "xgrammar"
    assert list(tmp_path.glob("*.xgrammar")) == []


def _corrupt(kind: str, path: Path) -> None:
    """Damage the file: a JSON header line, then xgrammar's text."""
    head, _, body = path.read_bytes().partition(b"\n")
    doc = json.loads(head)
    if kind == "truncated":
        path.write_bytes(head + b"\n" + body[: len(body) // 2])
    elif kind == "truncated_header":
        path.write_bytes(head[:20])
    elif kind == "garbage":
        path.write_bytes(b"\x00\xff not json at all \xfe" * 100)
    elif kind == "not_an_object":
        path.write_bytes(b"[1, 2, 3]\n" + body)
    elif kind == "foreign":  # the right shape, for another grammar
        doc["identity"] = doc["identity"].replace("json_schema", "regex")
        path.write_bytes(json.dumps(doc).encode() + b"\n" + body)
    elif kind == "tampered":  # the right identity, a changed xgrammar payload
        path.write_bytes(head + b"\n" + body.replace(b"1", b"2", 3))
    elif kind == "broken_payload":  # checksum agrees, xgrammar refuses the text
        cut = body[:200] + b'"}'
        doc["digest"] = hashlib.sha256(cut).hexdigest()
        path.write_bytes(json.dumps(doc).encode() + b"\n" + cut)
    elif kind == "wrong_types":
        doc["report"]["weakened"] = [{"bogus": 1}]
        path.write_bytes(json.dumps(doc).encode() + b"\n" + body)
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "truncated",
        "truncated_header",
        "garbage",
        "not_an_object",
        "foreign",
        "tampered",
        "broken_payload",
        "wrong_types",
    ],
)
def test_a_bad_file_is_a_miss(toy_tokenizer: Any, tmp_path: Path, kind: str) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    compile_once(service(toy_tokenizer, tmp_path), spec)
    (path,) = tmp_path.glob("*.xgrammar")
    _corrupt(kind, path)
    grammar = service(toy_tokenizer, tmp_path)
    compiled, report = compile_once(grammar, spec)
    assert not report.cache_hit and report.backend == "xgrammar"
    assert grammar.disk_cache is not None
    assert grammar.disk_cache.stats.bad_files == 1 and grammar.disk_cache.stats.stores == 1
    tokens = toy_tokenizer.hf.encode('{"ok":false,"color":"red"}', add_special_tokens=False)
    mask_walk(compiled, tokens, toy_tokenizer.vocab_size)  # the recompiled grammar works
    third = service(toy_tokenizer, tmp_path)  # and the file was rewritten good
    assert compile_once(third, spec)[1].cache_hit


def test_another_tokenizer_never_loads_the_file(
    toy_tokenizer: Any, toy_tokenizer_padded: Any, tmp_path: Path
) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    compile_once(service(toy_tokenizer, tmp_path), spec)
    (path,) = tmp_path.glob("*.xgrammar")
    other = service(toy_tokenizer_padded, tmp_path)
    # renamed to the other tokenizer's file name: the identity inside still says the first one
    assert other.disk_cache is not None
    key_path = other.disk_cache.path(_key(other, spec))
    path.rename(key_path)
    _, report = compile_once(other, spec)
    assert not report.cache_hit and other.disk_cache.stats.bad_files == 1


def _key(grammar: GrammarService, spec: GrammarSpec) -> Any:
    from espalier.constrained.cache import CacheKey

    return CacheKey(spec.cache_key, "xgrammar", grammar.tokenizer.fingerprint, (True,))


def test_directory_is_bounded_least_recently_used_first(toy_tokenizer: Any, tmp_path: Path) -> None:
    specs = [GrammarSpec.regex(f"item-{i}-[a-z]{{1,{i + 2}}}") for i in range(4)]
    probe = service(toy_tokenizer, tmp_path / "probe")
    compile_once(probe, specs[0])
    size = max(p.stat().st_size for p in (tmp_path / "probe").glob("*.xgrammar"))
    bound = int(size * 2.5)  # room for two files
    for spec in specs:
        compile_once(service(toy_tokenizer, tmp_path / "c", bound), spec)
    files = list((tmp_path / "c").glob("*.xgrammar"))
    assert 1 <= len(files) <= 2
    assert sum(p.stat().st_size for p in files) <= bound
    newest = service(toy_tokenizer, tmp_path / "c", bound)
    assert compile_once(newest, specs[-1])[1].cache_hit
    oldest = service(toy_tokenizer, tmp_path / "c", bound)
    assert not compile_once(oldest, specs[0])[1].cache_hit


def test_preload_takes_only_its_scope_within_its_budget(
    toy_tokenizer: Any, toy_tokenizer_padded: Any, tmp_path: Path
) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    compile_once(service(toy_tokenizer_padded, tmp_path), spec)  # another tokenizer's file
    (theirs,) = tmp_path.glob("*.xgrammar")
    ours = service(toy_tokenizer, tmp_path).disk_cache
    assert ours is not None
    ours.flush()
    assert ours.stats.preloaded == 0 and ours.stats.bad_files == 0 and theirs.exists()
    compile_once(service(toy_tokenizer, tmp_path), spec)  # now one file of each
    (mine,) = set(tmp_path.glob("*.xgrammar")) - {theirs}
    small = service(toy_tokenizer, tmp_path, preload_bytes=mine.stat().st_size - 1).disk_cache
    assert small is not None
    small.flush()
    assert small.stats.preloaded == 0  # over the budget
    again = service(toy_tokenizer, tmp_path).disk_cache
    assert again is not None
    again.flush()
    assert again.stats.preloaded == 1 and theirs.exists()
