# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Serve smoke test against an in-process fake OpenAI server (stdlib HTTP):
token ids come back as ``token_id:N`` (vLLM's return_tokens_as_token_ids),
for the plain and the streaming chat completion."""

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dcu_kit import serve_smoke as ss

GOOD = [(1000 + i, f"w{i} ") for i in range(32)]
BAD = [(32, ">")] + [(0, "<｜begin▁of▁sentence｜>")] * 31  # seed J08


def _server(tokens, stream_tokens=None):
    stream_tokens = stream_tokens or tokens

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._json({"data": [{"id": "dsv4"}]})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert req["ignore_eos"] and req["return_tokens_as_token_ids"]
            assert req["temperature"] == 0.0
            lp = lambda t: {"token": f"token_id:{t[0]}", "logprob": -0.5}  # noqa
            if not req["stream"]:
                self._json({"choices": [{
                    "message": {"content": "".join(p for _, p in tokens)},
                    "finish_reason": "length",
                    "logprobs": {"content": [lp(t) for t in tokens]}}]})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i, t in enumerate(stream_tokens):
                fin = "length" if i == len(stream_tokens) - 1 else None
                ev = {"choices": [{"delta": {"content": t[1]},
                                   "logprobs": {"content": [lp(t)]},
                                   "finish_reason": fin}]}
                self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_loopback_server_is_reached_past_a_site_http_proxy(monkeypatch):
    """Regression (issue #17 review, item 12): with a cluster's http_proxy set and no
    no_proxy, urllib sent http://127.0.0.1 to the proxy host; the smoke test must talk to the
    server on this node directly."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # a proxy that does not answer
    for k in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(k, f"http://127.0.0.1:{dead}")
    for k in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(k, raising=False)
    srv = _server(GOOD)
    try:
        out = io.StringIO()
        assert ss.run_smoke(f"http://127.0.0.1:{srv.server_port}", special_ids={0, 1},
                            out=out) == 0, out.getvalue()
        assert ss.run_smoke(f"http://localhost:{srv.server_port}", special_ids={0, 1},
                            out=io.StringIO()) == 0
    finally:
        srv.shutdown()


@pytest.mark.parametrize("tokens,rc", [(GOOD, 0), (BAD, 2)])
def test_chat_and_stream_verdict_reads_token_ids(tokens, rc):
    srv = _server(tokens)
    try:
        out = io.StringIO()
        got = ss.run_smoke(f"http://127.0.0.1:{srv.server_port}",
                           special_ids={0, 1}, out=out)
        text = out.getvalue()
        assert got == rc, text
        assert f"CHAT_TOKEN_IDS: {[t for t, _ in tokens]}" in text
        assert "STREAM_MATCHES_CHAT: True" in text
        want = "COHERENT" if rc == 0 else "DEGENERATE"
        assert f"SERVE_SMOKE_VERDICT: {want}" in text
    finally:
        srv.shutdown()


def test_stream_that_differs_from_chat_fails():
    srv = _server(GOOD, stream_tokens=GOOD[:16] + GOOD[17:] + [(5555, "z")])
    try:
        out = io.StringIO()
        assert ss.run_smoke(f"http://127.0.0.1:{srv.server_port}",
                            special_ids={0, 1}, out=out) == 2
        assert "STREAM_MATCHES_CHAT: False" in out.getvalue()
    finally:
        srv.shutdown()


def test_unreachable_server_exits_3(capsys):
    assert ss.main(["--base-url", "http://127.0.0.1:9"]) == 3
    assert "SERVE_SMOKE_ERROR" in capsys.readouterr().out


def test_parse_token_id():
    assert ss.parse_token_id("token_id:42") == 42
    assert ss.parse_token_id("hello") is None


def test_known_special_ids_without_token_ids_from_the_server_fail_closed(monkeypatch):
    """A server that returns text but no token ids (no logprobs) must not pass on text alone when
    the special ids are known: BOS can vanish from text (the port's J08 false green)."""
    srv = _server(GOOD)
    monkeypatch.setattr(ss, "ids_and_logprobs", lambda content: (None, []))
    try:
        out = io.StringIO()
        got = ss.run_smoke(f"http://127.0.0.1:{srv.server_port}", special_ids={0, 1}, out=out)
        text = out.getvalue()
        assert got == 2 and "token_ids_returned" in text, text
        assert "SERVE_SMOKE_VERDICT: DEGENERATE" in text
        out = io.StringIO()  # without known special ids the text-only check stays the basis
        assert ss.run_smoke(f"http://127.0.0.1:{srv.server_port}", out=out) == 0, out.getvalue()
    finally:
        srv.shutdown()


def test_wait_stops_as_soon_as_the_server_process_exits():
    """A server that dies during start-up must not hold the job's nodes until --wait runs out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    time.sleep(0.5)  # exited, not reaped yet: a zombie, as under the job shell
    assert not ss.pid_alive(proc.pid)
    t0 = time.monotonic()
    with pytest.raises(ss.ServerError, match=f"server process {proc.pid} exited"):
        ss.wait_ready(f"http://127.0.0.1:{port}", timeout=600, poll=0.1, serve_pid=proc.pid)
    assert time.monotonic() - t0 < 30
    proc.wait()
    assert ss.pid_alive(os.getpid())


def test_short_answer_ending_at_eos_passes_and_rejudges_the_same():
    """'391' then EOS, then what ignore_eos forces (EOS again): with the EOS id
    known the answer is judged, and the printed ids re-judge identically."""
    from dcu_kit.verdict import rejudge_log

    answer = [(1959, "3"), (17585, "9"), (42108, "1"), (303, "。")]
    tail = [(1, "")] * 28
    srv = _server(answer + tail)
    try:
        url = f"http://127.0.0.1:{srv.server_port}"
        out = io.StringIO()
        assert ss.run_smoke(url, special_ids={0, 1}, eos_ids={1}, out=out) == 0, \
            out.getvalue()
        assert rejudge_log(out.getvalue())[0] == 0
        out = io.StringIO()  # EOS not known: the continuation is judged
        assert ss.run_smoke(url, special_ids={0, 1}, out=out) == 2
        assert rejudge_log(out.getvalue())[0] == 3
    finally:
        srv.shutdown()


def test_bos_after_the_answers_eos_fails_and_rejudges_the_same():
    """Regression (issue #17 review, item 6): EOS then BOS filler is the seed's decode failure
    with an EOS in it, not a finished answer; the server's ids and the log's re-judge agree."""
    from dcu_kit.verdict import rejudge_log

    answer = [(1959, "3"), (17585, "9"), (42108, "1"), (303, "。")]
    srv = _server(answer + [(1, ""), (0, ""), (1, "")] * 9 + [(1, "")])
    try:
        url = f"http://127.0.0.1:{srv.server_port}"
        out = io.StringIO()
        assert ss.run_smoke(url, special_ids={0, 1}, eos_ids={1}, filler_ids={0},
                            out=out) == 2, out.getvalue()
        assert "after_eos" in out.getvalue()
        assert rejudge_log(out.getvalue())[0] == 3
    finally:
        srv.shutdown()
