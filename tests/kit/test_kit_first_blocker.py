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


# ---------------------------------------------------------------------------
# Failing runs never end with "none" (issue #11), and the errors vLLM 0.27.1,
# DTK/LLVM, RCCL, Ray and Slurm really print.

def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


def _grep_n(path, pattern):
    """Line numbers as `grep -n` reports them (the independent reference)."""
    import subprocess
    r = subprocess.run(["grep", "-n", "-a", "-F", pattern, str(path)],
                       capture_output=True, text=True, errors="replace")
    return [int(x.split(":", 1)[0]) for x in r.stdout.splitlines()]


def test_empty_log_is_a_blocker_not_none(tmp_path, capsys):
    log = _write(tmp_path, "empty.log", "")
    assert fb.main([str(log)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FIRST_BLOCKER: empty_log")
    assert fb.main([str(_write(tmp_path, "blank.log", "\n\n  \n"))]) == 1


def test_log_cut_off_mid_stage_names_the_stage(tmp_path, capsys):
    """Time limit / SIGKILL during weight loading: no traceback, no PY_EXIT."""
    lines = ["### STAGE: env", "### STAGE: config",
             "### STAGE: vllm import + registry",
             "### STAGE: engine init (the real test)",
             "(Worker_TP0 pid=11) INFO 08-26 10:00:00 [default_loader.py:1] "
             "Loading weights took 190.2 seconds",
             "Loading safetensors checkpoint shards:  52% Completed | 25/48"]
    log = _write(tmp_path, "cut.log", "\n".join(lines) + "\n")
    assert fb.main([str(log)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FIRST_BLOCKER: truncated")
    assert "'engine init (the real test)'" in out
    assert "LAST_STAGE: engine init (the real test)" in out


def test_nonzero_py_exit_without_traceback_is_reported(tmp_path, capsys):
    lines = ["### STAGE: engine init (the real test)", "ENGINE_READY in 93.2s",
             "### STAGE: generate", "PY_EXIT=137"]
    log = _write(tmp_path, "killed.log", "\n".join(lines) + "\n")
    assert fb.main([str(log)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FIRST_BLOCKER: nonzero_exit at line 4")
    assert "PY_EXIT=137 in stage 'generate'" in out


def test_rc_option_turns_a_quiet_serve_log_into_a_blocker(tmp_path, capsys):
    log = _write(tmp_path, "serve.log",
                 "INFO 08-26 10:00:00 [api_server.py:1] vLLM API server\n")
    assert fb.main([str(log)]) == 0
    capsys.readouterr()
    assert fb.main([str(log), "--rc", "5"]) == 1
    assert "--rc=5" in capsys.readouterr().out


def test_degenerate_verdict_is_named_when_nothing_raised():
    text = "\n".join(["### STAGE: generate", "TOKEN_IDS: [32, 0, 0]",
                      "DSV4_VERDICT: DEGENERATE (no_special_tokens)",
                      "PROBE_EXIT=2", "PY_EXIT=2"])
    rep = fb.analyze(text)
    assert rep.blocker.kind == "verdict" and rep.blocker.start_line == 3
    assert "DEGENERATE (no_special_tokens)" in rep.blocker.headline()


# vLLM 0.27.1 raises a bare Exception in vllm/v1/engine/utils.py
# (get_device_indices) when the visible devices do not cover the TP ranks.
BARE_EXCEPTION_TB = """Traceback (most recent call last):
  File "/opt/vllm/vllm/v1/engine/core.py", line 1100, in run_engine_core
    engine_core = EngineCoreProc(*args, **kwargs)
  File "/opt/vllm/vllm/v1/engine/utils.py", line 345, in get_device_indices
    raise Exception(
Exception: Error computing device indices for CUDA_VISIBLE_DEVICES: local range: [0, 8) base value: "0,1,2,3\""""


def test_bare_exception_line_ends_the_traceback_and_is_the_blocker():
    lines = ["### STAGE: engine init (the real test)"]
    lines += _vllm("ERROR", BARE_EXCEPTION_TB, "core.py:1110",
                   proc="EngineCore_DP0 pid=900")
    lines += J01_MAIN_TB.splitlines() + ["PY_EXIT=1"]
    rep = fb.analyze("\n".join(lines))
    assert rep.blocker.exception.startswith(
        "Exception: Error computing device indices for CUDA_VISIBLE_DEVICES")
    assert rep.blocker.end_line == 7
    second = [e for e in rep.events if e is not rep.blocker and
              e.kind == "traceback"]
    assert second[0].classification == "secondary"


def test_llvm_abort_beats_the_python_errors_it_causes_even_when_printed_later():
    """A worker dies in the DAS Triton backend; the engine's Python error
    about the dead worker reaches the log first (buffering)."""
    lines = ["### STAGE: generate"]
    lines += _vllm("ERROR", "Worker proc VllmWorker-3 died unexpectedly "
                   "(exit code: -6), shutting down executor.",
                   "multiproc_executor.py:296", proc="EngineCore_DP0 pid=5")
    lines += _vllm("ERROR", J06_RUNTIME_TB.replace(
        "RuntimeError: HIP error: unspecified launch failure",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an "
        "issue. See stack trace (above) for the root cause."),
        "core.py:720", proc="EngineCore_DP0 pid=5")
    lines += ["(Worker_TP3 pid=9) LLVM ERROR: Cannot select: intrinsic "
              "%llvm.amdgcn.cvt.scalef32.pk.f32.fp8",
              "PY_EXIT=1"]
    rep = fb.analyze("\n".join(lines))
    assert rep.blocker.kind == "llvm_error", fb.format_report(rep, lines)
    assert "Cannot select" in rep.blocker.headline()
    assert rep.blocker.stream == "(Worker_TP3 pid=9)"


def test_rccl_watchdog_timeout_and_terminate_are_native_blockers():
    lines = [
        "### STAGE: generate",
        "[rank3]:[E826 10:11:12.000000000 ProcessGroupNCCL.cpp:616] [Rank 3] "
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
        "OpType=ALLREDUCE, NumelIn=7168, NumelOut=7168, Timeout(ms)=600000) "
        "ran for 600040 milliseconds before timing out.",
        "terminate called after throwing an instance of 'c10::DistBackendError'",
        "  what():  [PG ID 2 PG GUID 3 Rank 3] Process group watchdog thread "
        "terminated with exception",
    ]
    lines += J01_MAIN_TB.replace("RuntimeError: Engine core initialization "
                                 "failed. See root cause above. Failed core "
                                 "proc(s): {}", "EOFError").splitlines()
    rep = fb.analyze("\n".join(lines))
    assert rep.blocker.kind == "collective_timeout" and rep.blocker.start_line == 2
    kinds = [e.kind for e in rep.events]
    assert "cxx_terminate" in kinds


def test_ray_worker_prefixes_and_raylet_lines_are_streams():
    worker_tb = """Traceback (most recent call last):
  File "/opt/vllm/vllm/v1/worker/worker_base.py", line 620, in execute_method
    return run_method(self, method, args, kwargs)
  File "/opt/vllm/vllm/model_executor/layers/fused_moe/oracle/mxfp4.py", line 90, in select
    raise ValueError(
ValueError: moe_backend='aiter' is not supported on gfx936"""
    lines = ["(raylet, ip=10.0.0.2) [2026-08-26 10:11:12,000 I 77 77] "
             "(raylet) worker_pool.cc:500: Started worker"]
    lines += [f"(RayWorkerWrapper pid=4321, ip=10.0.0.2) {ln}" for ln in
              _vllm("ERROR", worker_tb, "worker_base.py:628")]
    lines += [f"(pid=555, ip=10.0.0.3) {ln}" for ln in
              _vllm("INFO", "still loading", "loader.py:1")]
    lines += ["ray.exceptions.RayTaskError(ValueError): ray::RayWorkerWrapper"
              ".execute_method() (pid=4321, ip=10.0.0.2)"]
    rep = fb.analyze("\n".join(lines))
    b = rep.blocker
    assert b.exception == "ValueError: moe_backend='aiter' is not supported on gfx936"
    assert b.stream == "(RayWorkerWrapper pid=4321, ip=10.0.0.2)"
    assert b.start_line == 2


def test_bare_ray_pid_prefixes_separate_interleaved_tracebacks():
    """Ray prints `(pid=N, ip=A) ` with no actor name for plain tasks."""
    a = [f"(pid=11, ip=10.0.0.2) {ln}" for ln in J01_WORKER_TB.splitlines()]
    b = [f"(pid=12, ip=10.0.0.3) {ln}" for ln in J06_RUNTIME_TB.splitlines()]
    rep = fb.analyze("\n".join(x for pair in zip(a, b) for x in pair))
    assert {(e.stream, e.exception) for e in rep.events} == {
        ("(pid=11, ip=10.0.0.2)", "RuntimeError: PassManager::run failed"),
        ("(pid=12, ip=10.0.0.3)",
         "RuntimeError: HIP error: unspecified launch failure")}


def test_raylet_prefix_is_a_stream_of_its_own():
    lines = ["(raylet, ip=10.0.0.9) *** SIGSEGV received at time=1751 on cpu 3 ***",
             "PY_EXIT=1"]
    rep = fb.analyze("\n".join(lines))
    assert rep.blocker.kind == "segfault"
    assert rep.blocker.stream == "(raylet, ip=10.0.0.9)"


def test_warning_traceback_is_context_unless_nothing_else_failed():
    warn = _vllm("WARNING", J06_RUNTIME_TB.replace(
        "RuntimeError: HIP error: unspecified launch failure",
        "ModuleNotFoundError: No module named 'amdsmi'"), "rocm.py:40")
    ok_run = warn + ["ENGINE_READY in 90.0s", "TOKEN_IDS: [1, 2]",
                     "DSV4_VERDICT: COHERENT", "PROBE_EXIT=0", "PY_EXIT=0"]
    rep = fb.analyze("\n".join(ok_run))
    assert rep.blocker is None
    assert rep.events[0].classification == "warning"
    real = warn + _vllm("ERROR", J01_WORKER_TB, "multiproc_executor.py:660",
                        proc="Worker_TP3 pid=1") + ["PY_EXIT=1"]
    rep = fb.analyze("\n".join(real))
    assert rep.blocker.exception == "RuntimeError: PassManager::run failed"
    only = warn + ["PY_EXIT=1"]
    rep = fb.analyze("\n".join(only))
    assert rep.blocker is not None and rep.blocker.classification == "warning"


def test_slurm_time_limit_line_is_the_blocker():
    lines = ["### STAGE: generate",
             "slurmstepd: error: *** JOB 123456 ON n01 CANCELLED AT "
             "2026-08-26T12:00:00 DUE TO TIME LIMIT ***"]
    rep = fb.analyze("\n".join(lines))
    assert rep.blocker.kind == "slurm_cancelled"


def test_line_numbers_match_grep_n_with_carriage_return_progress_bars(tmp_path,
                                                                     capsys):
    bar = "".join(f"\rLoading safetensors checkpoint shards: {p:3d}%"
                  for p in range(0, 101, 10))
    text = ("### STAGE: engine init (the real test)\n" + bar + "\n"
            + "Processed prompts: 0%\r\x0c\x1c| 0/1\r\n"
            + "\n".join(_vllm("ERROR", J06_RUNTIME_TB, proc="EngineCore_DP0 pid=3"))
            + "\nPY_EXIT=1\n")
    log = _write(tmp_path, "bars.log", text)
    rep = fb.analyze(fb.read_log(str(log)))
    [want] = _grep_n(log, "Traceback (most recent call last):")
    assert rep.blocker.start_line == want == 4
    [exc] = _grep_n(log, "RuntimeError: HIP error")
    assert rep.blocker.end_line == exc
    [py] = _grep_n(log, "PY_EXIT=1")
    assert rep.markers["PY_EXIT"][-1][0] == py
    assert fb.main([str(log)]) == 1
    assert f">>{want:6d}|" in capsys.readouterr().out


def test_traceback_hidden_after_a_carriage_return_is_found():
    text = "Loading: 100%\rTraceback (most recent call last):\n" + \
        "\n".join(J06_RUNTIME_TB.splitlines()[1:])
    rep = fb.analyze(text)
    assert rep.blocker.start_line == 1
    assert rep.blocker.exception.startswith("RuntimeError: HIP error")


def test_non_utf8_bytes_on_stdin_do_not_crash_the_cli():
    import os
    import subprocess
    import sys
    data = (b"### STAGE: generate\n\xff\xfe\x80 garbage \xc3\x28\n"
            + J06_RUNTIME_TB.encode() + b"\n\xe4\xbd\xa0\xe5\xa5\xbd PY_EXIT?\n")
    env = dict(os.environ, PYTHONPATH=str(fb.__file__).rsplit("/dcu_kit", 1)[0],
               PYTHONIOENCODING="ascii")
    r = subprocess.run([sys.executable, "-m", "dcu_kit.first_blocker", "-"],
                       input=data, capture_output=True, env=env, timeout=60)
    assert r.returncode == 1, r.stderr.decode(errors="replace")
    assert b"FIRST_BLOCKER: traceback at line 3" in r.stdout
