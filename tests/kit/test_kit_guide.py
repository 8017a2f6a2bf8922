# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The cluster guide (README + docs/validate-on-cluster.md) matches the code it names (issue #17).

An admin follows the guide literally; each drift found in issue #17 is a check here: a path or
module that does not exist, a tool flag the tool rejects, a build.sh option it does not take,
a job setting the jobs do not read (or read but the guide never names), the probe's stage list,
and seed run switches the jobs no longer export. The exit-code table has its own test
(test_kit_slurm.test_guide_exit_code_table_matches_the_code).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "validate-on-cluster.md"
README = REPO / "README.md"
DOCS = {p.name: p.read_text() for p in (GUIDE, README)}
JOB_FILES = sorted((REPO / "ci" / "slurm").glob("*.s*"))
# read by the jobs but not settings: shell plumbing, Slurm's own, test hooks
NOT_SETTINGS = {"JOB_ID", "NAME", "LD_LIBRARY_PATH", "PYTHONPATH", "SRUN", "WATCH_INTERVAL"}


def code_lines(text: str) -> list[str]:
    """Lines of ```bash blocks, with backslash continuations joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        out += block.replace("\\\n", " ").splitlines()
    return out


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_repo_path_the_guide_names_exists(doc):
    paths = set(re.findall(r"(?<![\w/.$<-])((?:ci|tools|docs|csrc_gfx936|tests|patches)/"
                           r"[\w./*-]*[\w*])", DOCS[doc]))
    assert paths
    missing = [p for p in sorted(paths) if not list(REPO.glob(p))]
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_python_module_the_guide_runs_exists(doc):
    mods = set(re.findall(r"python3? -m ((?:dcu_kit|tools)(?:\.\w+)+)", DOCS[doc]))
    assert mods
    for mod in mods:
        top, rest = mod.split(".", 1)
        base = REPO / ("ci/dcu_kit" if top == "dcu_kit" else "tools") / rest.replace(".", "/")
        assert base.with_suffix(".py").is_file() or (base / "__main__.py").is_file(), mod


def _help(tool: str, sub: str | None) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO / "ci"))
    args = [sys.executable, "-m", f"dcu_kit.{tool}"] + ([sub] if sub else []) + ["--help"]
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0, f"{' '.join(args[2:])}: {r.stderr[-500:]}"
    return r.stdout


def test_every_kit_tool_flag_in_the_guide_is_accepted():
    seen = 0
    for doc, text in DOCS.items():
        for line in code_lines(text):
            m = re.search(r"-m dcu_kit\.(\w+)((?:\s+\S+)*)", line)
            if not m:
                continue
            words = m.group(2).split()
            sub = words[0] if words and not words[0].startswith(("-", "$", "/", "<")) \
                and "." not in words[0] else None
            helptext = _help(m.group(1), sub)
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(2)):
                assert flag in helptext, f"{doc}: dcu_kit.{m.group(1)} {sub or ''} has no {flag}"
                seen += 1
    assert seen > 5


def test_every_build_sh_option_in_the_guide_exists():
    cases = set(re.findall(r"^\s*(--[\w-]+)(?:\|[-\w]+)*\)", (REPO / "build.sh").read_text(), re.M))
    for doc, text in DOCS.items():
        for flag in re.findall(r"\./build\.sh((?: --[\w-]+(?: [\w.]+)?)+)", text):
            for f in re.findall(r"--[\w-]+", flag):
                assert f in cases, f"{doc}: ./build.sh {f} is not an option of build.sh"


def job_settings() -> set[str]:
    names = set()
    for f in JOB_FILES:
        names |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)(?::-|-|:\+|\})", f.read_text()))
    return {n for n in names if not n.startswith("SLURM_")} - NOT_SETTINGS


def test_the_guide_names_every_setting_the_jobs_read():
    missing = sorted(n for n in job_settings()
                     if not re.search(rf"(?<![\w$]){n}(?![\w])", DOCS[GUIDE.name]))
    assert not missing, f"the jobs read settings the guide never names: {missing}"


def test_every_job_setting_the_guide_lists_is_read_by_the_jobs():
    section = DOCS[GUIDE.name].split("## 2. Slurm jobs", 1)[1].split("### Exit codes", 1)[0]
    listed = set(re.findall(r"^- `([A-Z][A-Z0-9_]+)", section, re.M))
    listed |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", section.split("| Variable |", 1)[1]
                             .split("\n\n", 1)[0]))
    assert listed
    assert not listed - job_settings(), listed - job_settings()


def test_guide_does_not_tell_users_to_export_seed_run_switches():
    for switch in ("VLLM_ROCM_USE_SKINNY_GEMM=0", "VLLM_WORKER_MULTIPROC_METHOD=spawn",
                   "HF_HUB_OFFLINE=1"):
        for doc, text in DOCS.items():
            assert not any(switch in ln for ln in code_lines(text)), (doc, switch)
    for f in JOB_FILES:
        assert not re.search(r"^\s*export (VLLM_ROCM_USE_SKINNY_GEMM|VLLM_WORKER_MULTIPROC_METHOD|"
                             r"HF_HUB_OFFLINE|TRANSFORMERS_OFFLINE)", f.read_text(), re.M), f


def test_the_serve_command_is_bare():
    for doc, text in DOCS.items():
        serve = [ln for ln in code_lines(text) if ln.strip().startswith("vllm serve")]
        assert serve, doc
        for ln in serve:
            assert "--kv-cache-dtype" not in ln and "--trust-remote-code" not in ln, (doc, ln)


def test_stage_list_is_the_probes_in_order():
    sys.path.insert(0, str(REPO / "ci"))
    from dcu_kit import probe

    want = [probe.STAGE_ENV, probe.STAGE_CONFIG, probe.STAGE_REGISTRY, probe.STAGE_DEVICES,
            probe.STAGE_ENGINE, probe.STAGE_CHECKS, probe.STAGE_GENERATE]
    src = (REPO / "ci" / "dcu_kit" / "probe.py").read_text()
    order = [m.group(1) for m in re.finditer(r"with stage\((STAGE_\w+)", src)]
    assert [getattr(probe, n) for n in order] == want
    listed = re.findall(r"^### STAGE: (.+?)(?:\s{2,}|$)", DOCS[GUIDE.name], re.M)
    assert [s.replace(" (the real test)", "") for s in listed] == want


def test_each_check_is_placed_in_the_stage_that_prints_it():
    """Regression (issue #17 review, item 14): the guide put `CHECK visible_devices` after
    engine init, in stage `engine checks`; the probe prints it in stage `device check`, before
    the model loads. Every `CHECK <name>` the guide names sits on the stage-list line, and in
    the prose sentence, of the stage the probe prints it in."""
    sys.path.insert(0, str(REPO / "ci"))
    from dcu_kit import probe

    by_stage = {
        probe.STAGE_DEVICES: [probe.device_check(8, 8, 1, None)],
        probe.STAGE_CHECKS: probe.engine_checks(
            [{"kv_cache_dtype": "fp8_ds_mla", "moe_backend": "m"}], ["DeepseekV4ForCausalLM"],
            "any"),
    }
    stage_of = {ln.split(":")[0]: st for st, lines in by_stage.items() for ln in lines}
    guide = DOCS[GUIDE.name]
    named = set(re.findall(r"CHECK[ \n]+(\w+)", guide))
    assert named == set(stage_of), (named, stage_of)
    stage_lines = dict(re.findall(r"^### STAGE: (.+?)(?:\s{2,}(.*))?$", guide, re.M))
    for name, st in stage_of.items():
        holders = [s for s, rest in stage_lines.items() if re.search(rf"CHECK {name}\b", rest)]
        assert holders == [st], (name, holders)
        for para in guide.split("\n\n"):
            for sent in re.split(r"(?<=[.)])\s+(?=[A-Z])", para):
                if re.search(rf"CHECK[ \n]+{name}\b", sent) and "stage" in sent:
                    other = [s for s in stage_lines if s != st and f"`{s}`" in sent]
                    assert f"`{st}`" in sent and not other, (name, sent)


def test_guide_log_paths_match_the_jobs():
    """Issue #17: README said logs/<job>.log; the jobs write logs/<name>-<id>.raw.log."""
    common = (REPO / "ci" / "slurm" / "common.sh").read_text()
    assert 'raw="$LOG_DIR/${name}-${JOB_ID}.raw.log"' in common
    bench = (REPO / "ci" / "slurm" / "dsv4_bench_serve.sbatch").read_text()
    written = {".raw.log", ".serve.log"}
    for suffix in (".bench.json", ".speed.json"):  # the speed job's files
        assert f'${{JOB_ID}}{suffix}' in bench or f'$run{suffix}' in bench, suffix
        written.add(suffix)
    # The SPEED_AB comparisons go through one helper that names its file <job>-<id>.OUT.json.
    assert '--json-out "$LOG_DIR/${NAME}-${JOB_ID}.$3.json"' in bench
    compared = set(re.findall(r"^\s*compare_runs \S+ \S+ (\w+)$", bench, re.M))
    assert {"ab", "mtp", "graph"} <= compared, compared
    written |= {f".{c}.json" for c in compared}
    for doc, text in DOCS.items():
        for p in re.findall(r"logs/[<\w$][^\s`]*", text):
            assert p.endswith(tuple(written)), (doc, p)


def test_every_pip_install_in_the_guide_keeps_the_site_constraints():
    """Regression (issue #17 review, item 17): the guide's `pip install ray` / `pip install
    pytest` were unconstrained (free to replace DTK's torch stack, and failing offline), and the
    README never said to install ray for the multi-node step. Every `pip install` the cluster
    path runs uses the constraints file tools/site_install.py writes, and both docs name ray."""
    sys.path.insert(0, str(REPO))
    from tools import site_install

    default = site_install.ROOT / "build" / "site-constraints.txt"
    rel = default.relative_to(site_install.ROOT).as_posix()
    for doc in (GUIDE.name, README.name):
        text = DOCS[doc].split("## On the cluster", 1)[-1] if doc == README.name else DOCS[doc]
        lines = [ln for ln in code_lines(text) if re.search(r"\bpip install\b", ln)]
        assert any("ray" in ln for ln in lines), doc
        for ln in lines:
            assert f"-c {rel}" in ln, (doc, ln)
    assert "--no-index --find-links wheelhouse" in DOCS[README.name]
