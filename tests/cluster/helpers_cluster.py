# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared helpers for the cluster matrix (imported by the tests)."""

import importlib.machinery
import os
import sys

from dcu_kit.verdict import judge, special_ids_from_tokenizer


def installed_vllm(search_path=None, repo_root=None):
    """(True, where) when ``import vllm`` would load a real, installed vLLM
    package; else (False, why).

    From the checkout, the ``vllm/`` submodule folder has no ``__init__.py``
    and imports as an empty namespace package: ``import vllm`` succeeds and
    proves nothing. A regular package (with ``__init__.py``) that is not the
    checkout's source tree is required.
    """
    spec = importlib.machinery.PathFinder.find_spec(
        "vllm", list(sys.path if search_path is None else search_path))
    if spec is None:
        return False, "no vllm package on sys.path (install the fork's wheel)"
    if spec.origin in (None, "namespace") or not str(spec.origin).endswith(
            "__init__.py"):
        where = ", ".join(spec.submodule_search_locations or [])
        return False, (f"'vllm' resolves to a folder without __init__.py "
                       f"({where}), e.g. the checkout's vllm/ submodule; "
                       "install the fork's wheel")
    origin = os.path.realpath(spec.origin)
    if repo_root is not None:
        src = os.path.realpath(os.path.join(repo_root, "vllm")) + os.sep
        if origin.startswith(src):
            return False, (f"vllm would be imported from the checkout's "
                           f"source tree ({origin}), not an installed wheel")
    return True, os.path.dirname(origin)


GRAPH_MODES = ("eager", "full_decode")


def graph_mode_engine(mode):
    """(LLM kwargs, environment) for the matrix's engine in graph ``mode``.

    ``eager`` is gfx936's default and what the out-of-tree port ran
    (``enforce_eager=True``). ``full_decode`` must not pass
    ``enforce_eager``: it always wins over VLLM_GFX936_GRAPH_MODE, and the
    matrix would then check eager mode while claiming graphs."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"--graph-mode {mode!r}: use one of {', '.join(GRAPH_MODES)}")
    if mode == "eager":
        return {"enforce_eager": True}, {}
    return {"enforce_eager": False}, {"VLLM_GFX936_GRAPH_MODE": "full_decode"}


def graph_mode_error(mode, cudagraph_mode_name):
    """Why the engine does not run in ``mode`` (None when it does), from the
    cudagraph mode its config ended with (vLLM may lower it on its own)."""
    want = "NONE" if mode == "eager" else "FULL_DECODE_ONLY"
    if cudagraph_mode_name != want:
        return (f"--graph-mode {mode}: the engine runs cudagraph_mode="
                f"{cudagraph_mode_name}, not {want}; this run would not check "
                f"{mode} (see the engine log for why)")
    return None


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
    eos = getattr(tok, "eos_token_id", None)
    # A short correct answer that ends at EOS is judged as an answer; what
    # ignore_eos forces after it is not (dcu_kit.verdict, rule "answer").
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    bad = []
    for i, o in enumerate(outputs):
        c = o.outputs[0]
        v = judge(c.token_ids, special_ids=specials, eos_ids=eos_ids,
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
