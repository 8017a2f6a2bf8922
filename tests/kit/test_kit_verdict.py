# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verdict on the token ids the field report recorded (seed 000, 1, 6.5-6.13).

DeepSeek V4 tokenizer conventions used here: BOS ``<｜begin▁of▁sentence｜>``
is id 0 (seed 6.5: TOKEN_DECODE shows id 0 as BOS); EOS
``<｜end▁of▁sentence｜>`` is taken as id 1 (DeepSeek convention; the seed
never prints it). The verdict only needs "which ids are special".
"""

import math

import pytest

from dcu_kit.verdict import (
    COHERENT,
    DEGENERATE,
    judge,
    judge_text_only,
    special_ids_from_tokenizer,
)

BOS, EOS = 0, 1
SPECIAL = {BOS, EOS}
MAX_TOKENS = 32
BOS_TEXT = "<｜begin▁of▁sentence｜>"

# Seed section 1, job J17 (the coherent run). Position 21 is printed as the
# word "phase" in the report - a transcription glitch (TOKEN_DECODE says that
# token is '：'). 1158 is a stand-in: plausible, non-special, distinct from
# the other 31 ids. The verdict must not depend on which id it is.
J17_PHASE_STANDIN = 1158
J17 = [223, 30594, 9790, 303, 70037, 12203, 10706, 804, 1175,
       10539, 637, 53897, 96240, 2996, 84998, 666, 3118, 637,
       58368, 621, 666, J17_PHASE_STANDIN, 53091, 4374, 1465, 223, 1959,
       17585, 42108, 303, 56463, 10162]
J17_TEXT = (" 你好呀，很高兴在这里遇到你！让我来做个自我介绍吧～\n\n"
            "**初来乍到**：DeepSeek 这个版本的我，确实是有点")
J08 = [32] + [BOS] * 31       # seed 6.5: '>' then BOS
J09 = [BOS] * 32              # seed 6.6: all BOS
J11 = [30594] + [BOS] * 31    # seed 6.7: '你好' then BOS
J13 = [57297] + [BOS] * 31    # seed 6.9: ' Modified' then BOS

# Text as the detokenizer (skip_special_tokens=True) returned it: BOS vanishes.
PIECES = {32: ">", 30594: "你好", 57297: " Modified", BOS: BOS_TEXT}


def _text_without_specials(ids):
    return "".join(PIECES[t] for t in ids if t not in SPECIAL)


def old_j08_rule_coherent(text: str) -> bool:
    """The judge the seed used until J08 (section 6.5): non-empty text, and
    degenerate only when the text is long enough AND has few distinct
    characters. Kept here to prove it false-greens."""
    if not text.strip():
        return False
    return not (len(text) >= 16 and len(set(text)) <= 3)


def test_j17_recorded_coherent_output_passes_all_rules():
    v = judge(J17, special_ids=SPECIAL, requested_max_tokens=MAX_TOKENS,
              finish_reason="length", text=J17_TEXT,
              logprobs=[-0.1 * (i + 1) for i in range(32)])
    assert v.coherent, v.report()
    assert v.label == COHERENT
    assert v.num_tokens == 32
    assert not v.failed_rules


@pytest.mark.parametrize("ids,job", [(J08, "J08"), (J11, "J11"), (J13, "J13")])
def test_prefill_token_then_bos_fails_on_special_after_first(ids, job):
    """Regression for the seed's J08/J11/J13 signature: first token from
    prefill is fine, every decode token is BOS (fp8_ds_mla reader bug)."""
    v = judge(ids, special_ids=SPECIAL, requested_max_tokens=MAX_TOKENS,
              finish_reason="length", text=_text_without_specials(ids))
    assert not v.coherent, job
    assert v.label == DEGENERATE
    r = v.rule("no_special_tokens")
    assert r.failed and "position 1" in r.explanation and "31/32" in r.explanation
    assert v.rule("identical_run").failed  # 31 BOS in a row > 8
    assert v.summary().startswith(DEGENERATE)


def test_all_bos_j09_fails_including_first_position():
    v = judge(J09, special_ids=SPECIAL, requested_max_tokens=MAX_TOKENS,
              text="")
    assert not v.coherent
    assert "first generated token" in v.rule("no_special_tokens").explanation
    assert v.rule("text").failed
    assert v.rule("distinct_tokens").failed


def test_old_j08_rule_set_false_greens_where_the_verdict_does_not():
    """Seed 6.5: the old judge printed COHERENT for J08 because the text was
    just '>' (BOS dropped from text). Same input, new verdict: DEGENERATE."""
    text = _text_without_specials(J08)
    assert text == ">"
    assert old_j08_rule_coherent(text) is True  # the false green
    assert not judge(J08, special_ids=SPECIAL, requested_max_tokens=32,
                     text=text).coherent
    # And the old rule does catch the case it was written for, so the test
    # compares two working judges, not a strawman.
    assert old_j08_rule_coherent("aaaaaaaaaaaaaaaaaaaa") is False


def test_short_output_fails_enough_tokens_with_ignore_eos():
    v = judge(J17[:10], special_ids=SPECIAL, requested_max_tokens=32)
    assert [r.name for r in v.failed_rules] == ["enough_tokens"]


def test_empty_output_fails_non_empty():
    v = judge([], special_ids=SPECIAL, requested_max_tokens=32)
    assert v.rule("non_empty").failed and not v.coherent


def test_identical_run_threshold_is_a_parameter():
    ids = J17[:20] + [4374] * 6 + J17[20:26]
    assert judge(ids, special_ids=SPECIAL, max_identical_run=8).coherent
    v = judge(ids, special_ids=SPECIAL, max_identical_run=5)
    assert [r.name for r in v.failed_rules] == ["identical_run"]
    assert "repeated 6x from position 20" in v.rule("identical_run").explanation


def test_few_distinct_tokens_fail_even_without_long_runs():
    loop = [101, 102, 103] * 11  # period-3 loop, never > 1 identical in a row
    v = judge(loop, special_ids=SPECIAL, requested_max_tokens=32)
    assert [r.name for r in v.failed_rules] == ["distinct_tokens"]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logprob_fails(bad):
    lps = [-0.5] * 32
    lps[7] = bad
    v = judge(J17, special_ids=SPECIAL, logprobs=lps)
    assert [r.name for r in v.failed_rules] == ["finite_logprobs"]
    assert "position 7" in v.rule("finite_logprobs").explanation


def test_vllm_shaped_logprob_dicts_are_read():
    class Logprob:
        def __init__(self, x):
            self.logprob = x

    lps = [{t: Logprob(-0.25), 5: Logprob(-3.0)} for t in J17]
    assert judge(J17, special_ids=SPECIAL, logprobs=lps).coherent
    lps[3] = {J17[3]: Logprob(math.nan)}
    assert judge(J17, special_ids=SPECIAL, logprobs=lps).rule(
        "finite_logprobs").failed


def test_eos_allowed_only_as_final_token_when_listed():
    ids = J17[:31] + [EOS]
    assert judge(ids, special_ids=SPECIAL, allowed_final_ids={EOS}).coherent
    assert not judge(ids, special_ids=SPECIAL).coherent
    mid = J17[:10] + [EOS] + J17[11:]
    assert not judge(mid, special_ids=SPECIAL, allowed_final_ids={EOS}).coherent


def test_finish_reason_and_vocab_rules():
    v = judge(J17, special_ids=SPECIAL, finish_reason="stop")
    assert [r.name for r in v.failed_rules] == ["finish_reason"]
    v = judge(J17, special_ids=SPECIAL, vocab_size=90000)
    assert [r.name for r in v.failed_rules] == ["valid_ids"]  # 96240 >= 90000


def test_special_ids_collected_from_a_tokenizer_like_object():
    class Added:
        def __init__(self, special):
            self.special = special

    class Tok:
        all_special_ids = [0, 1]
        bos_token_id = 0
        eos_token_id = 1
        pad_token_id = 2
        added_tokens_decoder = {128000: Added(True), 128001: Added(False)}

    assert special_ids_from_tokenizer(Tok()) == {0, 1, 2, 128000}


def test_text_only_fallback_sees_visible_bos_strings():
    bad = ">" + BOS_TEXT * 31
    v = judge_text_only(bad, special_strings=[BOS_TEXT])
    assert not v.coherent and v.rule("no_special_strings").failed
    assert judge_text_only(J17_TEXT, special_strings=[BOS_TEXT]).coherent
