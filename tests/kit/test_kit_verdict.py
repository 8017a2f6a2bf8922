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


def test_j08_text_is_just_gt_and_the_verdict_still_fails():
    """Seed 6.5: the old judge printed COHERENT for J08 because the text was
    just '>' (BOS dropped from text). The verdict reads the ids."""
    text = _text_without_specials(J08)
    assert text == ">"
    v = judge(J08, special_ids=SPECIAL, requested_max_tokens=32, text=text)
    assert not v.coherent
    assert v.rule("text").status == "pass"  # the text alone looks fine


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
    # 3 distinct ids in 33 tokens, never two identical in a row; also a loop.
    loop = [101, 102, 103] * 11
    v = judge(loop, special_ids=SPECIAL, requested_max_tokens=32)
    assert v.rule("distinct_tokens").failed
    assert not v.rule("identical_run").failed
    assert v.rule("repetition_loop").failed


def test_coherent_start_collapsing_into_a_two_token_cycle_fails():
    """A false green of the old rules: 16 tokens of J17, then '你好，' forever.
    No identical run, 18 distinct ids >= 25% of 32: only the tail's period
    shows the collapse."""
    ids = J17[:16] + [30594, 303] * 8
    v = judge(ids, special_ids=SPECIAL, requested_max_tokens=32,
              finish_reason="length")
    assert not v.rule("identical_run").failed
    assert not v.rule("distinct_tokens").failed
    assert [r.name for r in v.failed_rules] == ["repetition_loop"]
    assert "2-token cycle [30594, 303]" in v.rule("repetition_loop").explanation
    assert "from position 16" in v.rule("repetition_loop").explanation


def test_ten_token_phrase_said_three_times_fails():
    phrase = J17[5:15]  # 10 distinct ids
    ids = J17[:2] + phrase * 3
    v = judge(ids, special_ids=SPECIAL, requested_max_tokens=32)
    assert not v.rule("distinct_tokens").failed  # 12 distinct >= 8
    assert v.rule("repetition_loop").failed
    assert "10-token cycle" in v.rule("repetition_loop").explanation
    assert v.rule("repeated_ngrams").failed


def test_phrase_repeated_three_times_mid_answer_fails_by_ngrams():
    """The loop broke off before the end: the tail is clean, the n-gram
    coverage is not."""
    phrase = J17[5:15]
    ids = phrase * 3 + J17[20:26]
    v = judge(ids, special_ids=SPECIAL)
    assert not v.rule("repetition_loop").failed
    assert v.rule("repeated_ngrams").failed


@pytest.mark.parametrize("tail", [
    [621, 666, 621, 666, 621, 666],          # a short 2-cycle: '|---|---|---|'
    [1465, 1465, 1465, 1465],                # '哈哈哈哈'
])
def test_short_natural_repetitions_are_not_loops(tail):
    ids = J17[:32 - len(tail)] + tail
    v = judge(ids, special_ids=SPECIAL, requested_max_tokens=32)
    assert v.coherent, v.report()


def test_short_answer_ending_at_eos_then_ignore_eos_continuation_is_coherent():
    """'17 * 23 = 391' then EOS: with ignore_eos the engine keeps sampling
    (here EOS again and a restarted turn). The probe asks for an answer, so the
    answer is judged, not what ignore_eos forced after it."""
    answer = [1959, 17585, 42108, 303, 56463, 10162]
    after = [EOS, EOS, EOS] + [223] * 12 + [EOS] * 10
    ids = answer + after
    assert len(ids) == 31
    ids.append(EOS)
    v = judge(ids, special_ids=SPECIAL, eos_ids={EOS}, requested_max_tokens=32,
              finish_reason="length")
    assert v.coherent, v.report()
    assert "6-token answer" in v.rule("answer").explanation
    assert v.rule("after_eos").status == "pass"
    # Without knowing EOS the same ids look degenerate (BOS/EOS after the
    # first token), which is what happened before the answer was defined.
    assert not judge(ids, special_ids=SPECIAL, requested_max_tokens=32).coherent


def test_real_chat_answer_that_ends_early_passes():
    """A real 32-token chat reply that ends early: J17's first 20 ids (a greeting), EOS, then
    what a finished chat model emits under ignore_eos: EOS again, or a new turn's text. Both
    pass with the DeepSeek fillers (BOS 0, PAD 2) named; so does the same reply with a
    clean stop (no ignore_eos)."""
    for after in ([EOS] * 11, [EOS] + J17[:10]):
        ids = J17[:20] + [EOS] + after
        v = judge(ids, special_ids=SPECIAL | {2}, eos_ids={EOS}, filler_ids={BOS, 2},
                  requested_max_tokens=32, finish_reason="length")
        assert v.coherent, v.report()
    v = judge(J17[:20] + [EOS], special_ids=SPECIAL, eos_ids={EOS}, finish_reason="stop",
              expected_finish_reason="stop")
    assert v.coherent, v.report()


@pytest.mark.parametrize("ids", [
    [32, EOS] + [BOS] * 30,                 # the review's [tok, EOS, BOS, BOS, ...]
    [32, EOS, BOS, EOS] * 8,
    J17[:20] + [EOS, BOS] + J17[:10],       # a long answer, then BOS filler
    J17[:20] + [EOS] + [2] * 11,            # ... then PAD filler
])
def test_filler_after_eos_is_not_coherent(ids):
    """Regression (issue #17 review, item 6): with min_answer_tokens = 1 a one-token answer
    followed by EOS then BOS forever was COHERENT: the seed's J08 signature with an EOS in it.
    A BOS/PAD after the answer's EOS fails (after_eos), and an answer that ignore_eos ran past
    needs >= 4 tokens."""
    v = judge(ids, special_ids=SPECIAL | {2}, eos_ids={EOS}, filler_ids={BOS, 2},
              requested_max_tokens=32, finish_reason="length")
    assert not v.coherent, v.report()
    # without filler_ids every special that is not EOS is a filler
    assert not judge(ids, special_ids=SPECIAL | {2}, eos_ids={EOS},
                     requested_max_tokens=32).coherent


def test_one_token_then_eos_then_text_is_too_short_an_answer():
    """Only the prefill token came before the EOS: no decode step is proven, whatever follows
    (here ordinary ids). A clean single EOS at the end is a real stop and may be short."""
    v = judge([32, EOS] + J17[:30], special_ids=SPECIAL, eos_ids={EOS},
              requested_max_tokens=32)
    assert v.rule("no_special_tokens").failed, v.report()
    assert judge([J17[0], J17[1], EOS], special_ids=SPECIAL, eos_ids={EOS}).coherent


def test_eos_as_the_first_token_is_not_an_answer():
    ids = [EOS] + J17[:31]
    v = judge(ids, special_ids=SPECIAL, eos_ids={EOS}, requested_max_tokens=32)
    assert v.rule("no_special_tokens").failed
    assert "first generated token" in v.rule("no_special_tokens").explanation


def test_answer_before_eos_that_loops_still_fails():
    ids = J17[:4] + [30594, 303] * 8 + [EOS] + J17[:11]
    v = judge(ids, special_ids=SPECIAL, eos_ids={EOS})
    assert v.rule("repetition_loop").failed


def test_bos_after_the_first_token_is_not_forgiven_by_eos_ids():
    """J08's signature (BOS, not EOS) stays a failure with eos_ids given."""
    v = judge(J08, special_ids=SPECIAL, eos_ids={EOS}, requested_max_tokens=32)
    assert v.rule("no_special_tokens").failed


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logprob_fails(bad):
    lps = [-0.5] * 32
    lps[7] = bad
    v = judge(J17, special_ids=SPECIAL, logprobs=lps)
    assert [r.name for r in v.failed_rules] == ["finite_logprobs"]
    assert "position 7" in v.rule("finite_logprobs").explanation


@pytest.mark.parametrize("entry", [None, {}, {"other": "thing"}])
def test_missing_logprobs_fail_instead_of_passing(entry):
    """Logprobs were requested and every entry came back unreadable: that
    proves nothing about NaN, so it must not pass."""
    v = judge(J17, special_ids=SPECIAL, logprobs=[entry] * 32)
    assert [r.name for r in v.failed_rules] == ["finite_logprobs"]
    assert "32/32" in v.rule("finite_logprobs").explanation
    lps = [-0.5] * 32
    lps[9] = entry
    r = judge(J17, special_ids=SPECIAL, logprobs=lps).rule("finite_logprobs")
    assert r.failed and "position 9" in r.explanation


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


# --------------------------------------------------------------- rejudge_log
from dcu_kit.verdict import rejudge_log  # noqa: E402

VIN = '{"eos_ids": [1], "requested_max_tokens": 32, "special_ids": [0, 1]}'


def test_rejudge_catches_a_coherent_word_beside_degenerate_ids():
    """A stale/forged 'DSV4_VERDICT: COHERENT' next to J08's ids must fail:
    the job judges the ids again and never trusts the word."""
    log = "\n".join([f"TOKEN_IDS: {J08}", f"VERDICT_INPUT: {VIN}",
                     "DSV4_VERDICT: COHERENT", "PROBE_EXIT=0"])
    code, lines = rejudge_log(log)
    assert code == 3
    assert "REJUDGE_RESULT: DEGENERATE" in lines
    assert any("no_special_tokens" in ln for ln in lines)


def test_rejudge_catches_a_loop_even_without_verdict_input():
    ids = J17[:16] + [30594, 303] * 8
    code, lines = rejudge_log(f"TOKEN_IDS: {ids}\nDSV4_VERDICT: COHERENT\n")
    assert code == 3 and any("repetition_loop" in ln for ln in lines)


def test_rejudge_passes_j17_and_fails_without_ids_or_word():
    good = f"TOKEN_IDS: {J17}\nVERDICT_INPUT: {VIN}\nDSV4_VERDICT: COHERENT\n"
    assert rejudge_log(good)[0] == 0
    assert rejudge_log(good + "DSV4_VERDICT: DEGENERATE (x)\n")[0] == 3
    assert rejudge_log("DSV4_VERDICT: COHERENT\n")[0] == 4
    assert rejudge_log(f"TOKEN_IDS: {J17}\n")[0] == 4
    # a serve smoke whose server returned no ids
    smoke = "CHAT_TOKEN_IDS: None\nSERVE_SMOKE_VERDICT: COHERENT\n"
    assert rejudge_log(smoke)[0] == 3


def test_rejudge_checks_every_tagged_sequence():
    log = "\n".join([f"WARMUP_TOKEN_IDS: {J09}", f"WARMUP_VERDICT_INPUT: {VIN}",
                     f"TOKEN_IDS: {J17}", f"VERDICT_INPUT: {VIN}",
                     "DSV4_VERDICT: COHERENT"])
    code, lines = rejudge_log(log)
    assert code == 3 and any(ln.startswith("REJUDGE: WARMUP_TOKEN_IDS")
                             and "DEGENERATE" in ln for ln in lines)
