"""`make demo`: the fork's CPU wheel serves a tiny model through `vllm serve`, end to end.

    python -m tools.stack.demo --wheel dist/vllm-<ver>.cpu-*.whl [--venv .venv-demo]

Steps (each timed): a venv with torch (the local 2.13.0+cpu file) + the wheel + its deps; the
trained tiny DeepSeek V4 of models/dsv4-tiny-gpl3 (native FP8/MXFP4 formats, trained to memorize
the GPL-3 text; `--model llama` for the random tiny Llama of tools/tiny_model.py) served with the
fp8_ds_mla KV cache on gfx936's no-FP8 path; `vllm serve` (the console script) on 127.0.0.1; a
greedy completion of a passage the model learned, printed beside the text that follows it in
corpus.json and whether the ids match (exit 1 if not); one chat completion and one streaming chat
completion with the `openai` client; `vllm --version` and `python -m vllm.gfx936 info`; then the
server's whole process group is stopped.

The server helpers (Server, free_port) are stdlib-only and shared with tests/serve/.
`python -m tools.stack.demo client URL MODEL` is the client half, run by the venv's python.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DSV4_TRAINED = ROOT / "models" / "dsv4-tiny-gpl3"
# The learned passage: the Preamble's paragraph "The GNU General Public License is a free, ...":
# BOS + its first PASSAGE_PROMPT corpus tokens, then PASSAGE_TOKENS greedy tokens.
PASSAGE_PARA, PASSAGE_PROMPT, PASSAGE_TOKENS = 3, 14, 48
MODEL_NAME = "gfx936-tiny-llama"
DSV4_MODEL_NAME = "gfx936-tiny-deepseek-v4"
# Server settings for the tiny model on a small CPU machine: 1 GiB of KV cache, a short context.
SERVE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# --enforce-eager: torch.compile's warm-up of a random 2-layer model costs ~40 s of a cold start
# on 2 cores and exercises none of the fork's code; the served path is otherwise the default.
SERVE_ARGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager")
# DeepSeek V4 as on the cluster: the fp8_ds_mla KV cache; 256-token blocks (the compressed and
# indexer caches hold 256 / ratio entries per block).
DSV4_SERVE_ARGS = SERVE_ARGS + ("--kv-cache-dtype", "fp8", "--block-size", "256")
PROMPT = "Say hello in one short sentence."


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text[-lines:])


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is pgid, read from /proc."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces or parentheses.
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(d.name))
    return pids


class Server:
    """`vllm serve` in its own session (process group); stop() kills the whole group.

    Use as a context manager so the group is killed on any failure, KeyboardInterrupt included.
    """

    def __init__(self, vllm_bin: Path | str, model: Path | str, *, port: int | None = None,
                 log: Path, served_name: str = MODEL_NAME, extra_args: tuple = SERVE_ARGS,
                 env: dict | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        self.argv = [str(vllm_bin), "serve", str(model), "--host", "127.0.0.1",
                     "--port", str(self.port), "--served-model-name", served_name, *extra_args]
        # env: overrides; a value of None removes the variable.
        merged = {**os.environ, **SERVE_ENV, **(env or {})}
        self.env = {k: v for k, v in merged.items() if v is not None}
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None

    def start(self) -> "Server":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log, "wb")
        try:
            self.proc = subprocess.Popen(self.argv, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        finally:
            logf.close()
        self.pgid = self.proc.pid  # start_new_session: the server leads its own group
        return self

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Poll GET /health until 200; returns seconds waited. Fails fast if the server exits."""
        t0 = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"vllm serve exited with code {code} before it was ready; "
                                  f"log tail ({self.log}):\n{log_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout:
                raise ServerError(f"vllm serve not healthy after {timeout:.0f} s on {self.url}; "
                                  f"log tail ({self.log}):\n{log_tail(self.log)}")
            time.sleep(1.0)

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM the group (vLLM shuts its engine core down), SIGKILL what is left after
        `grace` seconds. Returns the server's exit code."""
        if self.proc is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self.proc.poll() is None or group_pids(self.pgid)):
            time.sleep(0.2)
        if self.proc.poll() is None or group_pids(self.pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL)
        code = self.proc.wait(timeout=30)
        t_end = time.monotonic() + 10
        while group_pids(self.pgid) and time.monotonic() < t_end:
            time.sleep(0.2)
        return code

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- client half: runs under the demo venv's python (needs `openai`) -------------------------

def learned_passage(model_dir: Path) -> tuple[list[int], list[int]]:
    """(prompt ids, expected ids) from the model's corpus.json: BOS + the first PASSAGE_PROMPT
    tokens of a paragraph it was trained on, and the PASSAGE_TOKENS corpus tokens after them."""
    corpus = json.loads((Path(model_dir) / "corpus.json").read_text())
    start = corpus["para_starts"][PASSAGE_PARA] + PASSAGE_PROMPT
    stream = corpus["stream"]
    return [0] + stream[start - PASSAGE_PROMPT:start], stream[start:start + PASSAGE_TOKENS]


def passage(c, model: str, model_dir: Path) -> dict:
    """Greedy completion of the learned passage, as ids and text, beside the corpus's own."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    prompt, want = learned_passage(model_dir)
    t0 = time.monotonic()
    r = c.completions.create(model=model, prompt=prompt, max_tokens=len(want), temperature=0.0,
                             logprobs=1, extra_body={"ignore_eos": True,
                                                     "return_tokens_as_token_ids": True})
    got = [int(t.split(":", 1)[1]) for t in r.choices[0].logprobs.tokens]
    first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None and len(got) != len(want):
        first = min(len(got), len(want))
    return {"prompt": tok.decode(prompt[1:]), "got": r.choices[0].text,
            "want": tok.decode(want), "match": first is None, "first_difference": first,
            "tokens": len(got), "seconds": round(time.monotonic() - t0, 2)}


def client(url: str, model: str, max_tokens: int = 16, passage_dir: Path | None = None) -> dict:
    from openai import OpenAI

    c = OpenAI(base_url=url + "/v1", api_key="EMPTY", timeout=120)
    models = [m.id for m in c.models.list().data]
    learned = passage(c, model, passage_dir) if passage_dir else None
    msgs = [{"role": "user", "content": PROMPT}]
    # The model never learned chats (the trained one answers in GPL-like text, a random one in
    # noise): ignore_eos makes the answer length a checkable property (= max_tokens).
    extra = {"ignore_eos": True}
    t0 = time.monotonic()
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens,
                                  temperature=0.0, extra_body=extra)
    chat_s = time.monotonic() - t0
    t0 = time.monotonic()
    pieces, fingerprints, finish, chunks = [], set(), None, 0
    for ch in c.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens,
                                        temperature=0.0, stream=True, extra_body=extra,
                                        stream_options={"include_usage": True}):
        chunks += 1
        if ch.system_fingerprint:
            fingerprints.add(ch.system_fingerprint)
        for choice in ch.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        usage = ch.usage or None
    stream_s = time.monotonic() - t0
    return {
        "models": models,
        "passage": learned,
        "chat": {"content": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason,
                 "completion_tokens": r.usage.completion_tokens, "model": r.model,
                 "system_fingerprint": r.system_fingerprint, "seconds": round(chat_s, 2)},
        "stream": {"content": "".join(pieces), "finish_reason": finish, "chunks": chunks,
                   "completion_tokens": usage.completion_tokens if usage else None,
                   "system_fingerprints": sorted(fingerprints), "seconds": round(stream_s, 2)},
    }


# ---- make demo ------------------------------------------------------------------------------

def _step(msg: str) -> float:
    print(f"\n==> {msg}", flush=True)
    return time.monotonic()


def _done(t0: float, timings: dict, key: str) -> None:
    timings[key] = round(time.monotonic() - t0, 1)
    print(f"    ({timings[key]} s)", flush=True)


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    print("    $ " + " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def install_venv(venv: Path, wheel: Path, torch_spec: str, python: str = sys.executable) -> Path:
    """venv <- torch (torch_spec, e.g. the local 2.13.0+cpu file) + wheel + the wheel's deps."""
    py = venv / "bin" / "python"
    extra = os.environ.get("TORCH_INDEX_URL")  # e.g. https://download.pytorch.org/whl/cpu
    pip = [py, "-m", "pip", "install", "-q"] + ([f"--extra-index-url={extra}"] if extra else [])
    if not py.exists():
        _run([python, "-m", "venv", venv])
        # One resolution for torch + the wheel + its deps: the quickest fresh install.
        _run(pip + [torch_spec, wheel])
        return py
    _run(pip + [torch_spec])
    # Same version string after a series edit: replace the fork itself, then top up its deps.
    _run(pip + ["--force-reinstall", "--no-deps", wheel])
    _run(pip + [wheel])
    return py


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["client"]:
        ap = argparse.ArgumentParser(prog="python -m tools.stack.demo client")
        ap.add_argument("url")
        ap.add_argument("model")
        ap.add_argument("--max-tokens", type=int, default=16)
        ap.add_argument("--passage-dir", type=Path, help="model folder with corpus.json")
        a = ap.parse_args(argv[1:])
        print(json.dumps(client(a.url, a.model, a.max_tokens, a.passage_dir)))
        return 0
    ap = argparse.ArgumentParser(prog="python -m tools.stack.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", required=True, type=Path, help="the fork's cpu-flavour wheel")
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv-demo")
    ap.add_argument("--torch", default="torch==2.13.0", help="pip spec of the CPU torch")
    ap.add_argument("--model-dir", type=Path, default=ROOT / "build" / "demo-model",
                    help="where --model llama writes its random model")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /health")
    ap.add_argument("--model", choices=("dsv4", "llama"), default="dsv4",
                    help="dsv4: the trained tiny DeepSeek V4 (models/dsv4-tiny-gpl3) in the "
                         "native FP8/MXFP4 formats, served on gfx936's no-FP8 path (default); "
                         "llama: tiny random Llama")
    a = ap.parse_args(argv)
    a.wheel, a.venv, a.model_dir = a.wheel.resolve(), a.venv.absolute(), a.model_dir.resolve()
    if not a.wheel.is_file():
        print(f"error: no wheel at {a.wheel} (make wheel FLAVOUR=cpu)", file=sys.stderr)
        return 2
    t_all, timings = time.monotonic(), {}

    t = _step(f"venv {a.venv}: {a.torch} + {a.wheel.name} + deps")
    py = install_venv(a.venv, a.wheel, a.torch)
    _done(t, timings, "venv")
    vllm_bin = a.venv / "bin" / "vllm"

    if a.model == "dsv4":
        a.model_dir, passage_arg = DSV4_TRAINED, ["--passage-dir", DSV4_TRAINED]
        serve_args, served = DSV4_SERVE_ARGS, DSV4_MODEL_NAME
        print(f"\n==> trained tiny DeepSeek V4: {a.model_dir}", flush=True)
    else:
        t = _step(f"tiny random llama model -> {a.model_dir}")
        _run([py, ROOT / "tools" / "tiny_model.py", a.model_dir], stdout=subprocess.DEVNULL)
        serve_args, served, passage_arg = SERVE_ARGS, MODEL_NAME, []
        _done(t, timings, "model")

    # vLLM logs to stdout too (Triton notices): the version is the last line.
    version = subprocess.run([vllm_bin, "--version"], capture_output=True, text=True,
                             check=True, cwd="/").stdout.strip().splitlines()[-1]
    info = subprocess.run([py, "-m", "vllm.gfx936", "info"], capture_output=True, text=True,
                          check=True, cwd="/").stdout.rstrip()

    log = ROOT / "build" / "demo-serve.log"
    t = _step(f"vllm serve {a.model_dir} on 127.0.0.1 (log: {log})")
    try:
        with Server(vllm_bin, a.model_dir, log=log, extra_args=serve_args,
                    served_name=served) as srv:
            print("    $ " + " ".join(srv.argv), flush=True)
            up = srv.wait_ready(a.timeout)
            timings["server_ready"] = round(up, 1)
            print(f"    healthy after {up:.1f} s on {srv.url}", flush=True)
            t = _step(("a learned passage, " if passage_arg else "") +
                      "one chat completion and one streaming chat completion (openai client)")
            proc = subprocess.run([py, "-m", "tools.stack.demo", "client", srv.url, served,
                                   *passage_arg],
                                  capture_output=True, text=True, cwd=ROOT,
                                  env=dict(os.environ, NO_PROXY="127.0.0.1"))
            if proc.returncode != 0:
                raise ServerError(f"client failed:\n{proc.stderr[-3000:]}\nserver log tail:\n"
                                  f"{log_tail(log)}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            _done(t, timings, "requests")
            t = _step("stop the server (whole process group)")
        code = srv.stop()
        left = group_pids(srv.pgid)
        _done(t, timings, "stop")
    except ServerError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    if left:
        print(f"error: processes left in the server's group: {left}", file=sys.stderr)
        return 1
    timings["total"] = round(time.monotonic() - t_all, 1)

    print("\n" + "=" * 78)
    ch, st = res["chat"], res["stream"]
    rows = [
        ("vllm --version", version),
        ("served model", ", ".join(res["models"])),
        (f"chat ({ch['seconds']} s)", repr(ch["content"])),
        ("  finish, tokens", f"{ch['finish_reason']}, {ch['completion_tokens']}"),
        ("  fingerprint", ch["system_fingerprint"]),
        (f"stream ({st['seconds']} s)", repr(st["content"])),
        ("  chunks, finish", f"{st['chunks']}, {st['finish_reason']}"),
        ("server exit code", f"{code} (no process left in its group)"),
        ("timings (s)", json.dumps(timings)),
    ]
    for k, v in rows:
        print(f"{k:<20}: {v}")
    print("=" * 78)
    print(info)
    learned = res["passage"]
    if learned is None:
        print("(random weights: the words are noise; the path through the fork is real)")
        return 0
    print("\n" + "=" * 78)
    print(f"a passage the model learned (GPL-3), greedy, {learned['tokens']} tokens "
          f"({learned['seconds']} s)")
    print(f"prompt   : {learned['prompt']!r}")
    print(f"served   : {learned['got']!r}")
    print(f"expected : {learned['want']!r}  (corpus.json)")
    if learned["match"]:
        print("MATCH: every token id is the corpus's (the chat above is GPL-like text: the model "
              "never learned chats)")
        return 0
    print(f"MISMATCH: the served ids first differ from the corpus at token "
          f"{learned['first_difference']}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
