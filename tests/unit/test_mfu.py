"""Model FLOPs utilisation: FLOPs per token of a transformer, MFU, and their config keys."""
from __future__ import annotations

import pytest
import yaml

from mfotel.config import ConfigError, parse_config
from mfotel.flops import TransformerShape, llama_ffn_hidden_size, mfu


# ---------------------------------------------------------------- FLOPs per token and MFU
def test_llama_ffn_width_follows_the_llama_rounding():
    assert llama_ffn_hidden_size(4096, 256) == 11008          # Llama(-2) 7B
    assert llama_ffn_hidden_size(8192, 4096, 1.3) == 28672    # Llama-2 70B
    assert llama_ffn_hidden_size(64, 32) == 192               # the CPU example


def test_flops_per_token_is_six_n_plus_attention():
    # h=64, L=2, 4 heads (MHA), f=192 gated, V=256, s=64 (the tiny-Llama CPU example):
    # N = 2 x (2*64^2 + 2*64*64 + 3*64*192) + 256*64 = 122880; 12 L h s = 98304
    shape = TransformerShape(64, 2, 4, 4, 192, 256, 64)
    assert shape.matmul_params == 122_880
    assert shape.flops_per_token == 6 * 122_880 + 98_304


def test_grouped_query_attention_shrinks_the_key_value_projections():
    mha = TransformerShape(8192, 80, 64, 64, 28672, 32000, 4096)
    gqa = TransformerShape(8192, 80, 64, 8, 28672, 32000, 4096)   # Llama-2 70B
    assert mha.matmul_params - gqa.matmul_params == 80 * 2 * 8192 * (8192 - 1024)
    assert gqa.matmul_params == pytest.approx(68.7e9, rel=0.01)   # its published ~69B


def test_ungated_mlp_has_two_matrices():
    gated, plain = (TransformerShape(64, 1, 4, 4, 256, 10, 8, gated_mlp=g) for g in (True, False))
    assert gated.matmul_params - plain.matmul_params == 64 * 256


def test_mfu_is_achieved_over_peak():
    assert mfu(tokens_per_second=1000.0, flops_per_token=1e9, peak_flops=4e12) == 0.25


# ---------------------------------------------------------------- config keys
@pytest.mark.parametrize("raw", [3.13e14, 1000])
def test_flops_keys_take_positive_numbers(raw):
    cfg = parse_config({"peak_flops": raw, "flops_per_token": raw})
    assert cfg.peak_flops == raw and cfg.flops_per_token == raw


@pytest.mark.parametrize("raw", [0, -1.0, "fast", True, float("nan"), float("inf"), [1]])
def test_bad_flops_values_name_the_key_and_the_fix(raw):
    with pytest.raises(ConfigError) as error:
        parse_config({"peak_flops": raw})
    assert "monitor_config.peak_flops" in str(error.value)
    assert "positive number" in str(error.value) and "e.g. peak_flops: 3" in str(error.value)


def test_an_exponent_yaml_reads_as_text_gets_a_hint():
    # PyYAML reads `3.13e14` (no dot, no exponent sign) as a string
    with pytest.raises(ConfigError) as error:
        parse_config(yaml.safe_load("peak_flops: 3.13e14"))
    assert "as text: write peak_flops: 313000000000000.0 unquoted" in str(error.value)
    assert parse_config(yaml.safe_load("peak_flops: 3.13e+14")).peak_flops == 3.13e14
