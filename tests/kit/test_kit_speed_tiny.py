# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dcu_kit.speed (vllm bench serve result -> summary, A/B) and dcu_kit.tiny_smoke (the tiny
trained DeepSeek V4's greedy ids against its corpus), issue #17 items 5 and 6."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from dcu_kit import speed
from dcu_kit import tiny_smoke as T

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "models" / "dsv4-tiny-gpl3"


def _bench(**over) -> dict:
    r = {"duration": 10.0, "completed": 8, "failed": 0, "total_input_tokens": 8 * 64,
         "total_output_tokens": 8 * 16, "request_throughput": 0.8, "output_throughput": 12.8,
         "total_token_throughput": 64.0, "errors": [""] * 8}
    for m, base in (("ttft", 200.0), ("tpot", 20.0), ("itl", 21.0), ("e2el", 500.0)):
        r.update({f"mean_{m}_ms": base, f"median_{m}_ms": base, f"std_{m}_ms": 1.0,
                  f"p50_{m}_ms": base, f"p90_{m}_ms": base * 1.5, f"p99_{m}_ms": base * 2})
    r.update(over)
    return r


def test_summary_keeps_the_percentiles_and_throughputs_vllm_wrote():
    s = speed.summarize(_bench(), "kernels")
    assert s["ms"]["tpot"] == {"mean": 20.0, "median": 20.0, "p50": 20.0, "p90": 30.0, "p99": 40.0}
    assert (s["out_tok_s"], s["total_tok_s"], s["req_s"]) == (12.8, 64.0, 0.8)
    assert (s["mean_input_len"], s["mean_output_len"], s["num_prompts"]) == (64, 16, 8)
    line = speed.summary_line(s)
    assert line.startswith("SPEED_SUMMARY label=kernels prompts=8/8 in=64 out=16 ")
    assert "itl_ms_p99=42.0" in line and "ttft_ms_p90=300.0" in line


@pytest.mark.parametrize("over,why", [
    ({"failed": 1, "completed": 7, "errors": ["", "HTTP 500"]}, "1 failed request"),
    ({"completed": 0}, "no completed request"),
    ({"p50_tpot_ms": None, "median_tpot_ms": None, "mean_tpot_ms": None}, "no tpot"),
    ({"output_throughput": float("nan")}, "non-finite out_tok_s"),
])
def test_a_result_that_is_no_measurement_is_invalid(over, why):
    with pytest.raises(speed.InvalidResult, match=why):
        speed.summarize(_bench(**over))


def test_ab_ratios_say_how_much_faster_the_kernels_are():
    a = speed.summarize(_bench(), "kernels")
    b = speed.summarize(_bench(output_throughput=6.4, p50_tpot_ms=50.0), "kernels-off")
    r = speed.compare(a, b)
    assert r["out_tok_s_a_over_b"] == pytest.approx(2.0)
    assert r["tpot_ms_p50_b_over_a"] == pytest.approx(2.5)
    assert r["ttft_ms_p99_b_over_a"] == pytest.approx(1.0)
    assert "out_tok_s_a_over_b=2.000" in speed.ab_line(r)


def test_kernels_on_and_off_switches_are_registered_values_and_match_the_job():
    """The A/B job forces exactly dcu_kit.speed.KERNELS_ON / KERNELS_OFF, and each value is one of the
    choices the fork's vllm/envs.py registers (a typo would make vLLM reject it): read from the
    installed fork (`make install`), which is the series applied, whatever state vllm/ is in."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin, "the fork's vllm is not installed (make install)"
    envs = (Path(spec.origin).parent / "envs.py").read_text()
    assert speed.KERNELS_ON.keys() == speed.KERNELS_OFF.keys()
    for k, v in speed.KERNELS_OFF.items():
        m = re.search(rf'GFX936_SWITCH_CHOICES[^=]*= {{[^}}]*"{k}": \[([^\]]*)\]', envs)
        assert m, k
        assert f'"{v}"' in m.group(1) and f'"{T.FORCE_KERNELS[k]}"' in m.group(1), (k, m.group(1))
        # the first forced fast tier ("kernel", or "triton" for the fused ops) fails when it
        # cannot run ("auto" falls back)
        first = m.group(1).split(",")[1].strip().strip('"')
        assert speed.KERNELS_ON[k] == first and first in ("kernel", "triton"), (k, m.group(1))
    job = (REPO / "ci" / "slurm" / "dsv4_bench_serve.sbatch").read_text()
    for name, want in (("KERNELS_ON", speed.KERNELS_ON), ("KERNELS_OFF", speed.KERNELS_OFF)):
        got = dict(re.findall(r"(VLLM_GFX936_\w+)=(\w+)", job.split(f"{name}=(", 1)[1].split(")", 1)[0]))
        assert got == want, name


def test_tiny_cases_are_bos_plus_the_passage_and_its_continuation():
    c = T.load_corpus(TINY)
    paras = [int(x) for x in T.DEFAULT_PARAS.split(",")]
    todo = T.cases(c, paras, 200, 32)
    for p, prompt, want in todo:
        s = c["para_starts"][p]
        assert prompt[0] == T.BOS and prompt[1:] == c["stream"][s:s + 199]
        assert want == c["stream"][s + 199:s + 231]
        assert 1 not in want  # no passage end (EOS) inside the continuation
    with pytest.raises(ValueError, match="past the end of its passage"):
        T.cases(c, [12], 200, 32)  # paragraph 12 has fewer than 231 tokens left in its passage


def test_tiny_compare_names_the_first_differing_step():
    assert T.compare([1, 2, 3], [1, 2, 3]) is None
    assert T.compare([1, 2, 3], [1, 9, 3]) == 1
    assert T.compare([1, 2, 3], [1, 2]) == 2
    assert T.compare([1, 2, 3], [1, 2, 3, 4]) == 3


def test_tiny_smoke_on_the_cpu_wheel_matches_the_corpus_and_the_job_passes(venv_bin, tmp_path):
    """The job's logic end to end, on the CPU: dsv4_tiny_smoke.sbatch runs dcu_kit.tiny_smoke
    with the fork's CPU wheel (TINY_KERNELS=auto: there is no device for the kernels), the real
    engine decodes 16 prompts x 32 tokens greedily (decode steps of up to 16 tokens), and the
    job passes only because every id equals the corpus. Then the same raw log with one id changed fails the re-judge."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k != "TRITON_INTERPRET"}
    env.update(KIT_ROOT=str(REPO), LOG_DIR=str(tmp_path / "logs"), DTK_MODULES="",
               PYTHON=str(venv_bin / "python"), TINY_KERNELS="auto",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("MODEL_PATH", None)
    r = subprocess.run(["bash", str(REPO / "ci" / "slurm" / "dsv4_tiny_smoke.sbatch")], env=env,
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    raw_path = next((tmp_path / "logs").glob("dsv4-tiny-smoke-*.raw.log"))
    raw = raw_path.read_text()
    assert r.returncode == 0, r.stdout[-3000:] + raw[-6000:]
    assert "TINY_SMOKE_VERDICT: MATCH (16 prompts x 32 tokens" in raw
    assert "TINY_REJUDGE_RESULT: MATCH" in raw and "result=PASS" in r.stdout
    got = re.findall(r"^TINY_GOT p=(\d+) ids=(\[.*\])$", raw, re.M)
    assert len(got) == 16
    # broken on purpose: one generated id changed in the log -> the re-judge fails
    p, ids = got[1][0], json.loads(got[1][1])
    bad = raw.replace(f"TINY_GOT p={p} ids={got[1][1]}",
                      f"TINY_GOT p={p} ids={json.dumps(ids[:7] + [(ids[7] + 1) % 1024] + ids[8:])}")
    (tmp_path / "bad.log").write_text(bad)
    rc = T.main(["rejudge", str(tmp_path / "bad.log"), "--model", str(TINY)])
    assert rc == 2
