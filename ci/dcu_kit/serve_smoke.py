# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Smoke test against a running OpenAI-compatible vLLM server (stdlib only).

Checks, each judged with ``dcu_kit.verdict``:
  1. ``GET /v1/models`` answers (the served model name is taken from it);
  2. ``POST /v1/chat/completions`` non-streaming, greedy, ``ignore_eos``,
     ``logprobs`` with ``return_tokens_as_token_ids`` (vLLM extensions) so the
     verdict reads token *ids* ("token_id:123") and logprobs, not only text;
  3. the same request with ``stream: true`` (SSE); the streamed text must be
     non-empty, consistent with the non-streamed answer (greedy) and, when
     the stream carries logprobs, pass the same id verdict.
Special ids: ``--special-ids 0,1`` or ``--tokenizer PATH`` (transformers);
without either only the text checks run, with ``skip_special_tokens=false``
so that a BOS still shows up as text.

CLI: ``python -m dcu_kit.serve_smoke --base-url http://HOST:8000
[--wait 1800]``; exit 0 all coherent, 2 a verdict failed, 3 server
unreachable/HTTP error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

from dcu_kit.probe import DEFAULT_PROMPT
from dcu_kit.verdict import (FAIL, RuleResult, Verdict, judge, judge_text_only,
                             filler_ids_from_tokenizer, verdict_input,
                             special_ids_from_tokenizer)

DEFAULT_SPECIAL_STRINGS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")


class ServerError(RuntimeError):
    pass


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# No proxy for the server on this node: a cluster's http_proxy would send
# 127.0.0.1 to the proxy host, which answers 403/502 or not at all.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _opener_for(url: str) -> Any:
    host = urllib.parse.urlsplit(url).hostname or ""
    return _DIRECT if host in LOOPBACK_HOSTS else urllib.request.build_opener()


@contextlib.contextmanager
def _open(url: str, payload: dict | None, timeout: float) -> Iterator[Any]:
    """``urlopen`` a GET (no payload) or JSON POST, never through a proxy for a
    loopback server; HTTP and connection errors become ``ServerError``."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    try:
        with _opener_for(url).open(req, timeout=timeout) as r:
            yield r
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")[:2000]
        raise ServerError(f"HTTP {e.code} from {url}: {body}") from e
    except (urllib.error.URLError, OSError) as e:
        raise ServerError(f"cannot reach {url}: {e}") from e


def get_json(url: str, payload: dict | None = None, timeout: float = 600.0
             ) -> dict:
    with _open(url, payload, timeout) as r:
        return json.loads(r.read().decode())


def stream_events(url: str, payload: dict, timeout: float = 600.0
                  ) -> Iterator[dict]:
    """Yield the JSON objects of an SSE stream until ``data: [DONE]``."""
    with _open(url, payload, timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs; a zombie (exited, not yet reaped by the
    job shell that started it in the background) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_ready(base_url: str, timeout: float, poll: float = 10.0,
               serve_pid: int | None = None) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return get_json(base_url.rstrip("/") + "/v1/models", timeout=30)
        except ServerError as e:
            if serve_pid is not None and not pid_alive(serve_pid):
                # Do not hold every node of the job until the timeout.
                raise ServerError(f"the server process {serve_pid} exited "
                                  f"before it was ready: {e}") from e
            if time.monotonic() >= deadline:
                raise ServerError(f"server not ready after {timeout:.0f}s: {e}"
                                  ) from e
            time.sleep(poll)


def chat_payload(model: str, prompt: str, max_tokens: int, stream: bool
                 ) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
        "logprobs": True,
        "top_logprobs": 1,
        # vLLM extensions (ignored by other servers):
        "ignore_eos": True,
        "skip_special_tokens": False,
        "return_tokens_as_token_ids": True,
    }


def parse_token_id(token: str) -> int | None:
    """vLLM writes ``token_id:123`` when return_tokens_as_token_ids is set."""
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token.split(":", 1)[1])
        except ValueError:
            return None
    return None


def ids_and_logprobs(content: Iterable[dict] | None
                     ) -> tuple[list[int] | None, list[float]]:
    ids: list[int] = []
    lps: list[float] = []
    for item in content or []:
        tid = parse_token_id(item.get("token", ""))
        if tid is None:
            return None, []
        ids.append(tid)
        lp = item.get("logprob")
        lps.append(float("nan") if lp is None else float(lp))
    return (ids if ids else None), lps


def judge_choice(text: str, content: list[dict] | None, finish_reason: str | None,
                 max_tokens: int, special_ids: set[int] | None,
                 special_strings: Iterable[str],
                 eos_ids: Iterable[int] = (),
                 filler_ids: Iterable[int] | None = None) -> Verdict:
    ids, lps = ids_and_logprobs(content)
    if ids is not None and special_ids is not None:
        return judge(ids, special_ids=special_ids, eos_ids=eos_ids, filler_ids=filler_ids,
                     requested_max_tokens=max_tokens,
                     logprobs=lps, finish_reason=finish_reason, text=text)
    v = judge_text_only(text, special_strings=special_strings)
    if special_ids is not None:
        # The caller knows the special ids, so a text-only pass would be the
        # false green of the port's J08 (BOS dropped from text): fail closed.
        v = dataclasses.replace(v, rules=v.rules + (RuleResult(
            "token_ids_returned", FAIL,
            "the server returned no token ids (logprobs with "
            "return_tokens_as_token_ids); the verdict cannot read token ids"),))
    return v


def run_smoke(base_url: str, model: str | None = None,
              prompt: str = DEFAULT_PROMPT, max_tokens: int = 32,
              special_ids: set[int] | None = None,
              eos_ids: Iterable[int] = (),
              special_strings: Iterable[str] = DEFAULT_SPECIAL_STRINGS,
              out=None, filler_ids: Iterable[int] | None = None) -> int:
    out = out or sys.stdout
    base = base_url.rstrip("/")
    models = get_json(base + "/v1/models", timeout=60)
    if model is None:
        model = models["data"][0]["id"]
    print(f"SERVE_MODEL: {model}", file=out)
    url = base + "/v1/chat/completions"
    rc = 0

    resp = get_json(url, chat_payload(model, prompt, max_tokens, False))
    ch = resp["choices"][0]
    text = ch["message"].get("content") or ""
    content = (ch.get("logprobs") or {}).get("content")
    v = judge_choice(text, content, ch.get("finish_reason"), max_tokens,
                     special_ids, special_strings, eos_ids, filler_ids)
    ids, _ = ids_and_logprobs(content)
    vin = dict(special_ids=special_ids or (), eos_ids=sorted(eos_ids),
               **({} if filler_ids is None else {"filler_ids": sorted(filler_ids)}),
               requested_max_tokens=max_tokens,
               finish_reason=ch.get("finish_reason"))
    print(f"CHAT_TOKEN_IDS: {ids}", file=out)
    print(f"CHAT_VERDICT_INPUT: {verdict_input(**vin)}", file=out)
    print(f"CHAT_FINISH_REASON: {ch.get('finish_reason')}", file=out)
    print(f"CHAT_OUTPUT_REPR: {text!r}", file=out)
    print("CHAT_" + v.report().replace("\n", "\nCHAT_"), file=out)
    if not v.coherent:
        rc = 2

    pieces: list[str] = []
    s_content: list[dict] = []
    finish = None
    for ev in stream_events(url, chat_payload(model, prompt, max_tokens, True)):
        for c in ev.get("choices", []):
            delta = c.get("delta") or {}
            if delta.get("content"):
                pieces.append(delta["content"])
            s_content.extend((c.get("logprobs") or {}).get("content") or [])
            finish = c.get("finish_reason") or finish
    s_text = "".join(pieces)
    sv = judge_choice(s_text, s_content or None, finish, max_tokens, special_ids,
                      special_strings, eos_ids, filler_ids)
    s_ids, _ = ids_and_logprobs(s_content or None)
    print(f"STREAM_TOKEN_IDS: {s_ids}", file=out)
    print(f"STREAM_VERDICT_INPUT: {verdict_input(**vin)}", file=out)
    print(f"STREAM_CHUNKS: {len(pieces)}", file=out)
    print(f"STREAM_OUTPUT_REPR: {s_text!r}", file=out)
    print("STREAM_" + sv.report().replace("\n", "\nSTREAM_"), file=out)
    if not sv.coherent:
        rc = 2
    same = s_text == text
    print(f"STREAM_MATCHES_CHAT: {same}", file=out)
    if not same:
        # Greedy on the same server: both paths must give the same answer.
        rc = 2
    print(f"SERVE_SMOKE_VERDICT: {'COHERENT' if rc == 0 else 'DEGENERATE'}",
          file=out, flush=True)
    return rc


def _special_and_eos_ids(a: argparse.Namespace
                         ) -> tuple[set[int] | None, set[int], set[int] | None]:
    """(special ids, EOS ids, BOS/PAD ids) from --special-ids/--eos-ids or the tokenizer
    (no tokenizer: BOS/PAD None, i.e. every special id that is not EOS)."""
    eos = {int(x) for x in (a.eos_ids or "").split(",") if x.strip()}
    if a.special_ids:
        return {int(x) for x in a.special_ids.split(",") if x.strip()}, eos, None
    if a.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.tokenizer, trust_remote_code=True)
        e = getattr(tok, "eos_token_id", None)
        eos |= {e} if isinstance(e, int) else set(e or ())
        return special_ids_from_tokenizer(tok), eos, filler_ids_from_tokenizer(tok)
    return None, eos, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcu_kit.serve_smoke")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--special-ids", default=None, help="e.g. 0,1")
    p.add_argument("--eos-ids", default=None,
                   help="e.g. 1: an answer may end there (ignore_eos runs on)")
    p.add_argument("--tokenizer", default=None, help="path for special ids")
    p.add_argument("--wait", type=float, default=0,
                   help="seconds to wait for /v1/models first")
    p.add_argument("--serve-pid", type=int, default=None,
                   help="stop waiting as soon as this server process exits")
    a = p.parse_args(argv)
    try:
        if a.wait:
            wait_ready(a.base_url, a.wait, serve_pid=a.serve_pid)
        special, eos, fillers = _special_and_eos_ids(a)
        return run_smoke(a.base_url, a.model, a.prompt, a.max_tokens,
                         special, eos_ids=eos, filler_ids=fillers)
    except ServerError as e:
        print(f"SERVE_SMOKE_ERROR: {e}", flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
