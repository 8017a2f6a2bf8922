# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Probe output and exit codes without vLLM: the generation report is fed a
RequestOutput-shaped object, and the stage machinery is driven to a failure
before vLLM would be imported."""

import io
import json
from types import SimpleNamespace

from dcu_kit import probe

BOS = 0


class _Tok:
    all_special_ids = [0, 1]
    bos_token_id = 0
    eos_token_id = 1
    pieces = {0: "<｜begin▁of▁sentence｜>", 32: ">", 30594: "你好"}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces.get(i, f"<{i}>") for i in ids)

    def __len__(self):
        return 129280


def _output(ids, text, finish="length", logprobs=None):
    return SimpleNamespace(outputs=[SimpleNamespace(
        token_ids=ids, text=text, finish_reason=finish, logprobs=logprobs)])


def test_report_prints_markers_and_judges_j08_degenerate():
    """Seed J08: TOKEN_IDS [32, 0, 0, ...] must print DEGENERATE, and
    TOKEN_DECODE must show the BOS pieces the text hides."""
    out = io.StringIO()
    v, res = probe.report_generation(_output([32] + [BOS] * 31, ">"), _Tok(),
                                     32, out=out)
    text = out.getvalue()
    lines = text.splitlines()
    assert lines[0] == "TOKEN_IDS: [32" + ", 0" * 31 + "]"
    assert "FINISH_REASON: length" in lines
    decode = [ln for ln in lines if ln.startswith("TOKEN_DECODE:")]
    assert len(decode) == 1 and "<｜begin▁of▁sentence｜>" in decode[0]
    [vin] = [ln for ln in lines if ln.startswith("VERDICT_INPUT:")]
    data = json.loads(vin.split(": ", 1)[1])
    assert data["special_ids"] == [0, 1] and data["eos_ids"] == [1]
    assert data["requested_max_tokens"] == 32
    assert "OUTPUT_REPR: '>'" in lines
    verdict_line = [ln for ln in lines if ln.startswith("DSV4_VERDICT:")]
    assert len(verdict_line) == 1 and "DEGENERATE" in verdict_line[0]
    assert not v.coherent and res["verdict"]["label"] == "DEGENERATE"


def test_report_coherent_for_distinct_ids():
    ids = list(range(1000, 1032))
    v, _ = probe.report_generation(_output(ids, "some text"), _Tok(), 32,
                                   out=io.StringIO())
    assert v.coherent


def test_printed_log_rejudges_to_the_same_verdict():
    """The job re-judges TOKEN_IDS from the raw log (never trusting the word):
    what the probe prints must be enough to reach the probe's own verdict."""
    from dcu_kit.verdict import rejudge_log

    for ids, text, want in [([32] + [BOS] * 31, ">", 3),
                            (list(range(1000, 1032)), "some text", 0)]:
        out = io.StringIO()
        v, _ = probe.report_generation(_output(ids, text), _Tok(), 32, out=out)
        code, _ = rejudge_log(out.getvalue())
        assert code == want and (code == 0) == v.coherent


def test_max_tokens_below_32_is_refused():
    assert probe.main(["--model", "/nonexistent", "--max-tokens", "2"]) == 2


def test_stage_failure_exits_1_and_names_the_stage(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = probe.main(["--model", str(tmp_path / "missing"), "--json-out",
                     str(out)])
    assert rc == 1
    text = capsys.readouterr().out
    assert "### STAGE: env" in text and "### STAGE: config" in text
    assert "PROBE_FAILED_STAGE: config" in text
    assert "### STAGE: engine init" not in text
    data = json.loads(out.read_text())
    assert data["failed_stage"] == "config" and data["rc"] == 1


def test_engine_kwargs_from_arguments():
    a = probe.build_parser().parse_args(
        ["--model", "/m", "--tp", "4", "--prefix-caching", "off",
         "--engine-arg", "max_num_seqs=16", "--moe-backend", "emulation"])
    kw = probe.engine_kwargs(a)
    assert kw["tensor_parallel_size"] == 4
    assert kw["enable_prefix_caching"] is False and kw["max_num_seqs"] == 16
    assert kw["moe_backend"] == "emulation"
    # issue #17: nothing the bare `vllm serve <model>` does not pass
    for key in ("kv_cache_dtype", "enforce_eager", "trust_remote_code", "max_model_len",
                "gpu_memory_utilization"):
        assert key not in kw, key
    a = probe.build_parser().parse_args(
        ["--model", "/m", "--kv-cache-dtype", "fp8", "--enforce-eager", "--max-model-len", "8192",
         "--no-trust-remote-code"])
    kw = probe.engine_kwargs(a)
    assert kw["kv_cache_dtype"] == "fp8" and kw["enforce_eager"] is True
    assert kw["max_model_len"] == 8192 and kw["trust_remote_code"] is False


def test_applied_patches_lists_the_installed_fork_series_in_order():
    """The probe's GFX936_PATCHES must be the installed wheel's series (make
    test installs it), in patches/series order; it used to accept either
    answer and could not fail."""
    import pathlib

    series = pathlib.Path(__file__).resolve().parents[2] / "patches" / "series"
    want = [ln.strip() for ln in series.read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    patches, source = probe.applied_patches()
    assert source == "vllm.gfx936.applied_patches"
    assert patches == want


def test_applied_patches_says_why_without_the_fork(monkeypatch):
    import importlib

    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "vllm.gfx936":
            raise ModuleNotFoundError("No module named 'vllm.gfx936'")
        return real(name, *a, **k)

    monkeypatch.setattr(probe.importlib, "import_module", fake)
    monkeypatch.setattr(probe.subprocess, "run", lambda *a, **k: (_ for _ in ()
                        ).throw(OSError("no python")))
    patches, source = probe.applied_patches()
    assert patches is None and "vllm.gfx936 not importable" in source


# ------------------------------------------------ what the seed checked by eye

def test_device_check_refuses_fewer_devices_than_tp_times_pp():
    assert "8 >= TP 8" in probe.device_check(8, 8, 1, None)
    import pytest
    with pytest.raises(probe.CheckFailed, match="torch sees 4 devices, TP 8"):
        probe.device_check(4, 8, 1, None)
    with pytest.raises(probe.CheckFailed, match="sees 0 devices"):
        probe.device_check(None, 4, 2, None)
    assert "ray places 16" in probe.device_check(8, 8, 2, "ray")


def test_engine_checks_need_fp8_ds_mla_and_the_expected_moe_backend():
    import pytest
    arch = ["DeepseekV4ForCausalLM"]
    good = [{"kv_cache_dtype": "fp8_ds_mla", "moe_backend": "emulation"}] * 8
    lines = probe.engine_checks(good, arch, "emulation")
    assert lines == ["kv_cache_dtype: fp8_ds_mla on 8 workers",
                     "moe_backend: emulation on 8 workers"]
    bad_kv = good[:3] + [{"kv_cache_dtype": "fp8_e5m2",
                          "moe_backend": "emulation"}]
    with pytest.raises(probe.CheckFailed, match="worker 3 uses 'fp8_e5m2'"):
        probe.engine_checks(bad_kv, arch, "emulation")
    bad_moe = [{"kv_cache_dtype": "fp8_ds_mla", "moe_backend": "aiter"}]
    with pytest.raises(probe.CheckFailed, match="resolved 'aiter'"):
        probe.engine_checks(bad_moe, arch, "emulation")
    assert probe.engine_checks(bad_moe, arch, "any")
    with pytest.raises(probe.CheckFailed, match="no worker"):
        probe.engine_checks([], arch, "any")


def test_worker_facts_read_the_resolved_config():
    w = SimpleNamespace(vllm_config=SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype="fp8_ds_mla"),
        kernel_config=SimpleNamespace(moe_backend="emulation")))
    assert probe.worker_facts(w) == {"kv_cache_dtype": "fp8_ds_mla",
                                     "moe_backend": "emulation"}


def test_probe_stops_at_the_device_check_before_engine_init(tmp_path, capsys):
    """On this CPU machine torch sees no device: the probe must stop in
    'device check' (seconds) instead of loading weights."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    rc = probe.main(["--model", str(model), "--tp", "8"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "PROBE_FAILED_STAGE: device check" in out
    assert "### STAGE: engine init" not in out
