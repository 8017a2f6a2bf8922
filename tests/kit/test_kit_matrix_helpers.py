# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pure helpers of the regression matrix (seed 15.1): boundary lengths and a
prompt padder that hits an exact templated token count."""

import pytest

from dcu_kit import matrix


def test_geometry_from_dsv4_like_config():
    g = matrix.geometry_from_config(
        {"sliding_window": 128, "compress_ratios": [0, 0, 4, 128, 4, 128, 0]})
    assert g == matrix.Geometry(64, 128, (4, 128))
    assert matrix.geometry_from_config({}).compress_ratios == (4, 128)


def test_boundary_lengths_straddle_each_edge_and_fit():
    lens = matrix.boundary_lengths(matrix.Geometry(), max_model_len=512,
                                   gen_tokens=32)
    assert {63, 64, 65, 127, 128, 129, 255, 256, 257} <= set(lens["kv_block"])
    assert {127, 128, 129} <= set(lens["swa_window"])
    assert {127, 128, 129, 255, 256, 257, 383, 384, 385} == set(lens["compress_c128"])
    assert {31, 32, 33} <= set(lens["compress_c4"])
    assert max(max(v) for v in lens.values()) <= 512 - 32
    with pytest.raises(ValueError, match="no room"):
        matrix.boundary_lengths(matrix.Geometry(), 40, 38)


def _count_fn():
    """Toy templated tokenizer: 7 template tokens + whitespace words, and
    CJK characters count one each."""
    def count(text):
        n = 7
        for word in text.split():
            n += sum(1 for ch in word if ord(ch) > 0x2E80) or 1
        return n
    return count


@pytest.mark.parametrize("target", [20, 63, 64, 65, 129])
def test_pad_prompt_hits_exact_length(target):
    count = _count_fn()
    text, n = matrix.pad_prompt_to_length(count, target)
    assert n == target and count(text) == target


def test_pad_prompt_reports_unreachable_target():
    with pytest.raises(ValueError, match="already has"):
        matrix.pad_prompt_to_length(lambda t: 100, 50)
    with pytest.raises(ValueError, match="exactly 51"):
        # every filler adds 2 tokens: odd targets are unreachable
        matrix.pad_prompt_to_length(lambda t: 10 + 2 * (len(t) - 3), 51,
                                    base="abc", fillers=("x",))


def test_eight_distinct_prompts():
    assert len(set(matrix.PROMPTS_8)) == 8
