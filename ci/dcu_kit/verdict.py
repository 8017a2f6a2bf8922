# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verdict over one generated sequence: is it a real, coherent decode?

The seed lost days to false greens (field report 6.5): job J08 printed
``TOKEN_IDS: [32, 0, 0, ...]`` (one prefill token, then BOS forever) and the
old judge said COHERENT because it only looked at the *text*, and BOS is
dropped from the text by ``skip_special_tokens``. This verdict therefore reads
token ids first and text only as a supplement.

``judge()`` is a pure function: no vLLM, no tokenizer object, no I/O. Pass the
special ids of the tokenizer (``special_ids_from_tokenizer`` helps) and, when
available, the per-token logprobs.

Rules (each reported, with an explanation):
  non_empty            at least one token was generated
  enough_tokens        len(ids) >= requested max_tokens (runs use ignore_eos)
  finish_reason        finish reason is the expected one ("length" with
                       ignore_eos) - skipped when not given
  no_special_tokens    no BOS/EOS/pad/other special id after the first
                       generated token (and not as the first either unless
                       allowed); an EOS listed in ``allowed_final_ids`` may
                       end the sequence
  valid_ids            every id in [0, vocab_size) - skipped without vocab
  identical_run        no run of the same id longer than max_identical_run
  repetition_loop      the tail is not a loop: no period p <= max_loop_period
                       repeated >= min_loop_repeats times over >=
                       min_loop_tokens tokens (a coherent start that collapses
                       into a 2-token cycle, a phrase said three times)
  repeated_ngrams      tokens inside n-grams (n = ngram_n) that occur
                       >= min_loop_repeats times cover at most
                       max_repeated_ngram_fraction of the answer
  distinct_tokens      at least max(min_distinct, ceil(ratio * n)) distinct
  finite_logprobs      every position has a readable, finite logprob -
                       skipped only when no logprobs were requested
  text                 decoded text (if given) is non-empty and has few
                       U+FFFD replacement characters

What is judged ("the answer"): the probe asks for a chat answer of
max_tokens tokens with ``ignore_eos``. When ``eos_ids`` are given and the
model ends its answer with EOS at position i, the answer is ``ids[:i]`` (a
short, correct reply) if it is long enough: an EOS that is the last token
(a clean stop) may end an answer of any length, an EOS followed by more
tokens (``ignore_eos`` ran on) only one of >= ``min_answer_tokens`` (4)
tokens -- one token then EOS proves no decode step worked (the seed's
signature was one prefill token, then junk). An EOS too early is a failure
(``no_special_tokens``). What follows the EOS is not judged for repetition
(a finished model may repeat EOS or start a new turn there), but it must not
hold a filler id (``filler_ids``: BOS/PAD; default: the special ids that
are not EOS), rule ``after_eos``: a real 32-token reply that stops early
looks like ``[answer..., EOS, EOS, ...]`` or ``[answer..., EOS, <text of a
new turn>]``, while ``[tok, EOS, BOS, BOS, ...]`` is the seed's decode
failure with an EOS in it. Logprobs are checked for every token, answer or
not: a NaN is a numerics bug wherever it shows.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PASS = "pass"
FAIL = "fail"
SKIP = "skip"

COHERENT = "COHERENT"
DEGENERATE = "DEGENERATE"

# Named default thresholds (see judge() for their meaning).
DEFAULT_MAX_IDENTICAL_RUN = 8
DEFAULT_MIN_DISTINCT = 4
DEFAULT_MIN_DISTINCT_RATIO = 0.25
DEFAULT_MAX_REPLACEMENT_CHAR_RATIO = 0.10
# Loops: a tail of period p <= 16 seen 3 times over >= 12 tokens. 12 keeps a
# Markdown rule ("|---|---|---|") or "哈哈哈" from counting as a loop, and is
# short enough to catch a 2-token cycle in the last third of a 32-token run.
DEFAULT_MAX_LOOP_PERIOD = 16
DEFAULT_MIN_LOOP_REPEATS = 3
DEFAULT_MIN_LOOP_TOKENS = 12
# n-grams: 4-grams seen 3+ times covering over half of the answer.
DEFAULT_NGRAM_N = 4
DEFAULT_MAX_REPEATED_NGRAM_FRACTION = 0.5
# An answer that ignore_eos ran past must have >= 4 tokens (3 decode steps).
DEFAULT_MIN_ANSWER_TOKENS = 4


@dataclass(frozen=True)
class RuleResult:
    name: str
    status: str  # PASS | FAIL | SKIP
    explanation: str

    @property
    def failed(self) -> bool:
        return self.status == FAIL


@dataclass(frozen=True)
class Verdict:
    rules: tuple[RuleResult, ...]
    num_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def coherent(self) -> bool:
        return not any(r.failed for r in self.rules)

    @property
    def label(self) -> str:
        return COHERENT if self.coherent else DEGENERATE

    @property
    def failed_rules(self) -> list[RuleResult]:
        return [r for r in self.rules if r.failed]

    def rule(self, name: str) -> RuleResult:
        for r in self.rules:
            if r.name == name:
                return r
        raise KeyError(f"no verdict rule named {name!r}")

    def summary(self) -> str:
        """One line, e.g. ``DEGENERATE (no_special_tokens, identical_run)``."""
        if self.coherent:
            return COHERENT
        return f"{DEGENERATE} ({', '.join(r.name for r in self.failed_rules)})"

    def report(self) -> str:
        lines = [f"DSV4_VERDICT: {self.summary()}"]
        for r in self.rules:
            lines.append(f"  [{r.status.upper():4}] {r.name}: {r.explanation}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "coherent": self.coherent,
            "num_tokens": self.num_tokens,
            "rules": [
                {"name": r.name, "status": r.status, "explanation": r.explanation}
                for r in self.rules
            ],
        }


def _logprob_value(entry: Any, token_id: int | None) -> float | None:
    """Normalize one position's logprob.

    Accepts a float, a vLLM ``{token_id: Logprob}`` dict (the sampled id's
    entry is used, else every entry), an OpenAI-style ``{"logprob": x}`` dict,
    or an object with ``.logprob``. Returns None if nothing usable.
    """
    if entry is None:
        return None
    if isinstance(entry, (int, float)):
        return float(entry)
    if hasattr(entry, "logprob"):
        return float(entry.logprob)
    if isinstance(entry, Mapping):
        if "logprob" in entry:
            return float(entry["logprob"])
        if token_id is not None and token_id in entry:
            return _logprob_value(entry[token_id], None)
        vals = [_logprob_value(v, None) for v in entry.values()]
        vals = [v for v in vals if v is not None]
        if not vals:
            return None
        # Any non-finite among the returned candidates is a failure signal.
        bad = [v for v in vals if not math.isfinite(v)]
        return bad[0] if bad else vals[0]
    return None


def _longest_run(ids: Sequence[int]) -> tuple[int, int | None, int]:
    """(length, token id, start index) of the longest run of equal ids."""
    best_len, best_tok, best_start = 0, None, 0
    cur_len, cur_start = 0, 0
    for i, t in enumerate(ids):
        if i > 0 and t == ids[i - 1]:
            cur_len += 1
        else:
            cur_len, cur_start = 1, i
        if cur_len > best_len:
            best_len, best_tok, best_start = cur_len, t, cur_start
    return best_len, best_tok, best_start


def tail_loop(ids: Sequence[int], max_period: int) -> tuple[int, int]:
    """(period, length) of the longest periodic suffix of ``ids``.

    For each period p the suffix is extended while ``ids[i] == ids[i - p]``;
    its length counts the first period too. Among periods the one covering
    the most tokens wins (ties: the shortest period). (0, 0) for < 2 ids.
    """
    best_p, best_len = 0, 0
    n = len(ids)
    for p in range(1, min(max_period, n // 2) + 1):
        i = n - 1
        while i - p >= 0 and ids[i] == ids[i - p]:
            i -= 1
        length = (n - 1 - i) + p
        if length >= 2 * p and length > best_len:
            best_p, best_len = p, length
    return best_p, best_len


def repeated_ngram_coverage(ids: Sequence[int], n: int, min_count: int
                            ) -> tuple[float, tuple[int, ...] | None, int]:
    """Fraction of positions covered by n-grams occurring >= min_count times
    (overlapping occurrences counted), the most frequent such n-gram and its
    count."""
    if len(ids) < n:
        return 0.0, None, 0
    grams: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(ids) - n + 1):
        grams.setdefault(tuple(ids[i:i + n]), []).append(i)
    covered: set[int] = set()
    top, top_count = None, 0
    for g, starts in grams.items():
        if len(starts) >= min_count:
            for st in starts:
                covered.update(range(st, st + n))
            if len(starts) > top_count:
                top, top_count = g, len(starts)
    return len(covered) / len(ids), top, top_count


def judge(
    token_ids: Sequence[int],
    *,
    special_ids: Iterable[int],
    requested_max_tokens: int | None = None,
    logprobs: Sequence[Any] | None = None,
    finish_reason: str | None = None,
    expected_finish_reason: str | None = "length",
    text: str | None = None,
    vocab_size: int | None = None,
    allowed_final_ids: Iterable[int] = (),
    allow_special_first: bool = False,
    eos_ids: Iterable[int] = (),
    filler_ids: Iterable[int] | None = None,
    min_answer_tokens: int = DEFAULT_MIN_ANSWER_TOKENS,
    max_identical_run: int = DEFAULT_MAX_IDENTICAL_RUN,
    max_loop_period: int = DEFAULT_MAX_LOOP_PERIOD,
    min_loop_repeats: int = DEFAULT_MIN_LOOP_REPEATS,
    min_loop_tokens: int = DEFAULT_MIN_LOOP_TOKENS,
    ngram_n: int = DEFAULT_NGRAM_N,
    max_repeated_ngram_fraction: float = DEFAULT_MAX_REPEATED_NGRAM_FRACTION,
    min_distinct: int = DEFAULT_MIN_DISTINCT,
    min_distinct_ratio: float = DEFAULT_MIN_DISTINCT_RATIO,
    max_replacement_char_ratio: float = DEFAULT_MAX_REPLACEMENT_CHAR_RATIO,
) -> Verdict:
    """Judge one generated sequence. Pure; see module docstring for rules.

    ``requested_max_tokens``: max_tokens the request asked for; with
    ``ignore_eos`` a correct run produces exactly that many tokens.
    ``allowed_final_ids``: special ids (usually EOS) that may legitimately be
    the last token (runs without ignore_eos).
    ``eos_ids``: end-of-answer ids; with ``ignore_eos`` the answer is the
    part before the first EOS at position >= ``min_answer_tokens`` (see the
    module docstring), the rest is not judged for repetition/specials.
    ``filler_ids``: BOS/PAD ids, which must not follow the answer's EOS
    (default: ``special_ids`` minus ``eos_ids``).
    """
    all_ids = [int(t) for t in token_ids]
    specials = {int(s) for s in special_ids}
    allowed_final = {int(s) for s in allowed_final_ids}
    eos = {int(s) for s in eos_ids}
    n = len(all_ids)
    rules: list[RuleResult] = []
    # The answer: up to the first EOS that ends a real (long enough) reply.
    answer_end = n
    for i, t in enumerate(all_ids):
        if t in eos:
            clean_stop = i == n - 1   # the EOS ends the sequence: nothing ran on
            if i >= (1 if clean_stop else max(1, min_answer_tokens)):
                answer_end = i
            break
    ids = all_ids[:answer_end]
    na = len(ids)
    if answer_end < n:
        rules.append(RuleResult(
            "answer", PASS,
            f"EOS {all_ids[answer_end]} at position {answer_end} ends a "
            f"{na}-token answer; the {n - answer_end - 1} tokens after it "
            "come from ignore_eos and are not judged"))
    else:
        rules.append(RuleResult("answer", SKIP,
                                f"no EOS: all {n} tokens are the answer"))

    # after_eos: what ignore_eos generated after the answer's EOS
    fillers = (specials - eos) if filler_ids is None else {int(t) for t in filler_ids}
    tail = all_ids[answer_end + 1:]
    bad_tail = [answer_end + 1 + j for j, t in enumerate(tail) if t in fillers]
    if answer_end >= n - 1:
        rules.append(RuleResult("after_eos", SKIP, "nothing after an EOS"))
    elif bad_tail:
        rules.append(RuleResult(
            "after_eos", FAIL,
            f"filler id {all_ids[bad_tail[0]]} (BOS/PAD) at position {bad_tail[0]} "
            f"after the answer's EOS; {len(bad_tail)}/{len(tail)} tokens after it are "
            "fillers (the seed's token-then-BOS signature, with an EOS in it)"))
    else:
        rules.append(RuleResult("after_eos", PASS,
                                f"no BOS/PAD in the {len(tail)} tokens after EOS"))

    # non_empty
    if n == 0:
        rules.append(RuleResult("non_empty", FAIL, "no token was generated"))
    else:
        rules.append(RuleResult("non_empty", PASS, f"{n} tokens generated"))

    # enough_tokens
    if requested_max_tokens is None:
        rules.append(RuleResult("enough_tokens", SKIP, "max_tokens not given"))
    elif n < requested_max_tokens:
        rules.append(
            RuleResult(
                "enough_tokens",
                FAIL,
                f"{n} tokens < requested max_tokens={requested_max_tokens} "
                "(with ignore_eos the decode stopped early)",
            )
        )
    else:
        rules.append(
            RuleResult(
                "enough_tokens", PASS, f"{n} >= max_tokens={requested_max_tokens}"
            )
        )

    # finish_reason
    if finish_reason is None or expected_finish_reason is None:
        rules.append(RuleResult("finish_reason", SKIP, "not given"))
    elif finish_reason != expected_finish_reason:
        rules.append(
            RuleResult(
                "finish_reason",
                FAIL,
                f"finish_reason={finish_reason!r}, expected "
                f"{expected_finish_reason!r}",
            )
        )
    else:
        rules.append(RuleResult("finish_reason", PASS, f"{finish_reason!r}"))

    # no_special_tokens
    bad_pos = []
    for i, t in enumerate(ids):
        if t not in specials:
            continue
        if i == 0 and allow_special_first:
            continue
        if i == na - 1 and answer_end == n and t in allowed_final:
            continue
        bad_pos.append(i)
    if not specials:
        rules.append(
            RuleResult("no_special_tokens", SKIP, "no special ids were given")
        )
    elif bad_pos:
        first = bad_pos[0]
        where = (
            "after the first generated token"
            if first > 0
            else "as the first generated token"
        )
        rules.append(
            RuleResult(
                "no_special_tokens",
                FAIL,
                f"special id {ids[first]} {where} at position {first}; "
                f"{len(bad_pos)}/{na} positions are special ids "
                "(the seed's prefill-token-then-BOS signature)",
            )
        )
    else:
        rules.append(RuleResult("no_special_tokens", PASS, "none"))

    # valid_ids
    if vocab_size is None:
        rules.append(RuleResult("valid_ids", SKIP, "vocab_size not given"))
    else:
        oob = [t for t in all_ids if t < 0 or t >= vocab_size]
        if oob:
            rules.append(
                RuleResult(
                    "valid_ids",
                    FAIL,
                    f"{len(oob)} ids outside [0, {vocab_size}), e.g. {oob[0]}",
                )
            )
        else:
            rules.append(RuleResult("valid_ids", PASS, f"all < {vocab_size}"))

    # identical_run
    run_len, run_tok, run_start = _longest_run(ids)
    if run_len > max_identical_run:
        rules.append(
            RuleResult(
                "identical_run",
                FAIL,
                f"id {run_tok} repeated {run_len}x from position {run_start} "
                f"(> max_identical_run={max_identical_run})",
            )
        )
    else:
        rules.append(
            RuleResult(
                "identical_run",
                PASS,
                f"longest run {run_len} <= {max_identical_run}",
            )
        )

    # distinct_tokens
    # repetition_loop: periodic tail of the answer
    period, loop_len = tail_loop(ids, max_loop_period)
    if (period and loop_len >= min_loop_tokens
            and loop_len >= min_loop_repeats * period):
        rules.append(RuleResult(
            "repetition_loop", FAIL,
            f"the last {loop_len} tokens repeat a {period}-token cycle "
            f"{ids[na - loop_len:na - loop_len + period]} "
            f"{loop_len / period:.1f}x from position {na - loop_len} "
            f"(>= {min_loop_repeats}x over >= {min_loop_tokens} tokens)"))
    else:
        rules.append(RuleResult(
            "repetition_loop", PASS,
            f"longest periodic tail: period {period}, {loop_len} tokens"
            if period else "no periodic tail"))

    # repeated_ngrams: repeated phrases anywhere in the answer
    cov, gram, count = repeated_ngram_coverage(ids, ngram_n, min_loop_repeats)
    if cov > max_repeated_ngram_fraction:
        rules.append(RuleResult(
            "repeated_ngrams", FAIL,
            f"{cov:.0%} of the answer lies in {ngram_n}-grams seen >= "
            f"{min_loop_repeats}x (e.g. {list(gram)} {count}x; > "
            f"{max_repeated_ngram_fraction:.0%})"))
    else:
        rules.append(RuleResult(
            "repeated_ngrams", PASS,
            f"{cov:.0%} in {ngram_n}-grams seen >= {min_loop_repeats}x"))

    need = max(min_distinct, math.ceil(min_distinct_ratio * na)) if na else 1
    need = min(need, na) if na else 1
    distinct = len(set(ids))
    if na and distinct < need:
        rules.append(
            RuleResult(
                "distinct_tokens",
                FAIL,
                f"{distinct} distinct ids < {need} "
                f"(min_distinct={min_distinct}, "
                f"min_distinct_ratio={min_distinct_ratio})",
            )
        )
    elif not na:
        rules.append(RuleResult("distinct_tokens", FAIL, "no tokens"))
    else:
        rules.append(
            RuleResult("distinct_tokens", PASS, f"{distinct} distinct >= {need}")
        )

    # finite_logprobs
    if logprobs is None:
        rules.append(RuleResult("finite_logprobs", SKIP, "logprobs not given"))
    else:
        vals = []
        for i, entry in enumerate(logprobs):
            tok = all_ids[i] if i < n else None
            vals.append(_logprob_value(entry, tok))
        bad = [(i, v) for i, v in enumerate(vals) if v is not None and not (
            math.isfinite(v))]
        missing = sum(v is None for v in vals)
        if bad:
            i, v = bad[0]
            rules.append(
                RuleResult(
                    "finite_logprobs",
                    FAIL,
                    f"{len(bad)} non-finite logprobs, first at position {i}: {v}",
                )
            )
        elif len(vals) < n:
            rules.append(
                RuleResult(
                    "finite_logprobs",
                    FAIL,
                    f"only {len(vals)} logprob entries for {n} tokens",
                )
            )
        elif missing:
            first = next(i for i, v in enumerate(vals) if v is None)
            rules.append(
                RuleResult(
                    "finite_logprobs",
                    FAIL,
                    f"{missing}/{n} logprob entries are missing or "
                    f"unreadable, first at position {first} "
                    f"({logprobs[first]!r}): a missing logprob proves nothing",
                )
            )
        else:
            rules.append(
                RuleResult("finite_logprobs", PASS, f"{len(vals)} finite"))

    # text
    if text is None:
        rules.append(RuleResult("text", SKIP, "text not given"))
    elif not text.strip():
        rules.append(
            RuleResult(
                "text",
                FAIL,
                f"decoded text is blank ({text!r}); special tokens vanish "
                "from text, check TOKEN_IDS",
            )
        )
    else:
        ratio = text.count("\ufffd") / max(1, len(text))
        if ratio > max_replacement_char_ratio:
            rules.append(
                RuleResult(
                    "text",
                    FAIL,
                    f"{ratio:.0%} U+FFFD replacement characters "
                    f"(> {max_replacement_char_ratio:.0%}): byte garbage",
                )
            )
        else:
            rules.append(RuleResult("text", PASS, f"{len(text)} chars"))

    return Verdict(rules=tuple(rules), num_tokens=n)


def special_ids_from_tokenizer(tokenizer: Any) -> set[int]:
    """Collect special ids from a HF-like tokenizer (duck-typed).

    Uses ``all_special_ids``, bos/eos/pad ids and added tokens flagged
    special. Never raises on a missing attribute.
    """
    ids: set[int] = set()
    try:
        ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", None) or [])
    except Exception:
        pass
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(decoder, Mapping):
        for i, tok in decoder.items():
            if getattr(tok, "special", False):
                ids.add(int(i))
    # unk is a normal-looking piece in some vocabularies; keep it: an unk in
    # generated output is itself a failure signal.
    return ids


def filler_ids_from_tokenizer(tokenizer: Any) -> set[int]:
    """BOS and PAD ids of a HF-like tokenizer (``judge(filler_ids=...)``)."""
    ids: set[int] = set()
    for attr in ("bos_token_id", "pad_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            ids.add(v)
    return ids


def judge_text_only(
    text: str,
    *,
    special_strings: Iterable[str] = (),
    min_chars: int = 1,
    max_identical_char_run: int = 16,
) -> Verdict:
    """Weaker fallback when only text is available (e.g. a server without
    logprobs). It cannot see special tokens that the detokenizer dropped, so
    prefer ``judge()``; the serve smoke test requests
    ``skip_special_tokens=False`` so that BOS stays visible in the text.
    """
    rules: list[RuleResult] = []
    stripped = text.strip()
    if len(stripped) < min_chars:
        rules.append(RuleResult("text_non_empty", FAIL, f"text={text!r}"))
    else:
        rules.append(RuleResult("text_non_empty", PASS, f"{len(text)} chars"))
    found = [s for s in special_strings if s and s in text]
    if found:
        rules.append(
            RuleResult(
                "no_special_strings",
                FAIL,
                f"special token text {found[0]!r} appears "
                f"{text.count(found[0])}x",
            )
        )
    else:
        rules.append(
            RuleResult(
                "no_special_strings",
                PASS if special_strings else SKIP,
                "none" if special_strings else "no special strings given",
            )
        )
    run_len, run_ch, _ = _longest_run([ord(c) for c in text])
    if run_len > max_identical_char_run:
        rules.append(
            RuleResult(
                "identical_char_run",
                FAIL,
                f"{chr(run_ch)!r} repeated {run_len}x",
            )
        )
    else:
        rules.append(RuleResult("identical_char_run", PASS, f"max {run_len}"))
    return Verdict(rules=tuple(rules), num_tokens=-1)


# ------------------------------------------------------------ re-judging logs
# The probe and the serve smoke test print, per judged sequence,
#   <TAG>TOKEN_IDS: [..]            the ids (TAG: '', WARMUP_, CHAT_, STREAM_)
#   <TAG>VERDICT_INPUT: {json}      judge() keyword arguments besides the ids
# so that the job can judge the ids again instead of trusting the word on the
# DSV4_VERDICT line (a stale or hand-edited COHERENT must not pass).
IDS_LINE_RE = re.compile(r"^(?P<tag>[A-Z_]*?)TOKEN_IDS: (?P<ids>.*)$")
INPUT_LINE_RE = re.compile(r"^(?P<tag>[A-Z_]*?)VERDICT_INPUT: (?P<json>.*)$")
WORD_LINE_RE = re.compile(r"^(?:DSV4|SERVE_SMOKE)_VERDICT: (?P<word>\S+)")
REJUDGE_KWARGS = ("special_ids", "eos_ids", "filler_ids", "requested_max_tokens",
                  "finish_reason", "expected_finish_reason", "vocab_size",
                  "allowed_final_ids", "allow_special_first",
                  "max_identical_run", "min_distinct")

REJUDGE_OK, REJUDGE_DEGENERATE, REJUDGE_MISSING = 0, 3, 4


def verdict_input(**kwargs: Any) -> str:
    """The JSON printed on a ``VERDICT_INPUT:`` line (sets become lists)."""
    return json.dumps({k: sorted(v) if isinstance(v, (set, frozenset)) else v
                       for k, v in kwargs.items() if k in REJUDGE_KWARGS},
                      ensure_ascii=False, sort_keys=True)


def rejudge_log(text: str) -> tuple[int, list[str]]:
    """Judge every TOKEN_IDS line of a raw log again.

    Returns (code, report lines): REJUDGE_OK when the last verdict word is
    COHERENT and every id line re-judges coherent; REJUDGE_DEGENERATE when
    the word is not COHERENT or any id line re-judges degenerate;
    REJUDGE_MISSING when there is no verdict word or no id line to check.
    """
    word = None
    ids_by_tag: dict[str, tuple[int, Any]] = {}
    input_by_tag: dict[str, dict[str, Any]] = {}
    for no, raw in enumerate(text.split("\n"), start=1):
        line = raw.rstrip("\r")
        m = WORD_LINE_RE.match(line)
        if m:
            word = m.group("word")
            continue
        m = INPUT_LINE_RE.match(line)
        if m:
            try:
                input_by_tag[m.group("tag")] = json.loads(m.group("json"))
            except json.JSONDecodeError:
                input_by_tag[m.group("tag")] = {"_unreadable": line}
            continue
        m = IDS_LINE_RE.match(line)
        if m:
            try:
                ids_by_tag[m.group("tag")] = (no, ast.literal_eval(m.group("ids")))
            except (ValueError, SyntaxError):
                ids_by_tag[m.group("tag")] = (no, "unreadable")
    out: list[str] = []
    if word is None:
        return REJUDGE_MISSING, ["REJUDGE: MISSING (no DSV4_VERDICT/"
                                 "SERVE_SMOKE_VERDICT line)"]
    if not ids_by_tag:
        return REJUDGE_MISSING, [f"REJUDGE: MISSING (the verdict says {word} "
                                 "but no TOKEN_IDS line backs it)"]
    code = REJUDGE_OK if word == COHERENT else REJUDGE_DEGENERATE
    if word != COHERENT:
        out.append(f"REJUDGE: verdict line says {word}")
    for tag, (no, ids) in sorted(ids_by_tag.items()):
        name = f"{tag}TOKEN_IDS (line {no})"
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            out.append(f"REJUDGE: {name}: {ids!r} is not a list of ids")
            code = REJUDGE_DEGENERATE
            continue
        kw = {k: v for k, v in input_by_tag.get(tag, {}).items()
              if k in REJUDGE_KWARGS}
        kw.setdefault("special_ids", ())
        if tag not in input_by_tag:
            out.append(f"REJUDGE: {name}: no {tag}VERDICT_INPUT line; judged "
                       "without special ids or max_tokens")
        v = judge(ids, **kw)
        out.append(f"REJUDGE: {name}: {v.summary()}")
        if not v.coherent:
            code = REJUDGE_DEGENERATE
            out.extend("  " + ln for ln in v.report().splitlines()[1:]
                       if "[FAIL]" in ln)
    out.append("REJUDGE_RESULT: " + {REJUDGE_OK: COHERENT,
                                     REJUDGE_DEGENERATE: DEGENERATE}[code])
    return code, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dcu_kit.verdict",
        description="re-judge the token ids of a raw log (exit 0 coherent, "
                    "3 degenerate or the word disagrees, 4 nothing to judge, "
                    "2 unreadable log)")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rejudge", help="judge every TOKEN_IDS line again")
    r.add_argument("log")
    a = p.parse_args(argv)
    try:
        with open(a.log, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        print(f"REJUDGE: cannot read {a.log!r}: {e}", file=sys.stderr)
        return 2
    code, lines = rejudge_log(text)
    print("\n".join(lines), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
