"""EncoderConfig: validation names the bad value, JSON round trip, presets."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.config import REFERENCE, TINY, EncoderConfig


def test_presets() -> None:
    assert (REFERENCE.d_model, REFERENCE.n_heads, REFERENCE.n_layers, REFERENCE.d_ff) == (256, 4, 4, 1024)
    assert (REFERENCE.vocab_size, REFERENCE.max_length, REFERENCE.positional) == (8192, 512, "sinusoidal")
    assert (REFERENCE.norm_first, REFERENCE.activation) == (False, "relu")
    assert (TINY.d_model, TINY.n_heads, TINY.n_layers, TINY.d_ff, TINY.vocab_size, TINY.max_length) == (
        32, 4, 2, 64, 100, 64)
    assert REFERENCE.d_head == 64 and TINY.d_head == 8


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.d_model = 64  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"d_model": 30}, r"d_model=30 must be divisible by n_heads=4"),
        ({"d_model": 0}, r"d_model must be a positive int, got 0"),
        ({"n_heads": -2}, r"n_heads must be a positive int, got -2"),
        ({"n_layers": True}, r"n_layers must be a positive int, got True"),
        ({"d_ff": 64.0}, r"d_ff must be a positive int, got 64\.0"),
        ({"vocab_size": 0}, r"vocab_size must be a positive int, got 0"),
        ({"max_length": -1}, r"max_length must be a positive int, got -1"),
        ({"positional": "t5"}, r"positional must be one of .*got 't5'"),
        ({"activation": "swish"}, r"activation must be one of .*got 'swish'"),
        ({"norm_first": "yes"}, r"norm_first must be a bool, got 'yes'"),
        ({"final_norm": 1}, r"final_norm must be a bool, got 1"),
        ({"layer_norm_eps": 0.0}, r"layer_norm_eps must be a finite float > 0, got 0\.0"),
        ({"layer_norm_eps": float("nan")}, r"layer_norm_eps must be a finite float > 0, got nan"),
    ],
)
def test_bad_values_are_named(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **changes)


def test_from_dict_names_unknown_keys() -> None:
    data = {**TINY.to_dict(), "dmodel": 32, "dropout": 0.1}
    with pytest.raises(ValueError, match=r"unknown EncoderConfig keys \['dmodel', 'dropout'\]"):
        EncoderConfig.from_dict(data)


def test_from_json_errors() -> None:
    with pytest.raises(ValueError, match="malformed"):
        EncoderConfig.from_json("{not json")
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        EncoderConfig.from_json("[1, 2]")
    with pytest.raises(ValueError, match="n_heads=5"):
        EncoderConfig.from_json('{"d_model": 32, "n_heads": 5}')


def test_missing_keys_take_defaults_and_int_eps_normalises() -> None:
    cfg = EncoderConfig.from_dict({"d_model": 64, "layer_norm_eps": 1})
    assert cfg.n_heads == REFERENCE.n_heads and cfg.layer_norm_eps == 1.0
    assert isinstance(cfg.layer_norm_eps, float)


@settings(max_examples=50, deadline=None)
@given(
    n_heads=st.integers(1, 8),
    d_head=st.integers(1, 16),
    n_layers=st.integers(1, 12),
    d_ff=st.integers(1, 4096),
    vocab_size=st.integers(1, 100_000),
    max_length=st.integers(1, 8192),
    positional=st.sampled_from(["sinusoidal", "learned", "none"]),
    norm_first=st.booleans(),
    activation=st.sampled_from(["relu", "gelu"]),
    eps=st.floats(1e-12, 1.0),
    final_norm=st.booleans(),
)
def test_json_round_trip(n_heads: int, d_head: int, n_layers: int, d_ff: int, vocab_size: int, max_length: int,
                         positional: str, norm_first: bool, activation: str, eps: float, final_norm: bool) -> None:
    cfg = EncoderConfig(
        d_model=n_heads * d_head, n_heads=n_heads, n_layers=n_layers, d_ff=d_ff, vocab_size=vocab_size,
        max_length=max_length, positional=positional, norm_first=norm_first, activation=activation,
        layer_norm_eps=eps, final_norm=final_norm,
    )
    assert EncoderConfig.from_json(cfg.to_json()) == cfg
    assert EncoderConfig.from_dict(cfg.to_dict()) == cfg
