"""The port's field-report regression list, through `vllm serve` (the fork's console script, CPU
wheel) on the trained tiny DeepSeek V4 (models/dsv4-tiny-gpl3: FP8/MXFP4 on disk, fp8_ds_mla KV
cache, gfx936's no-FP8 path), with the OpenAI client.

The independent reference is the corpus the model memorized (corpus.json): a completion of a raw
passage (prompt = BOS + corpus ids from a paragraph start, as it was trained) must be the corpus
continuation exactly (teacher-forced top-1/top-2 gap: median 15.8 nats, so no rounding difference
can excuse a single id). Chat answers have no reference: they must be finite, free of special ids
except a final EOS, and the same ids across repeats, batch sizes and servers. Every completion is
read as token ids (`return_tokens_as_token_ids` + log-probs), all of them, not the text.

Two servers, started once each (~30-60 s on 2 cores):
  * A, the default: prefix caching on, chunked prefill on at the default token budget (larger than
    any prompt here, so each prefill is whole), max-num-seqs 8;
  * B: prefix caching off and chunked prefill on with a 30-token budget. Upstream's CPU platform
    forces chunked prefill off for every MLA model (vllm/platforms/cpu.py); the fork keeps it for
    DeepSeek V4, whose CPU path is gfx936's (patch dsv4-no-fp8-cpu-runs-gfx936-model), and B's
    /metrics show every engine step within the budget.
Each server is checked against the corpus on its own, so a failure names its cause: A's repeated
prompts hit the prefix cache (cached_tokens > 0, checked) and must still give the corpus; B's
prefills are chunked at 30 tokens (C4 groups and C128 windows straddle chunks) and must too.
"""
from __future__ import annotations

import json
import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.stack import demo  # noqa: E402

openai = pytest.importorskip("openai", reason="openai comes with vLLM's deps (`make install`)")

MODEL = REPO / "models" / "dsv4-tiny-gpl3"
CORPUS = json.loads((MODEL / "corpus.json").read_text())
STREAM: list[int] = CORPUS["stream"]
TRAIN_LEN = 511  # training rows: BOS + 511 corpus tokens from a paragraph start (tools/dsv4_train.py)
BOS, EOS = 0, 1
SPECIAL = frozenset(t["id"] for t in json.loads((MODEL / "tokenizer.json").read_text())["added_tokens"]
                    if t["special"])
VOCAB = json.loads((MODEL / "config.json").read_text())["vocab_size"]
NAME = demo.DSV4_MODEL_NAME
BLOCK, WINDOW = 256, 128      # KV block (--block-size), sliding window; C4 / C128 compressors
CHUNK = 30                    # B's token budget: not a multiple of 4 or 128
SERVE_ARGS = ("--kv-cache-dtype", "fp8", "--block-size", str(BLOCK), "--max-model-len", "1024",
              "--max-num-seqs", "8", "--enforce-eager", "--enable-prompt-tokens-details")
READY_TIMEOUT_S = 600
CHAT = [{"role": "user", "content": "What does this License say about conveying copies?"}]

# ---- the corpus reference -----------------------------------------------------------------------

def _starts(need: int) -> list[int]:
    """Paragraph starts s whose window stream[s:s+need] lies inside one passage before its EOS
    and inside the trained row length."""
    spans = CORPUS["doc_spans"]
    assert need <= TRAIN_LEN
    return [s for s in CORPUS["para_starts"]
            if any(a <= s and s + need <= b - 1 for a, b in spans)]


def _passage(start: int, prompt_len: int, n: int) -> tuple[list[int], list[int]]:
    """(prompt ids = BOS + prompt_len - 1 corpus ids, the corpus's next n ids)."""
    body = prompt_len - 1
    return [BOS] + STREAM[start:start + body], STREAM[start + body:start + body + n]


def _spread(need: int, k: int, skip: int = 0) -> list[int]:
    """k distinct starts spread over the corpus (offset by `skip` so tests differ)."""
    cands = _starts(need)
    assert len(cands) >= k + skip, (need, k, len(cands))
    step = len(cands) // (k + skip)
    return [cands[(i + skip) * step] for i in range(k)]


# ---- one completion, read as ids ----------------------------------------------------------------

@dataclass
class Out:
    ids: list[int]
    logprobs: list[float]
    finish: str
    cached: int  # prompt tokens served from the prefix cache
    text: str = ""

    def __repr__(self) -> str:
        return f"Out(finish={self.finish}, cached={self.cached}, ids={self.ids})"


def _id(tok: str) -> int:
    m = re.fullmatch(r"token_id:(\d+)", tok)
    assert m, f"not a token-id token: {tok!r}"
    return int(m.group(1))


def _cached(usage) -> int:
    d = usage.prompt_tokens_details
    return (d.cached_tokens or 0) if d is not None else 0


def complete(client, prompt: list[int], n: int, *, ignore_eos: bool = True, **kw) -> Out:
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, logprobs=1,
                                  temperature=kw.pop("temperature", 0.0),
                                  extra_body={"ignore_eos": ignore_eos,
                                              "return_tokens_as_token_ids": True, **kw})
    c = r.choices[0]
    assert r.usage.prompt_tokens == len(prompt)
    return Out([_id(t) for t in c.logprobs.tokens], list(c.logprobs.token_logprobs),
               c.finish_reason, _cached(r.usage))


def chat(client, messages: list[dict], n: int, **kw) -> Out:
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=n, logprobs=True,
                                       temperature=kw.pop("temperature", 0.0),
                                       seed=kw.pop("seed", None),
                                       top_p=kw.pop("top_p", None),
                                       extra_body={"return_tokens_as_token_ids": True, **kw})
    c = r.choices[0]
    return Out([_id(t.token) for t in c.logprobs.content], [t.logprob for t in c.logprobs.content],
               c.finish_reason, _cached(r.usage), c.message.content)


def assert_clean(o: Out, n: int, label: str) -> None:
    """Every id in the vocabulary and no special id (a final EOS only when the request stopped
    there), every log-prob finite, and the length the finish reason says."""
    assert len(o.ids) == len(o.logprobs), (label, o)
    bad = [(k, lp) for k, lp in enumerate(o.logprobs) if lp is None or not math.isfinite(lp)]
    assert not bad, f"{label}: non-finite log-probs at {bad}: {o}"
    assert all(0 <= t < VOCAB for t in o.ids), (label, o)
    body = o.ids[:-1] if o.finish == "stop" and o.ids[-1:] == [EOS] else o.ids
    special = [(k, t) for k, t in enumerate(body) if t in SPECIAL]
    assert not special, f"{label}: special ids at {special}: {o}"
    if o.finish == "length":
        assert len(o.ids) == n, (label, o)
    else:
        assert o.finish == "stop" and o.ids[-1:] == [EOS], (label, o)


def assert_corpus(o: Out, want: list[int], label: str) -> None:
    assert_clean(o, len(want), label)
    k = next((k for k, (a, b) in enumerate(zip(o.ids, want)) if a != b), None)
    assert o.ids == want, (f"{label}: first difference at generated token {k}: "
                           f"got {o.ids} want {want}")


def concurrently(fn, jobs: list[tuple]) -> list:
    with ThreadPoolExecutor(len(jobs)) as ex:
        return list(ex.map(lambda a: fn(*a), jobs))


# ---- servers --------------------------------------------------------------------------------------

def _start(venv_bin, log: Path, args: tuple, env: dict) -> demo.Server:
    # TRITON_INTERPRET (set by tests/runtime/conftest.py in the same session) is not for it.
    srv = demo.Server(venv_bin / "vllm", MODEL, log=log, served_name=NAME, extra_args=args,
                      env={"TRITON_INTERPRET": None, "VLLM_CPU_KVCACHE_SPACE": "1", **env})
    srv.start()
    try:
        srv.wait_ready(READY_TIMEOUT_S)
    except BaseException:
        srv.stop()
        raise
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="EMPTY", timeout=300)
    return srv


def _engine_config(srv) -> str:
    """The engine core's "Initializing a V1 LLM engine ... with config: ..." line."""
    lines = [ln for ln in srv.log.read_text(errors="replace").splitlines()
             if "Initializing a V1 LLM engine" in ln]
    assert len(lines) == 1, demo.log_tail(srv.log)
    return lines[0]


@pytest.fixture(scope="module")
def server_a(venv_bin, tmp_path_factory):
    srv = _start(venv_bin, tmp_path_factory.mktemp("serve-a") / "serve.log",
                 SERVE_ARGS + ("--enable-prefix-caching",), {})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server_b(venv_bin, tmp_path_factory):
    srv = _start(venv_bin, tmp_path_factory.mktemp("serve-b") / "serve.log",
                 SERVE_ARGS + ("--no-enable-prefix-caching", "--enable-chunked-prefill",
                               "--max-num-batched-tokens", str(CHUNK)),
                 {"VLLM_SERVER_DEV_MODE": "1"})
    try:
        yield srv
    finally:
        srv.stop()


def scheduler_config(srv) -> dict:
    """The scheduler config the server runs with, after every platform hook (the API server's
    /server_info, on with VLLM_SERVER_DEV_MODE=1)."""
    import urllib.request

    url = srv.url + "/server_info?config_format=json"
    info = json.loads(urllib.request.urlopen(url, timeout=60).read().decode())
    return info["vllm_config"]["scheduler_config"]


# ---- the shared request set: run on A and on B, compared with the corpus and with each other ----

# prompt lengths (BOS included) and generated tokens: prefills that end just before, at and after
# the SWA window / first C128 group (128), the KV block / second C128 group (256), the third C128
# group (384), at every C4 phase; decodes that cross 128, 256 and 384
BOUNDARY_LENS = (125, 128, 129, 254, 256, 257, 381, 386)
BOUNDARY_N = 8
PREFIX_LEN, PREFIX_N = 300, 16     # > one KV block: its first 256 tokens can come from the cache


def boundary_prompts() -> list[tuple[list[int], list[int]]]:
    starts = _spread(max(BOUNDARY_LENS) + BOUNDARY_N, len(BOUNDARY_LENS))
    return [_passage(s, L, BOUNDARY_N) for s, L in zip(starts, BOUNDARY_LENS)]


def prefix_prompts() -> list[tuple[list[int], list[int]]]:
    """A 300-token passage, the same again (served from the prefix cache where it is on), and a
    281-token prefix of it (cache hit on the shared block, a different tail)."""
    # a start no boundary prompt uses, so that the first request finds nothing in the cache
    s = next(s for s in reversed(_starts(PREFIX_LEN + PREFIX_N))
             if s not in _spread(max(BOUNDARY_LENS) + BOUNDARY_N, len(BOUNDARY_LENS)))
    p = _passage(s, PREFIX_LEN, PREFIX_N)
    return [p, p, _passage(s, PREFIX_LEN - 19, PREFIX_N)]


def two_turns(client) -> tuple[Out, Out]:
    first = chat(client, CHAT, 16)
    turn2 = CHAT + [{"role": "assistant", "content": first.text},
                    {"role": "user", "content": "And about the source code?"}]
    return first, chat(client, turn2, 16)


def shared_set(srv) -> dict:
    c = srv.client
    out = {"boundary": [complete(c, p, BOUNDARY_N) for p, _ in boundary_prompts()],
           "prefix": [complete(c, p, PREFIX_N) for p, _ in prefix_prompts()],
           "chat32": chat(c, CHAT, 32)}
    out["turn1"], out["turn2"] = two_turns(c)
    return out


@pytest.fixture(scope="module")
def runs_a(server_a) -> dict:
    return shared_set(server_a)


@pytest.fixture(scope="module")
def runs_b(server_b, runs_a) -> dict:
    return shared_set(server_b)


# ---- server A: the default -------------------------------------------------------------------------

def test_prompts_across_block_swa_c4_c128_boundaries_continue_the_corpus(runs_a):
    """Prefills ending around 128 (window, C128), 256 (KV block, C128) and 384, at every C4 phase,
    and decodes crossing them: each completion is the corpus continuation, id for id."""
    for (p, want), o in zip(boundary_prompts(), runs_a["boundary"]):
        assert_corpus(o, want, f"prompt of {len(p)} tokens")


def test_chat_32_tokens_is_clean(runs_a):
    """A 32-token greedy chat: every id in the vocabulary, no special id but a final EOS, finite
    log-probs (the port's failure was BOS/NaN after the first token)."""
    o = runs_a["chat32"]
    assert_clean(o, 32, "chat")
    assert len(o.ids) >= 8, o  # an answer, not an immediate EOS


def test_two_turn_conversation_is_clean_and_its_first_turn_repeats(server_a, runs_a):
    o1, o2 = runs_a["turn1"], runs_a["turn2"]
    assert_clean(o1, 16, "turn 1")
    assert_clean(o2, 16, "turn 2")
    # the first turn is the first 16 ids of the 32-token answer (greedy, same prompt)
    assert o1.ids == runs_a["chat32"].ids[:len(o1.ids)], (o1, runs_a["chat32"])


def test_128_tokens_continue_the_corpus(server_a):
    """128 greedy tokens from a 200-token passage prefix: decode crosses 256 (block, C128) and
    32 C4 groups; every id is the corpus's."""
    s = _spread(200 + 128, 1, skip=3)[0]
    p, want = _passage(s, 200, 128)
    assert_corpus(complete(server_a.client, p, 128), want, "128 tokens")


def test_eight_different_prompts_at_batch_8_continue_the_corpus(server_a, runs_a):
    """The eight boundary prompts sent at once (mixed prefill lengths in one batch): each is the
    corpus continuation, as at batch 1."""
    outs = concurrently(lambda p: complete(server_a.client, p, BOUNDARY_N),
                        [(p,) for p, _ in boundary_prompts()])
    for (p, want), o in zip(boundary_prompts(), outs):
        assert_corpus(o, want, f"batch 8, prompt of {len(p)} tokens")


def test_two_concurrent_requests_give_their_batch_1_ids(server_a, runs_a):
    """A chat and a raw passage in flight together: the chat gives its batch-1 ids, the passage
    the corpus."""
    s = _spread(64 + 32, 1, skip=5)[0]
    p, want = _passage(s, 64, 32)
    o_chat, o_pass = concurrently(lambda f: f(), [(lambda: chat(server_a.client, CHAT, 32),),
                                                  (lambda: complete(server_a.client, p, 32),)])
    assert_clean(o_chat, 32, "concurrent chat")
    assert o_chat.ids == runs_a["chat32"].ids, (o_chat, runs_a["chat32"])
    assert_corpus(o_pass, want, "concurrent passage")


def test_prefix_cache_hits_give_the_corpus(runs_a):
    """A: the first 300-token prompt is computed cold, its repeat and its 281-token prefix take
    their first KV block (256 tokens) from the cache; all three are the corpus continuation."""
    outs = runs_a["prefix"]
    assert [o.cached for o in outs] == [0, BLOCK, BLOCK], outs
    for (p, want), o in zip(prefix_prompts(), outs):
        assert_corpus(o, want, f"prefix caching on, {len(p)}-token prompt, cached {o.cached}")


def test_learned_passage_stops_at_its_eos(server_a):
    """A passage the model learned ends in EOS: without ignore_eos the request stops there
    (finish_reason stop) and its ids are the corpus up to and including that EOS."""
    a, b = min((sp for sp in CORPUS["doc_spans"] if sp[0] in CORPUS["para_starts"]),
               key=lambda sp: sp[1] - sp[0])
    assert STREAM[b - 1] == EOS and b - a <= 64, (a, b)
    prompt = [BOS] + STREAM[a:a + 3]
    o = complete(server_a.client, prompt, 64, ignore_eos=False)
    assert o.finish == "stop", o
    assert_corpus(o, STREAM[a + 3:b], "passage ending in EOS")


def test_seeded_sampling_repeats_with_the_same_seed(server_a):
    """temperature 0.8, top-p 0.9: the same seed gives the same ids; another seed other ids (the
    sampler did sample); all clean."""
    kw = dict(temperature=0.8, top_p=0.9)
    one, again, other = (chat(server_a.client, CHAT, 32, seed=s, **kw) for s in (1234, 1234, 4321))
    for o in (one, again, other):
        assert_clean(o, 32, "seeded sampling")
    assert one.ids == again.ids, (one, again)
    assert one.ids != other.ids, (one, other)


def test_50_repeats_at_batch_8_keep_the_corpus_ids(server_a):
    """The port's batch>=8 NaN/BOS failure: eight different passages kept in flight together, 50
    times each (400 requests); every request's ids are the corpus continuation, all finite, no
    special id; the first bad request is named."""
    n, rounds = 6, 50
    jobs = [_passage(s, 24, n) for s in _spread(24 + n, 8, skip=2)]

    def worker(k):
        p, want = jobs[k]
        for r in range(rounds):
            assert_corpus(complete(server_a.client, p, n), want, f"passage {k}, repeat {r}")
        return rounds

    assert concurrently(worker, [(k,) for k in range(8)]) == [rounds] * 8


def test_a_runs_prefix_caching_on_and_keeps_chunked_prefill(server_a):
    """What A's engine core ran with (its config line): prefix caching on, and chunked prefill on
    as vLLM defaults it (upstream's CPU platform turns it off for MLA models; the fork keeps it for
    DeepSeek V4, whose CPU path is gfx936's)."""
    cfg = _engine_config(server_a)
    assert "enable_prefix_caching=True" in cfg and "enable_chunked_prefill=True" in cfg, cfg


# ---- server B: prefix caching off, chunked prefill on with a small budget ---------------------------

def test_b_runs_caching_off_and_chunks_prefills_within_its_budget(server_b, runs_b):
    """B runs prefix caching off and chunked prefill on at the 30-token budget it was given
    (upstream's CPU platform would have turned chunking off and raised the budget to the model
    length; the fork keeps both for DeepSeek V4), and it served 386-token prompts, which under a
    30-token budget per step only chunked prefill can."""
    cfg = _engine_config(server_b)
    assert "enable_prefix_caching=False" in cfg and "enable_chunked_prefill=True" in cfg, cfg
    sc = scheduler_config(server_b)
    assert sc["enable_chunked_prefill"] is True and sc["max_num_batched_tokens"] == CHUNK, sc
    assert max(len(p) for p, _ in boundary_prompts()) > CHUNK
    assert all(len(o.ids) == BOUNDARY_N for o in runs_b["boundary"]), runs_b["boundary"]


def test_chunked_prefill_gives_the_corpus_at_every_boundary(runs_b):
    for (p, want), o in zip(boundary_prompts(), runs_b["boundary"]):
        assert_corpus(o, want, f"chunked prefill ({CHUNK}), prompt of {len(p)} tokens")


def test_prefix_caching_off_gives_the_same_ids_as_on(runs_a, runs_b):
    """B never serves from a cache (cached 0) and gives the corpus, as A did from its cache."""
    outs = runs_b["prefix"]
    assert [o.cached for o in outs] == [0, 0, 0], outs
    for (p, want), a, b in zip(prefix_prompts(), runs_a["prefix"], outs):
        assert_corpus(b, want, f"prefix caching off, {len(p)}-token prompt")
        assert b.ids == a.ids


def test_chats_are_the_same_ids_with_caching_off_and_chunked_prefill(runs_a, runs_b):
    """No reference for chat answers, so A and B must agree on every id (32-token chat and both
    turns of the conversation; the second turn's prompt is longer than the chunk budget)."""
    for key in ("chat32", "turn1", "turn2"):
        assert_clean(runs_b[key], 32 if key == "chat32" else 16, f"B {key}")
        assert runs_b[key].ids == runs_a[key].ids, (key, runs_a[key], runs_b[key])
