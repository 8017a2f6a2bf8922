# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared helpers for the cluster matrix (imported by the tests)."""

from dcu_kit.verdict import judge, special_ids_from_tokenizer


def greedy(max_tokens, logprobs=0):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                          ignore_eos=True, logprobs=logprobs)


def user(text):
    return [{"role": "user", "content": text}]


def assert_coherent(llm, outputs, max_tokens, what):
    """Verdict on every output; the failure message carries ids and rules."""
    tok = llm.get_tokenizer()
    specials = special_ids_from_tokenizer(tok)
    bad = []
    for i, o in enumerate(outputs):
        c = o.outputs[0]
        v = judge(c.token_ids, special_ids=specials,
                  requested_max_tokens=max_tokens, logprobs=c.logprobs,
                  finish_reason=c.finish_reason, text=c.text)
        if not v.coherent:
            bad.append(f"[{what} #{i}] TOKEN_IDS={list(c.token_ids)}\n"
                       f"OUTPUT_REPR={c.text!r}\n{v.report()}")
    assert not bad, "\n\n".join(bad)


def templated_len(tok, text):
    ids = tok.apply_chat_template(user(text), add_generation_prompt=True,
                                  tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)
