# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Find the first blocker in a raw vLLM/Slurm log (field report 11.3).

Reading order the seed settled on:
  1. the earliest workload traceback in the raw log,
  2. is it on the main execution path?
  3. separate background threads, shutdown and main inference,
  4. compare with ENGINE_READY, TOKEN_IDS, the verdict,
  5. only then look at the Slurm state and exit code.

Events recognised:
  * Python tracebacks (``Traceback (most recent call last):`` ... exception
    line). The exception line is the first unindented line after the frames,
    whatever its name: a bare ``Exception: ...`` (vLLM raises one in its
    engine/executor paths), ``ray.exceptions.RayTaskError(ValueError): ...``,
    ``KeyboardInterrupt``. Lines may carry a vLLM log prefix
    (``ERROR 08-26 12:00:00 [core.py:1] ``, whose level is kept), a process
    prefix (``(EngineCore_DP0 pid=1) ``, ``(Worker_TP3 pid=7) ``), Ray's
    ``(pid=N, ip=A) ``, ``(RayWorkerWrapper pid=N, ip=A) ``, ``(raylet, ip=A) ``
    or an ``srun -l`` rank label (``3: ``). Interleaved processes are
    separated by prefix.
  * native failures that are not tracebacks: HIP/ROCm device assertions
    (``skinny_gemms.hip:580 ... Device-side assertion``), ``Memory access
    fault``/VMFault, segfaults, ``Fatal Python error``, ``LLVM ERROR:``,
    ``terminate called ...``, NCCL/RCCL errors and watchdog timeouts,
    ``HSA_STATUS_ERROR``, Slurm's ``CANCELLED ... DUE TO TIME LIMIT`` and
    OOM kills.
  * the run's own state: an empty log, a log that stops inside a stage with
    no ``PROBE_EXIT``/``PY_EXIT`` (time limit, SIGKILL), ``KIT_SIGNAL=`` from
    the job's trap, a non-zero ``PY_EXIT`` (or ``--rc``) with no error in the
    log, a DEGENERATE verdict.

Classes, in the order the blocker is chosen:
  main        a failure on the main path (earliest wins; native aborts and
              Python errors alike)
  secondary   a Python error that only reports another process' death
              (``EngineDeadError``, ``Engine core initialization failed``,
              ``Worker proc ... died``, Ray ``ActorDiedError``, broken pipes):
              the native abort or worker traceback that killed it wins
  run_state   the synthetic events above
  warning     a traceback logged at WARNING/INFO/DEBUG level: context, chosen
              only when the run failed and nothing else explains it
  background  ``Exception in thread`` / ``Exception ignored in``: the same
  (last)      a non-zero exit code with nothing in the log: named with the
              last stage reached, so a failed run is never "none"
  noise       known noise, never chosen: the usage-report thread's
              ``JSONDecodeError`` (11.1), shutdown-time ``libcudart is not
              loaded`` (11.2), ``--ignore REGEX``

Line numbers are those of ``grep -n`` (only ``\n`` ends a line; a ``\r``
progress bar does not), and undecodable bytes never stop the reader.

CLI: ``python -m dcu_kit.first_blocker RAW.log [--rc N] [--context N]
[--json]``; exit 0 = the run did not fail and no blocker was found,
1 = blocker printed, 2 = the log could not be read. A run that failed never
ends with ``FIRST_BLOCKER: none``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field

ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SRUN_LABEL_RE = re.compile(r"^\s*\d+: ")
# (EngineCore_DP0 pid=1) (Worker_TP3 pid=7) (RayWorkerWrapper pid=9, ip=A)
# (pid=9, ip=A) (raylet, ip=A) (raylet) (gcs_server) (autoscaler +1m)
PROC_PREFIX_RE = re.compile(
    r"^\((?P<proc>(?:[A-Za-z_][\w.\-]* )?pid=\d+[^)]*"
    r"|raylet[^)]*|gcs_server[^)]*|autoscaler[^)]*|dashboard[^)]*)\) ?")
RAY_REPEAT_RE = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")
LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL")
VLLM_LOG_PREFIX_RE = re.compile(
    r"^(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL) +"
    r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? +\[[^\]]*\] ?"
)
QUIET_LEVELS = {"DEBUG", "INFO", "WARNING", "WARN"}
TRACEBACK_START = "Traceback (most recent call last):"
CHAINED_RE = re.compile(
    r"^(During handling of the above exception|The above exception was the "
    r"direct cause)"
)
THREAD_HEADER_RE = re.compile(r"^Exception in thread (?P<thread>.+?):?$")
IGNORED_HEADER_RE = re.compile(r"^Exception ignored in")
NATIVE_EVENT_RES = [
    ("device_assertion", re.compile(r"[Dd]evice-side assert")),
    ("memory_fault", re.compile(r"Memory access fault|VMFault|page not present",
                                re.I)),
    ("segfault", re.compile(r"Segmentation fault|SIGSEGV|core dumped")),
    ("fatal_python", re.compile(r"Fatal Python error")),
    ("llvm_error", re.compile(r"^LLVM ERROR:")),
    ("cxx_terminate", re.compile(r"terminate called (?:after throwing|without|"
                                 r"recursively)")),
    ("collective_timeout", re.compile(
        r"Watchdog caught collective operation timeout|"
        r"(?:NCCL|RCCL) watchdog|ProcessGroup(?:NCCL|RCCL|Gloo)\S*.*[Tt]imeout")),
    ("collective_error", re.compile(
        r"\b(?:NCCL|RCCL) (?:error|WARN .*(?:failed|error))|"
        r"\bnccl(?:System|Internal|UnhandledCuda|Remote|InvalidUsage)Error\b")),
    ("hsa_error", re.compile(r"\bHSA_STATUS_ERROR\w*")),
    ("hip_error", re.compile(r"\bhipError(?!Success)\w+|\bHIP error\b")),
    ("slurm_cancelled", re.compile(r"\*\*\* (?:JOB|STEP) \S+ .*CANCELLED AT")),
    ("oom_kill", re.compile(r"oom[-_ ]kill|Out Of Memory|OOM Killed", re.I)),
    ("srun_error", re.compile(r"^srun: error: ")),
]
# Python errors that report another process' death or a broken channel to it:
# the cause is elsewhere in the log (a worker traceback, a native abort).
SECONDARY_RES = [
    re.compile(r"EngineDeadError|EngineCore encountered an issue"),
    re.compile(r"Engine core initialization failed"),
    re.compile(r"died unexpectedly|proc(?:ess)? died|Worker failed"),
    re.compile(r"ActorDiedError|RayActorError|ActorUnavailableError|"
               r"The actor died"),
    re.compile(r"^(?:BrokenPipeError|ConnectionResetError|EOFError)\b"),
    re.compile(r"^srun: error: "),
]

# (name, predicate over the event's text) - known noise from the seed.
NOISE_RULES = [
    (
        "usage_report_thread",
        re.compile(r"_report_usage_worker|usage_lib\.py"),
        "vLLM usage-report background thread (seed 11.1); not the engine",
    ),
    (
        "shutdown_libcudart",
        re.compile(r"libcudart is not loaded"),
        "shutdown-time CUDA allocator import on ROCm (seed 11.2); "
        "happens after the result",
    ),
]

MARKER_RES = {
    "STAGE": re.compile(r"^### STAGE: ?(?P<v>.*)"),
    "ENGINE_READY": re.compile(r"ENGINE_READY"),
    "TOKEN_IDS": re.compile(r"^TOKEN_IDS:"),
    "DSV4_VERDICT": re.compile(r"^(?:DSV4|SERVE_SMOKE)_VERDICT: ?(?P<v>.*)"),
    "PROBE_FAILED_STAGE": re.compile(r"^PROBE_FAILED_STAGE: ?(?P<v>.*)"),
    "PROBE_EXIT": re.compile(r"^PROBE_EXIT=(?P<v>-?\d+)"),
    "PY_EXIT": re.compile(r"^PY_EXIT=(?P<v>-?\d+)"),
    "KIT_SIGNAL": re.compile(r"^KIT_SIGNAL=(?P<v>\S+)"),
}
CLASS_ORDER = ("main", "secondary", "run_state", "warning", "background")
RUN_STATE_ORDER = ("empty_log", "signal", "truncated", "verdict", "nonzero_exit")


@dataclass
class Event:
    kind: str  # traceback | device_assertion | memory_fault | ... | truncated
    start_line: int  # 1-based line number in the raw log (grep -n)
    end_line: int
    stream: str  # process prefix ('' for the main stream)
    text: list[str] = field(default_factory=list)  # prefix-stripped lines
    exception: str = ""
    thread: str = ""
    level: str = ""  # vLLM log level of the first line, if any
    chain: list[str] = field(default_factory=list)  # chained exception lines
    classification: str = "main"  # see CLASS_ORDER, or noise
    reason: str = ""

    def headline(self) -> str:
        if self.kind == "traceback":
            if len(self.chain) > 1:
                return f"{self.exception} (chained from: {self.chain[0]})"
            return self.exception or "(traceback without exception line)"
        return self.text[0].strip() if self.text else self.kind


def split_lines(text: str) -> list[str]:
    """Lines as ``grep -n`` numbers them: only ``\n`` ends a line."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def visible(line: str) -> str:
    """What a terminal shows of a line: the last non-empty ``\r`` segment."""
    line = line.rstrip("\r")
    if "\r" in line:
        segs = [x for x in line.split("\r") if x.strip()]
        line = segs[-1] if segs else ""
    return line


def parse_line(line: str) -> tuple[str, str, str]:
    """(stream key, log level or '', text without ANSI/srun/process/log
    prefixes)."""
    s = ANSI_RE.sub("", visible(line))
    s = RAY_REPEAT_RE.sub("", s)
    stream, level = "", ""
    for _ in range(4):  # prefixes can nest in any order
        changed = False
        m = SRUN_LABEL_RE.match(s)
        if m:
            stream += m.group(0).strip()
            s = s[m.end():]
            changed = True
        m = PROC_PREFIX_RE.match(s)
        if m:
            stream += "(" + m.group("proc") + ")"
            s = s[m.end():]
            changed = True
        m = VLLM_LOG_PREFIX_RE.match(s)
        if m:
            level = level or m.group("level")
            s = s[m.end():]
            changed = True
        if not changed:
            break
    return stream, level, s


def strip_prefixes(line: str) -> tuple[str, str]:
    """Return (stream key, line without ANSI/srun/process/log prefixes)."""
    stream, _, s = parse_line(line)
    return stream, s


def _classify(ev: Event, extra_noise: list[re.Pattern]) -> None:
    blob = "\n".join(ev.text + [ev.thread])
    for name, rx, why in NOISE_RULES:
        if rx.search(blob):
            ev.classification, ev.reason = "noise", f"{name}: {why}"
            return
    for rx in extra_noise:
        if rx.search(blob):
            ev.classification, ev.reason = "noise", f"--ignore {rx.pattern}"
            return
    if ev.thread:
        ev.classification = "background"
        ev.reason = f"raised in background thread {ev.thread!r}"
        return
    if ev.level in QUIET_LEVELS:
        ev.classification = "warning"
        ev.reason = (f"logged at {ev.level} level: context, not a failure "
                     "unless nothing else failed")
        return
    heads = (ev.chain or [ev.exception]) if ev.kind == "traceback" else [
        ev.headline()]
    if all(any(rx.search(h) for rx in SECONDARY_RES) for h in heads):
        ev.classification = "secondary"
        ev.reason = ("reports another process' failure; the cause is "
                     "an earlier or native event")


def _is_exception_line(t: str) -> bool:
    ts = t.strip()
    return bool(ts) and not t[:1].isspace() and ts != TRACEBACK_START and not (
        CHAINED_RE.match(ts))


def find_events(lines: list[str], extra_noise: list[re.Pattern] | None = None
                ) -> list[Event]:
    """Parse all failure events, ordered by first line."""
    extra_noise = extra_noise or []
    streams: dict[str, list[tuple[int, str, str]]] = {}
    for i, raw in enumerate(lines, start=1):
        key, level, s = parse_line(raw)
        streams.setdefault(key, []).append((i, level, s))

    events: list[Event] = []
    for key, items in streams.items():
        pending_thread = ""
        pending_thread_line = 0
        j = 0
        while j < len(items):
            lineno, level, s = items[j]
            st = s.strip()
            m = THREAD_HEADER_RE.match(st)
            if m:
                pending_thread, pending_thread_line = m.group("thread"), lineno
                j += 1
                continue
            if IGNORED_HEADER_RE.match(st):
                pending_thread, pending_thread_line = st, lineno
                j += 1
                continue
            if st == TRACEBACK_START:
                if not level and j > 0 and items[j - 1][0] == lineno - 1:
                    level = items[j - 1][1]  # "WARNING ... failed:" + traceback
                ev = Event("traceback", lineno, lineno, key, [s], level=level)
                if pending_thread:
                    ev.thread = pending_thread
                    ev.start_line = pending_thread_line
                k = j + 1
                chained = False
                while k < len(items):
                    ln, lvl, t = items[k]
                    if t.strip() == TRACEBACK_START and not chained:
                        k -= 1  # a new traceback without an exception line
                        break
                    if t.strip() == TRACEBACK_START:
                        chained = False
                    # A quieter log line of the same process interleaved in
                    # an ERROR traceback is not its exception line.
                    if (lvl and level and lvl != level and lvl in QUIET_LEVELS):
                        k += 1
                        continue
                    ev.text.append(t)
                    ev.end_line = ln
                    if CHAINED_RE.match(t.strip()):
                        chained = True
                    if _is_exception_line(t):
                        ev.exception = t.strip()
                        ev.chain.append(ev.exception)
                        # Chained exceptions continue the same event.
                        nxt = items[k + 1][2].strip() if k + 1 < len(items) else ""
                        nxt2 = items[k + 2][2].strip() if k + 2 < len(items) else ""
                        if CHAINED_RE.match(nxt) or (not nxt and CHAINED_RE.match(
                                nxt2)):
                            k += 1
                            continue
                        # Multi-line messages: keep unindented non-empty lines
                        # that are not a new event.
                        while k + 1 < len(items):
                            ln2, lvl2, t2 = items[k + 1]
                            t2s = t2.strip()
                            if (not t2s or t2s == TRACEBACK_START
                                    or THREAD_HEADER_RE.match(t2s)
                                    or (lvl2 and lvl2 != level)
                                    or any(rx.search(t2) for _, rx in
                                           NATIVE_EVENT_RES)
                                    or any(rx.search(t2s) for rx in
                                           MARKER_RES.values())
                                    or t2s.startswith(LEVELS)):
                                break
                            if len(ev.text) > 400:
                                break
                            ev.text.append(t2)
                            ev.end_line = ln2
                            k += 1
                        break
                    if len(ev.text) > 400:
                        break
                    k += 1
                pending_thread = ""
                _classify(ev, extra_noise)
                events.append(ev)
                j = k + 1
                continue
            for kind, rx in NATIVE_EVENT_RES:
                if rx.search(st):
                    ev = Event(kind, lineno, lineno, key, [s], level=level)
                    _classify(ev, extra_noise)
                    events.append(ev)
                    break
            j += 1
    events.sort(key=lambda e: (e.start_line, e.end_line))
    return events


@dataclass
class BlockerReport:
    blocker: Event | None
    events: list[Event]
    markers: dict[str, list[tuple[int, str]]]
    failed: bool = False  # the run failed (rc, PY_EXIT, truncation, verdict)
    last_stage: str = ""

    def to_dict(self) -> dict:
        return {
            "blocker": asdict(self.blocker) if self.blocker else None,
            "events": [
                {k: v for k, v in asdict(e).items() if k != "text"}
                for e in self.events
            ],
            "markers": self.markers,
            "failed": self.failed,
            "last_stage": self.last_stage,
        }


def _marker_value(markers, name) -> str | None:
    hits = markers.get(name)
    if not hits:
        return None
    m = MARKER_RES[name].search(hits[-1][1])
    return m.group("v").strip() if m and "v" in m.groupdict() else hits[-1][1]


def _run_state_events(lines: list[str], markers, rc: int | None) -> list[Event]:
    """Synthetic events from the run's markers (see module docstring)."""
    n = len(lines)
    stage = _marker_value(markers, "STAGE") or ""
    where = f"in stage {stage!r}" if stage else "before any probe stage"
    out: list[Event] = []

    def ev(kind, line, text):
        out.append(Event(kind, line, line, "", [text], classification="run_state",
                         reason=where))

    if not any(ln.strip() for ln in lines):
        ev("empty_log", 0, "the log is empty: the job died before its "
           "workload wrote anything (wrong partition/env, srun or module "
           "failure, or the log path is wrong)")
        return out
    sig = markers.get("KIT_SIGNAL")
    if sig:
        ev("signal", sig[-1][0], f"the job got SIG{_marker_value(markers, 'KIT_SIGNAL')} "
           f"{where} (time limit or scancel; the workload was stopped)")
    exits = markers.get("PROBE_EXIT") or markers.get("PY_EXIT")
    if markers.get("STAGE") and not exits and not sig:
        ev("truncated", n, f"the log stops {where} with no PROBE_EXIT/PY_EXIT: "
           "the run was killed (time limit, SIGKILL, OOM) or is still running")
    codes = []
    for name in ("PY_EXIT", "PROBE_EXIT"):
        v = _marker_value(markers, name)
        if v is not None:
            codes.append((name, int(v), markers[name][-1][0]))
    if rc is not None:
        codes.append(("--rc", rc, n))
    bad = [c for c in codes if c[1] != 0]
    verdict = _marker_value(markers, "DSV4_VERDICT")
    if verdict is not None and verdict.split()[:1] != ["COHERENT"]:
        ev("verdict", markers["DSV4_VERDICT"][-1][0],
           f"the verdict is {verdict}: the run produced output and it is wrong")
    elif bad:
        name, code, line = bad[0]
        ev("nonzero_exit", line, f"{name}={code} {where} and no traceback or "
           "native error in this log: look at the Slurm output (.out), the "
           "serve log and `sacct -j <job> -o JobID,State,ExitCode`")
    return out


def analyze(text: str, extra_noise: list[str] | None = None,
            rc: int | None = None) -> BlockerReport:
    lines = split_lines(text)
    noise = [re.compile(p) for p in (extra_noise or [])]
    events = find_events(lines, noise)
    markers: dict[str, list[tuple[int, str]]] = {}
    for i, raw in enumerate(lines, start=1):
        _, s = strip_prefixes(raw)
        for name, rx in MARKER_RES.items():
            if rx.search(s.strip()):
                markers.setdefault(name, []).append((i, s.strip()[:200]))
    state = _run_state_events(lines, markers, rc)
    failed = bool(state)
    if any(e.classification in ("main", "secondary") for e in events):
        # the exit code is explained by the errors in the log
        state = [e for e in state if e.kind != "nonzero_exit"]
    events = sorted(events + state, key=lambda e: (e.start_line, e.end_line))
    blocker = None
    ranked = []
    for e in events:
        if e.classification not in CLASS_ORDER:
            continue  # noise
        if e.classification in ("warning", "background") and not failed:
            continue
        rank = CLASS_ORDER.index(e.classification)
        if e.kind in RUN_STATE_ORDER:
            # empty > signal > truncated > verdict; a bare exit code is the
            # last resort, after any traceback in the log (even a WARNING)
            rank = (len(CLASS_ORDER) if e.kind == "nonzero_exit" else rank)
            rank += RUN_STATE_ORDER.index(e.kind) / 10
        ranked.append((rank, e.start_line, e))
    if ranked:
        blocker = min(ranked, key=lambda x: (x[0], x[1]))[2]
    return BlockerReport(blocker, events, markers, failed or blocker is not None,
                         _marker_value(markers, "STAGE") or "")


def format_report(report: BlockerReport, lines: list[str], context: int = 5
                  ) -> str:
    out: list[str] = []
    b = report.blocker
    if b is None:
        out.append("FIRST_BLOCKER: none on the main path")
    else:
        out.append(
            f"FIRST_BLOCKER: {b.kind} at line {b.start_line}"
            f"{' in ' + b.stream if b.stream else ''}: {b.headline()}"
        )
        if b.start_line > 0:
            lo = max(1, b.start_line - context)
            hi = min(len(lines), b.end_line + context)
            out.append(f"--- raw log lines {lo}-{hi} ---")
            for i in range(lo, hi + 1):
                mark = ">>" if b.start_line <= i <= b.end_line else "  "
                shown = lines[i - 1].replace("\r", "\\r")
                out.append(f"{mark}{i:6d}| {shown}")
            out.append("--- end ---")
    skipped = [e for e in report.events if e is not b]
    if skipped:
        out.append("Other events (not chosen):")
        for e in skipped:
            tag = e.classification + (f" [{e.reason}]" if e.reason else "")
            out.append(f"  line {e.start_line}: {e.kind}: {e.headline()} -> {tag}")
    out.append("LAST_STAGE: " + (report.last_stage or "none"))
    for name in ("ENGINE_READY", "TOKEN_IDS", "DSV4_VERDICT", "PY_EXIT"):
        hits = report.markers.get(name)
        if hits:
            out.append(f"{name}: line {hits[-1][0]}: {hits[-1][1]}")
        else:
            out.append(f"{name}: not found")
    if b is not None and b.start_line and "ENGINE_READY" in report.markers:
        ready = report.markers["ENGINE_READY"][0][0]
        phase = "after" if b.start_line > ready else "before"
        out.append(f"blocker is {phase} ENGINE_READY (line {ready})")
    return "\n".join(out)


def read_log(path: str) -> str:
    """The log as text; undecodable bytes become U+FFFD. '-' is stdin."""
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        with open(path, "rb") as f:
            data = f.read()
    return data.decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", help="raw log file ('-' for stdin)")
    p.add_argument("--context", type=int, default=5, help="lines around it")
    p.add_argument("--ignore", action="append", default=[],
                   help="extra noise regex (repeatable)")
    p.add_argument("--rc", type=int, default=None,
                   help="the job's exit code: non-zero means the run failed, "
                        "so 'none' is never the answer")
    p.add_argument("--json", action="store_true", help="JSON output")
    a = p.parse_args(argv)
    for stream in (sys.stdout, sys.stderr):
        # a C/ASCII locale on a compute node must not turn the report into a
        # UnicodeEncodeError
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        text = read_log(a.log)
    except OSError as e:
        print(f"first_blocker: cannot read log {a.log!r}: {e}", file=sys.stderr)
        return 2
    rep = analyze(text, a.ignore, rc=a.rc)
    if a.json:
        print(json.dumps(rep.to_dict(), indent=1, ensure_ascii=False))
    else:
        print(format_report(rep, split_lines(text), a.context))
    return 1 if rep.blocker else 0


if __name__ == "__main__":
    sys.exit(main())
