# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The regression matrix of seed 15.1 on the real model. Every output goes
through the token-id verdict (no special token after the first, no long
identical runs, enough distinct ids, finite logprobs, exactly max_tokens)."""

import pytest

from dcu_kit import matrix
from helpers_cluster import assert_coherent, greedy, templated_len, user

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("max_tokens", [32, 128])
def test_single_request_chinese_chat(llm, max_tokens):
    """Seed 15.1 items 1-2 (J17 was 32 tokens only)."""
    outs = llm.chat([user(matrix.PROMPTS_8[0])], greedy(max_tokens), use_tqdm=False)
    assert_coherent(llm, outs, max_tokens, f"single {max_tokens}")


def test_two_turn_chat(llm):
    first = llm.chat([user("你好，请介绍一下你自己。")], greedy(48), use_tqdm=False)
    assert_coherent(llm, first, 48, "turn 1")
    conv = user("你好，请介绍一下你自己。") + [
        {"role": "assistant", "content": first[0].outputs[0].text},
        {"role": "user", "content": "请用三点总结你刚才说的内容。"}]
    assert_coherent(llm, llm.chat([conv], greedy(64), use_tqdm=False), 64,
                    "turn 2")


def test_eight_different_prompts(llm):
    outs = llm.chat([user(p) for p in matrix.PROMPTS_8], greedy(64),
                    use_tqdm=False)
    assert_coherent(llm, outs, 64, "8 prompts")
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 8


def test_two_concurrent_requests_match_solo(llm):
    solo = [llm.chat([user(p)], greedy(32), use_tqdm=False)[0]
            for p in matrix.PROMPTS_8[:2]]
    pair = llm.chat([user(p) for p in matrix.PROMPTS_8[:2]], greedy(32),
                    use_tqdm=False)
    assert_coherent(llm, pair, 32, "concurrent")
    for s, c in zip(solo, pair):
        # first token comes from prefill: batching must not change it
        assert s.outputs[0].token_ids[0] == c.outputs[0].token_ids[0]


def _boundary_cases(model_config, opts, kind):
    geo = matrix.geometry_from_config(model_config)
    lens = matrix.boundary_lengths(geo, opts["max_model_len"], 32)
    return [(k, n) for k, v in lens.items() if k.startswith(kind) for n in v]


@pytest.mark.parametrize("kind", ["kv_block", "swa_window", "compress_c"])
def test_prompt_lengths_at_boundaries(llm, model_config, cluster_opts, kind):
    """Seed 15.1 items 6-8: 64-token KV block, SWA window, C4/C128
    compressor boundaries (lengths are templated prompt tokens)."""
    tok = llm.get_tokenizer()
    cases = _boundary_cases(model_config, cluster_opts, kind)
    assert cases, f"no boundary lengths for {kind}"
    prompts, labels = [], []
    for name, n in cases:
        text, got = matrix.pad_prompt_to_length(lambda t: templated_len(tok, t), n)
        prompts.append(user(text))
        labels.append(f"{name} len={got}")
    for label, p in zip(labels, prompts):  # one at a time: no batch effects
        assert_coherent(llm, llm.chat([p], greedy(32), use_tqdm=False), 32, label)


def test_repeat_50_times_hunting_nan(llm, cluster_opts):
    """Seed 0.3 / 15.1 item 10: intermittent NaN/BOS shows up only sometimes."""
    n = cluster_opts["nan_repeats"]
    outs = [llm.chat([user(matrix.PROMPTS_8[i % 8])], greedy(32),
                     use_tqdm=False)[0] for i in range(n)]
    assert_coherent(llm, outs, 32, "repeat")


@pytest.mark.parametrize("batch", list(range(1, 17)))
def test_batch_sizes_1_to_16(llm, batch):
    """Seed 0.3: batch=8 produced BOS/NaN after a longer decode."""
    prompts = [user(matrix.PROMPTS_8[i % 8] + f"（第{i}个请求）")
               for i in range(batch)]
    outs = llm.chat(prompts, greedy(96), use_tqdm=False)
    assert_coherent(llm, outs, 96, f"batch={batch}")
