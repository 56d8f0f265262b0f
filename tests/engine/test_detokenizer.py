"""Incremental detokenizer: UTF-8 characters never split, stop strings held back and dropped."""

from __future__ import annotations

import random

import pytest

from espalier.engine.detokenizer import IncrementalDetokenizer

# A byte-level toy vocabulary: ids 0..255 are single bytes, 256+ are multi-byte pieces.
PIECES = [bytes([b]) for b in range(256)] + [
    "é".encode(),
    "世界".encode(),
    b"\xf0\x9f",  # first half of an emoji
    b"\xa6\x99",  # second half of 🦙
    b"STOP",
    b"ST",
    b"OP",
    b"<eos>",
]
EOS = len(PIECES) - 1


def ids_of(data: bytes) -> list[int]:
    return list(data)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.push([t]).text for t in ids]
    deltas.append(detok.flush().text)
    return deltas


def test_multibyte_characters_are_never_split() -> None:
    text = "héllo 世界 🦙 ∮ 𝔘"
    detok = IncrementalDetokenizer(PIECES)
    deltas = stream(detok, ids_of(text.encode()))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.text == text


def test_split_pieces_join() -> None:
    detok = IncrementalDetokenizer(PIECES)
    assert detok.push([256 + 2]).text == ""  # b"\xf0\x9f" held back
    assert detok.push([256 + 3]).text == "🦙"


def test_invalid_bytes_become_replacement_at_once_and_incomplete_at_flush() -> None:
    detok = IncrementalDetokenizer(PIECES)
    assert detok.push([0x80]).text == "\ufffd"  # a lone continuation byte can never complete
    assert detok.push([0xE4]).text == ""
    assert detok.flush().text == "\ufffd"


def test_skip_ids_give_no_text() -> None:
    detok = IncrementalDetokenizer(PIECES, skip_ids={EOS})
    assert detok.push([ord("a"), EOS]).text == "a"


def test_stop_string_is_held_back_then_dropped() -> None:
    detok = IncrementalDetokenizer(PIECES, stop=["STOP"])
    assert detok.push(ids_of(b"abc S")).text == "abc "
    assert detok.push(ids_of(b"T")).text == ""
    d = detok.push(ids_of(b"OP tail"))
    assert d.text == "" and d.stop == "STOP"
    assert detok.text == "abc "
    assert detok.push(ids_of(b"more")).text == ""  # nothing after a stop


def test_held_back_prefix_released_when_not_a_stop() -> None:
    detok = IncrementalDetokenizer(PIECES, stop=["STOP", "\n\n"])
    assert detok.push(ids_of(b"xST")).text == "x"
    assert detok.push(ids_of(b"AR")).text == "STAR"
    assert detok.push(ids_of(b"\n")).text == ""
    assert detok.flush().text == "\n"  # the end releases what was held
    assert detok.text == "xSTAR\n"


def test_stop_inside_one_token_and_across_tokens() -> None:
    detok = IncrementalDetokenizer(PIECES, stop=["STOP"])
    d = detok.push([ord("a"), 256 + 4, ord("b")])
    assert (d.text, d.stop) == ("a", "STOP")
    detok = IncrementalDetokenizer(PIECES, stop=["STOP"])
    assert detok.push([256 + 5]).text == ""
    d = detok.push([256 + 6])
    assert (d.text, d.stop) == ("", "STOP")


def test_first_completed_stop_wins_whatever_the_chunking() -> None:
    for chunks in ([b"xabcd"], [b"x", b"a", b"b", b"c", b"d"], [b"xab", b"cd"]):
        detok = IncrementalDetokenizer(PIECES, stop=["abcd", "bc"])
        results = [detok.push(ids_of(c)) for c in chunks]
        assert "".join(r.text for r in results) == "xa"
        assert [r.stop for r in results if r.stop] == ["bc"]


def test_random_streams_match_oracle() -> None:
    """Concatenated deltas equal the full decode truncated at the first stop string."""
    rng = random.Random(1)
    alphabet = ["a", "b", "é", "世", "🦙", "\n", "S", "T", "O", "P"]
    stops = ["STOP", "\n\n", "é世", "TO", "aST"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        ids = ids_of(text.encode())
        detok = IncrementalDetokenizer(PIECES, stop=stops)
        out = "".join(stream(detok, ids))
        ends = [(i + len(s), i) for i, s in ((text.find(s), s) for s in stops) if i != -1]
        cut = min(ends)[1] if ends else len(text)
        assert out == text[:cut]
        assert "\ufffd" not in out


@pytest.mark.model
def test_gemma_tokenizer_utf8_split_across_tokens() -> None:
    from espalier.server.default_model import default_tokenizer

    tok = default_tokenizer()
    text = "héllo 世界 🦙 ∮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ᚠᛇᚻ"
    ids = tok.encode(text)
    pieces = tok.token_bytes
    split = [t for t in ids if not _is_utf8(pieces[t])]
    assert split, "the sample must exercise byte-fallback tokens"
    detok = IncrementalDetokenizer(pieces, skip_ids=tok.special_token_ids)
    deltas = stream(detok, ids + [tok.stop_token_ids[0]])
    assert "".join(deltas) == text == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
