"""The mutation suite: realistic porting bugs, each applied to the product (the installed CPU
wheel's `vllm` package, as a patch would: one exact source edit, tests/e2e/mutations.toml), must
turn the DeepSeek V4 check red (tests/e2e/dsv4_check.py: `layers`, `positions`, `logprobs`,
`indexer`, `tokens`).

One engine start per mutation over the e2e check's two batch-1 prompts (300 and 250 tokens) with
prompt log-probs, MAX_TOKENS greedy steps and the per-layer hidden dump (tests/e2e/dsv4_mutations.py).
An engine run keeps one core busy, so two run at a time, each on its own copy of the product:
while a test judges its mutation's run, the next selected mutation's engine is already running.
The unmutated copy must pass the same check first: a broken harness cannot make every mutation
"caught". The families that fire must be the ones the data file records (and docs/mutations.md
shows, generated from it), so the table cannot drift from what the check does.
"""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.deepseek_v4",
                    reason="the oracle needs transformers >= 5.25 (make oracle)")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.e2e import dsv4_check as C  # noqa: E402
from tests.e2e import dsv4_mutations as M  # noqa: E402

MUTATIONS = M.load()
# issue 16 item 4: at least one caught mutation per component family
REQUIRED = ("E4M3 decode", "E4M3 encode", "UE8M0 scale", "MXFP4 nibble order", "MXFP4 scale",
            "W8A16 block indexing", "KV insert slot", "KV insert offset",
            "fp8_ds_mla reader block stride", "compressor position", "compressor ratio",
            "compressor overlap", "compressor state", "indexer q quantization", "indexer K scale",
            "indexer top-k", "indexer causality", "SWA window bounds", "sink", "RoPE (q)",
            "RoPE (k)", "RoPE (inverse)", "mHC Sinkhorn", "router bias", "hash routing",
            "SwiGLU clamp", "MoE routing weights",
            # s8's one-launch ops: the twins the CPU engine runs
            "RMSNorm twin", "router scores", "SwiGLU clamp (shared expert)", "prefill gather",
            "prefill combine")
MIN_CAUGHT = 15
_TIMES: dict[str, float] = {}


def test_the_docs_table_is_the_data_files():
    assert M.doc_table() == M.table(MUTATIONS), (
        "docs/mutations.md is out of date with tests/e2e/mutations.toml: "
        "python -m tests.e2e.dsv4_mutations docs")


def test_every_required_component_has_a_caught_mutation():
    caught = [m for m in MUTATIONS if m.caught_by]
    assert len(caught) >= MIN_CAUGHT, f"only {len(caught)} mutations are caught"
    missing = [c for c in REQUIRED if not any(m.component.startswith(c) for m in caught)]
    assert not missing, f"no caught mutation for {missing}"
    for m in MUTATIONS:
        assert m.caught_by or m.note, f"{m.id}: not caught and no note saying why"


ENGINES_AT_ONCE = 2  # engine runs in flight (one core each); each needs its own product copy


class EngineRuns:
    """The selected mutations' engine runs, ENGINES_AT_ONCE at a time in session order: asking
    for one run starts it and the next selected one (each on a free copy of the product) and waits
    for the first. A copy holds one mutation at a time (M.applied restores it after the run)."""

    def __init__(self, venv_bin: Path, roots: list[Path], tmp: Path, order: list[str]):
        self.venv_bin, self.tmp, self.order = venv_bin, tmp, order
        self.free: queue.Queue[Path] = queue.Queue()
        for r in roots:
            self.free.put(r)
        self.pool = ThreadPoolExecutor(max_workers=len(roots))
        self.runs: dict[str, Future] = {}

    def _run(self, m) -> dict:
        root = self.free.get()
        try:
            with M.applied(root, m):
                return M.run_engine(self.venv_bin, root, self.tmp / f"run-{m.id}", C.MODEL)
        finally:
            self.free.put(root)

    def _start(self, mid: str) -> None:
        if mid not in self.runs:
            self.runs[mid] = self.pool.submit(self._run, BY_ID[mid])

    def result(self, m) -> dict:
        self._start(m.id)
        if m.id in self.order:
            nxt = self.order.index(m.id) + 1
            for mid in self.order[nxt:nxt + ENGINES_AT_ONCE - 1]:
                self._start(mid)
        return self.runs.pop(m.id).result()

    def close(self) -> None:
        for f in self.runs.values():
            f.cancel()
        self.pool.shutdown(wait=True)


BY_ID = {m.id: m for m in MUTATIONS}


def _selected_order(session) -> list[str]:
    """Mutation ids of test_the_check_catches_the_mutation in the order this session runs them."""
    ids = []
    for item in session.items:
        cs = getattr(item, "callspec", None)
        if getattr(item, "originalname", None) == "test_the_check_catches_the_mutation" and cs:
            ids.append(cs.params["m"].id)
    return ids


@pytest.fixture(scope="module")
def harness(venv_bin, tmp_path_factory, request) -> dict:
    tmp = tmp_path_factory.mktemp("mutations")
    roots = [M.overlay(venv_bin, tmp / f"product-{i}") for i in range(ENGINES_AT_ONCE)]
    for root in roots:
        origin = subprocess.run(
            [str(venv_bin / "python"), "-c",
             "import importlib.util; print(importlib.util.find_spec('vllm').origin)"],
            env={"PYTHONPATH": str(root)}, check=True, capture_output=True, text=True).stdout.strip()
        assert Path(origin).is_relative_to(root), (
            f"the engine would import {origin}, not the copy in {root}")
    root = roots[0]
    cfg = json.loads((C.MODEL / "config.json").read_text())
    oracles = M.OracleCache(C.MODEL)
    t0 = time.time()
    base = M.run_engine(venv_bin, root, tmp / "run-baseline", C.MODEL)
    assert base["returncode"] == 0, f"baseline engine run failed:\n{base['log_tail']}"
    failed = M.judge(base, oracles, cfg)
    _TIMES["baseline"] = time.time() - t0
    print(f"\nbaseline: engine start {base['engine_start_s']:.1f} s, run {base['wall_s']:.1f} s, "
          f"with oracle {_TIMES['baseline']:.1f} s; check {failed or 'passes'}")
    runs = EngineRuns(venv_bin, roots, tmp, _selected_order(request.session))
    yield {"root": root, "tmp": tmp, "cfg": cfg, "oracles": oracles, "baseline_failed": failed,
           "venv_bin": venv_bin, "runs": runs}
    runs.close()


def test_the_unmutated_product_passes_the_check(harness):
    assert not harness["baseline_failed"], f"the unmutated copy fails the check: {harness['baseline_failed']}"


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.id for m in MUTATIONS])
def test_the_check_catches_the_mutation(harness, m):
    """`m` applied to the copy of the product; the check families that fire must be the recorded
    `caught_by` (non-empty unless the data file says why not)."""
    assert not harness["baseline_failed"], (
        f"the unmutated product fails the check ({harness['baseline_failed']}): the harness is "
        "broken, so no mutation can count as caught")
    t0 = time.time()
    r = harness["runs"].result(m)
    assert r["returncode"] == 0, f"{m.id}: the engine crashed (a mutation must be a wrong answer, not a crash):\n{r['log_tail']}"
    failed = M.judge(r, harness["oracles"], harness["cfg"])
    _TIMES[m.id] = time.time() - t0
    print(f"\n{m.id}: {_TIMES[m.id]:.1f} s (engine {r['wall_s']:.1f} s; suite so far "
          f"{sum(_TIMES.values()):.0f} s); caught by {sorted(failed)}")
    for check, msg in failed.items():
        print(f"  {msg[:300]}")
    assert set(m.caught_by) <= set(failed) <= set(m.caught_by) | set(m.may_also), (
        f"{m.id}: the check families that fire are {sorted(failed)}, tests/e2e/mutations.toml records "
        f"{sorted(m.caught_by)}" + (f" (and may_also {sorted(m.may_also)})" if m.may_also else "")
        + f" (update it and run python -m tests.e2e.dsv4_mutations docs): {failed}")

