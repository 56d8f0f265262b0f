"""The Python SDK's partial JSON streaming: values grow with the output, the last is validated."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from espalier_client.errors import OutputValidationError
from espalier_client.partial import partial_values
from espalier_client.types import Chunk
from pydantic import BaseModel


class City(BaseModel):
    name: str
    population: int
    tags: list[str]


VALUE = {"name": 'Zürich "lake"', "population": 421878, "tags": ["lake", "alps"]}


def chunks_of(text: str, seed: int, finish: str = "stop") -> list[Chunk]:
    """``text`` cut at random places into streamed chunks."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [
        Chunk(piece, (), i == len(pieces) - 1, finish if i == len(pieces) - 1 else "", None)
        for i, piece in enumerate(pieces)
    ]


@pytest.mark.parametrize("seed", range(5))
def test_partial_values_grow_to_the_validated_whole(seed: int) -> None:
    text = json.dumps(VALUE)
    values = list(partial_values(chunks_of(text, seed), City.model_json_schema(), City))
    assert isinstance(values[-1], City) and values[-1].model_dump() == VALUE
    partials = values[:-1]
    assert partials and all(isinstance(v, City) for v in partials)
    dumped = [json.dumps(v.__dict__) for v in partials]
    assert len(set(dumped)) == len(dumped)  # yielded only when the value changed
    for value in partials:  # every partial is a prefix-state of the final value
        for key, got in value.__dict__.items():
            want: Any = VALUE[key]
            if isinstance(got, str):
                assert want.startswith(got)
            elif isinstance(got, list):
                assert all(w.startswith(g) for g, w in zip(got, want))


def test_plain_schema_values_and_a_cut_off_output() -> None:
    text = json.dumps([1, {"a": "bc"}, [True]])
    values = list(partial_values(chunks_of(text, 1), {"type": "array"}))
    assert values[-1] == [1, {"a": "bc"}, [True]]
    cut = list(partial_values(chunks_of(text[:-4], 2, finish="length"), {"type": "array"}))
    assert cut and cut[-1] != values[-1]  # no final value: the output did not complete
    bad = json.dumps({"name": "x"})
    with pytest.raises(OutputValidationError):
        list(partial_values(chunks_of(bad, 3), City.model_json_schema(), City))
