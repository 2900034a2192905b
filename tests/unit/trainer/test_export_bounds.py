"""trainer.export.load_final_model bounds a card's sizes before anything is built (issue 28.1):
an allowed factory with huge kwargs is refused fast, naming the field, instead of allocating."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import save_file

from trainer.allowlist import ModelNotAllowed
from trainer.export import load_final_model
from trainer.models import mlp


def _final(tmp_path, kwargs):
    final = tmp_path / "final"
    final.mkdir()
    save_file({k: v.contiguous() for k, v in mlp(hidden=8).state_dict().items()}, str(final / "model.safetensors"))
    card = {"format": "gangflow-model-card/1", "model": {"factory": "mlp", "kwargs": kwargs}}
    (final / "model_card.json").write_text(json.dumps(card))
    return final


def test_a_card_sized_beyond_its_weights_is_refused_before_building(tmp_path):
    final = _final(tmp_path, {"hidden": 4096, "depth": 100000})
    started = time.monotonic()
    with pytest.raises(ModelNotAllowed, match=r"model\.kwargs\.(hidden|depth)=\d+ is larger than the \d+ values"):
        load_final_model(final)
    assert time.monotonic() - started < 2.0


def test_kwargs_within_the_bound_that_still_build_too_much_are_refused_on_the_meta_device(tmp_path):
    final = _final(tmp_path, {"hidden": 600, "depth": 3})  # each below the weights' values, the model far above
    with pytest.raises(ModelNotAllowed, match=r"would hold \d+ values, its weights \d+; nothing was built"):
        load_final_model(final)


def test_a_card_matching_its_weights_loads(tmp_path):
    model = load_final_model(_final(tmp_path, {"hidden": 8}))
    assert isinstance(model, torch.nn.Module) and not model.training


def _lying_weights(final, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    (final / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize(
    ("header", "data"),
    [
        ({"w": {"dtype": "F32", "shape": [50000, 40000], "data_offsets": [0, 8000000000]}}, b""),  # the bytes are not there
        ({"w": {"dtype": "F32", "shape": [50000, 40000], "data_offsets": [0, 16]}}, b"\0" * 16),  # shape beyond its bytes
        ({"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16),  # no such dtype
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, b"\0" * 16),
    ],
)
def test_a_weights_header_that_claims_more_than_the_file_holds_is_refused_before_building(tmp_path, header, data):
    """The bound is the bytes the file really holds: an 87-byte file claiming 2e9 values used to let
    `mlp(hidden=20000)` build (14 GB) before safetensors noticed the file was short."""
    final = _final(tmp_path, {"hidden": 2000, "depth": 2})  # 16 MB if it were built
    _lying_weights(final, header, data)
    with pytest.raises(ModelNotAllowed, match="safetensors"):
        load_final_model(final)
