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
  distinct_tokens      at least max(min_distinct, ceil(ratio * n)) distinct
  finite_logprobs      every provided logprob is finite - skipped if absent
  text                 decoded text (if given) is non-empty and has few
                       U+FFFD replacement characters
"""

from __future__ import annotations

import math
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
    max_identical_run: int = DEFAULT_MAX_IDENTICAL_RUN,
    min_distinct: int = DEFAULT_MIN_DISTINCT,
    min_distinct_ratio: float = DEFAULT_MIN_DISTINCT_RATIO,
    max_replacement_char_ratio: float = DEFAULT_MAX_REPLACEMENT_CHAR_RATIO,
) -> Verdict:
    """Judge one generated sequence. Pure; see module docstring for rules.

    ``requested_max_tokens``: max_tokens the request asked for; with
    ``ignore_eos`` a correct run produces exactly that many tokens.
    ``allowed_final_ids``: special ids (usually EOS) that may legitimately be
    the last token (runs without ignore_eos).
    """
    ids = [int(t) for t in token_ids]
    specials = {int(s) for s in special_ids}
    allowed_final = {int(s) for s in allowed_final_ids}
    n = len(ids)
    rules: list[RuleResult] = []

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
        if i == n - 1 and t in allowed_final:
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
                f"{len(bad_pos)}/{n} positions are special ids "
                "(the seed's prefill-token-then-BOS signature)",
            )
        )
    else:
        rules.append(RuleResult("no_special_tokens", PASS, "none"))

    # valid_ids
    if vocab_size is None:
        rules.append(RuleResult("valid_ids", SKIP, "vocab_size not given"))
    else:
        oob = [t for t in ids if t < 0 or t >= vocab_size]
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
    need = max(min_distinct, math.ceil(min_distinct_ratio * n)) if n else 1
    need = min(need, n) if n else 1
    distinct = len(set(ids))
    if n and distinct < need:
        rules.append(
            RuleResult(
                "distinct_tokens",
                FAIL,
                f"{distinct} distinct ids < {need} "
                f"(min_distinct={min_distinct}, "
                f"min_distinct_ratio={min_distinct_ratio})",
            )
        )
    elif not n:
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
            tok = ids[i] if i < n else None
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
        else:
            rules.append(
                RuleResult(
                    "finite_logprobs",
                    PASS,
                    f"{len(vals) - missing} finite"
                    + (f", {missing} unreadable" if missing else ""),
                )
            )

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
