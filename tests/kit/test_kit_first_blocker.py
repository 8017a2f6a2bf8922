# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""First-blocker finder on synthetic logs shaped like the seed's (6.2, 6.4,
11.1-11.3). The logs are built here, line by line, with the prefixes vLLM
really prints (log-level/time/file prefix on every traceback line, process
prefixes from multiprocessing workers)."""

import json

from dcu_kit import first_blocker as fb


def _vllm(level, text, where="core.py:708", proc=None):
    """vLLM's NewLineFormatter repeats the prefix on every line."""
    pre = f"{level} 08-26 10:11:12 [{where}] "
    if proc:
        pre = f"({proc}) " + pre
    return [pre + ln for ln in text.splitlines()]


J01_WORKER_TB = """Traceback (most recent call last):
  File "/opt/vllm/vllm/v1/executor/multiproc_executor.py", line 640, in worker_main
    worker = WorkerProc(*args, **kwargs)
  File "/opt/triton/python/triton/compiler/compiler.py", line 300, in compile
    pm.run(mod)
RuntimeError: PassManager::run failed"""

J01_MAIN_TB = """Traceback (most recent call last):
  File "/opt/venv/bin/probe.py", line 10, in <module>
    llm = LLM(**kw)
  File "/opt/vllm/vllm/v1/engine/core_client.py", line 90, in make_client
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"""

USAGE_NOISE = """Exception in thread Thread-1 (_report_usage_worker):
Traceback (most recent call last):
  File "/usr/lib/python3.10/threading.py", line 1016, in _bootstrap_inner
    self.run()
  File "/opt/vllm/vllm/usage/usage_lib.py", line 170, in _report_usage_worker
    self._report_usage_once(model_architecture, usage_context, extra_kvs)
  File "/usr/lib/python3.10/json/decoder.py", line 355, in raw_decode
    raise JSONDecodeError("Expecting value", s, err.value) from None
json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)"""

LIBCUDART_NOISE = """Traceback (most recent call last):
  File "/opt/vllm/vllm/device_allocator/cumem.py", line 50, in <module>
    from vllm.cumem_allocator import init_module
AssertionError: libcudart is not loaded in the current process, try setting VLLM_CUDART_SO_PATH"""

J06_RUNTIME_TB = """Traceback (most recent call last):
  File "/opt/vllm/vllm/v1/engine/core.py", line 700, in run_engine_core
    engine_core.run_busy_loop()
  File "/opt/vllm/vllm/v1/worker/gpu_model_runner.py", line 2100, in execute_model
    torch.cuda.synchronize()
RuntimeError: HIP error: unspecified launch failure"""


def j01_log():
    lines = ["### STAGE: env", "### STAGE: engine init (the real test)",
             "INFO 08-26 10:00:00 [model.py:1] Resolved architecture: DeepseekV4ForCausalLM"]
    lines += _vllm("ERROR", J01_WORKER_TB, "multiproc_executor.py:660",
                   proc="Worker_TP3 pid=4242")
    lines += ["(Worker_TP0 pid=4239) INFO 08-26 10:00:01 [x.py:1] still loading"]
    lines += J01_MAIN_TB.splitlines()
    lines += LIBCUDART_NOISE.splitlines()
    lines += ["PY_EXIT=1"]
    return lines


def j06_log():
    lines = ["### STAGE: engine init (the real test)"]
    lines += USAGE_NOISE.splitlines()
    lines += ["Model loading took 19.99 GiB memory and 205.150379 seconds",
              "ENGINE_READY in 335.4s", "### STAGE: generate"]
    lines += ["(EngineCore_DP0 pid=777) /opt/vllm/csrc/rocm/skinny_gemms.hip:580: "
              "void wvSplitK_hf_sml_<__hip_bfloat16, 64, 2, 16, 8, 2, 1>(...): "
              "Device-side assertion `false' failed."]
    lines += ["(EngineCore_DP0 pid=777) Memory access fault by GPU node-4 (Agent "
              "handle: 0x55) on address 0x7f00. Reason: Page not present or "
              "supervisor privilege."]
    lines += _vllm("ERROR", J06_RUNTIME_TB, proc="EngineCore_DP0 pid=777")
    lines += LIBCUDART_NOISE.splitlines()
    lines += ["PY_EXIT=1"]
    return lines


def test_j01_first_blocker_is_passmanager_not_engine_core_init():
    """Seed 6.2: 'Engine core initialization failed' is the consequence; the
    worker's 'PassManager::run failed' (earlier, prefixed lines) is the cause."""
    lines = j01_log()
    rep = fb.analyze("\n".join(lines))
    assert rep.blocker is not None
    assert rep.blocker.kind == "traceback"
    assert rep.blocker.exception == "RuntimeError: PassManager::run failed"
    assert "Worker_TP3" in rep.blocker.stream
    assert lines[rep.blocker.start_line - 1].endswith("Traceback (most recent call last):")
    exc = [e.exception for e in rep.events]
    assert any(x.startswith("RuntimeError: Engine core initialization failed")
               for x in exc)
    noise = [e for e in rep.events if "libcudart" in e.exception]
    assert noise and noise[0].classification == "noise"


def test_j06_device_assertion_beats_usage_noise_before_and_libcudart_after():
    """Seed 6.4/11.1/11.2: the usage-report JSONDecodeError comes first in the
    log and libcudart after; the first blocker is the skinny_gemms.hip:580
    device assertion."""
    lines = j06_log()
    rep = fb.analyze("\n".join(lines))
    b = rep.blocker
    assert b is not None and b.kind == "device_assertion"
    assert "skinny_gemms.hip:580" in b.headline()
    usage = rep.events[0]
    assert usage.classification == "noise" and "usage_report" in usage.reason
    assert usage.start_line < b.start_line
    kinds = [(e.kind, e.classification) for e in rep.events]
    assert ("memory_fault", "main") in kinds
    last = rep.events[-1]
    assert "libcudart" in last.exception and last.classification == "noise"
    out = fb.format_report(rep, lines, context=2)
    assert out.startswith("FIRST_BLOCKER: device_assertion at line")
    assert "blocker is after ENGINE_READY" in out
    assert "ENGINE_READY: line" in out and "PY_EXIT: line" in out


def test_only_noise_means_no_main_path_blocker_and_exit_zero(tmp_path, capsys):
    log = tmp_path / "ok.log"
    log.write_text("\n".join(USAGE_NOISE.splitlines() + [
        "ENGINE_READY in 93.2s", "TOKEN_IDS: [1, 2]",
        "DSV4_VERDICT: COHERENT"] + LIBCUDART_NOISE.splitlines()))
    assert fb.main([str(log)]) == 0
    assert "FIRST_BLOCKER: none on the main path" in capsys.readouterr().out


def test_cli_exit_one_and_json_for_a_blocker(tmp_path, capsys):
    log = tmp_path / "j01.log"
    log.write_text("\n".join(j01_log()))
    assert fb.main([str(log), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["blocker"]["exception"] == "RuntimeError: PassManager::run failed"
    assert fb.main([str(tmp_path / "missing.log")]) == 2


def test_interleaved_ranks_are_parsed_per_process_prefix():
    a = _vllm("ERROR", J01_WORKER_TB, proc="Worker_TP0 pid=1")
    b = _vllm("ERROR", J06_RUNTIME_TB, proc="Worker_TP1 pid=2")
    mixed = [x for pair in zip(a, b) for x in pair]
    rep = fb.analyze("\n".join(mixed))
    assert {e.exception for e in rep.events} == {
        "RuntimeError: PassManager::run failed",
        "RuntimeError: HIP error: unspecified launch failure"}
    assert rep.blocker.stream == "(Worker_TP0 pid=1)"


def test_other_background_thread_is_reported_but_not_chosen():
    bg = ("Exception in thread Thread-7 (metrics):\n" + J06_RUNTIME_TB).splitlines()
    main = J01_MAIN_TB.splitlines()
    rep = fb.analyze("\n".join(bg + main))
    assert rep.events[0].classification == "background"
    assert rep.blocker.exception.startswith("RuntimeError: Engine core")


def test_chained_exceptions_stay_one_event():
    text = (J01_WORKER_TB + "\n\nThe above exception was the direct cause of "
            "the following exception:\n\n" + J01_MAIN_TB)
    rep = fb.analyze(text)
    assert len(rep.events) == 1
    assert rep.blocker.exception.startswith("RuntimeError: Engine core")
