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
    line), also when every line carries a vLLM log prefix
    (``ERROR 08-26 12:00:00 [core.py:1] ``) or a process prefix
    (``(EngineCore_DP0 pid=1) ``, ``(Worker_TP3 pid=7) ``) or an ``srun -l``
    rank label (``3: ``). Interleaved ranks are separated by prefix.
  * device-side failures that are not tracebacks: HIP/ROCm device
    assertions (``skinny_gemms.hip:580 ... Device-side assertion``),
    ``Memory access fault``/VMFault, ``Segmentation fault``,
    ``Fatal Python error``.

Known noise (never the first blocker):
  * the usage-report thread: ``Exception in thread ... (_report_usage_worker)``
    followed by ``json.decoder.JSONDecodeError`` (11.1);
  * shutdown-time ``libcudart is not loaded in the current process`` (11.2).
Other ``Exception in thread`` / ``Exception ignored in`` blocks are
classified ``background``: reported, but only chosen when no main-path
event exists.

CLI: ``python -m dcu_kit.first_blocker RAW.log [--context N] [--json]``;
exit 0 = no main-path blocker, 1 = blocker printed, 2 = bad usage.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field

ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
SRUN_LABEL_RE = re.compile(r"^\s*\d+: ")
PROC_PREFIX_RE = re.compile(r"^\((?P<proc>[A-Za-z_][\w.\-]*(?: [^)]*)?pid=\d+[^)]*)\) ?")
VLLM_LOG_PREFIX_RE = re.compile(
    r"^(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL) +"
    r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? +\[[^\]]*\] ?"
)
TRACEBACK_START = "Traceback (most recent call last):"
EXC_LINE_RE = re.compile(
    r"^(?P<exc>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Fault"
    r"|Failure|Abort))(?::\s?(?P<msg>.*))?$"
)
CHAINED_RE = re.compile(
    r"^(During handling of the above exception|The above exception was the "
    r"direct cause)"
)
THREAD_HEADER_RE = re.compile(r"^Exception in thread (?P<thread>.+?):?$")
IGNORED_HEADER_RE = re.compile(r"^Exception ignored in")
DEVICE_EVENT_RES = [
    ("device_assertion", re.compile(r"[Dd]evice-side assertion|Device-side assert")),
    ("memory_fault", re.compile(r"Memory access fault|VMFault|page not present")),
    ("segfault", re.compile(r"Segmentation fault|SIGSEGV|core dumped")),
    ("fatal_python", re.compile(r"Fatal Python error")),
    ("hip_error", re.compile(r"\bhipError\w+|\bHIP error\b")),
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
    "ENGINE_READY": re.compile(r"ENGINE_READY"),
    "TOKEN_IDS": re.compile(r"^TOKEN_IDS:"),
    "DSV4_VERDICT": re.compile(r"^DSV4_VERDICT:"),
    "PY_EXIT": re.compile(r"^PY_EXIT="),
    "STAGE": re.compile(r"^### STAGE"),
}


@dataclass
class Event:
    kind: str  # traceback | device_assertion | memory_fault | ...
    start_line: int  # 1-based line number in the raw log
    end_line: int
    stream: str  # process prefix ('' for the main stream)
    text: list[str] = field(default_factory=list)  # prefix-stripped lines
    exception: str = ""
    thread: str = ""
    classification: str = "main"  # main | background | noise
    reason: str = ""

    def headline(self) -> str:
        if self.kind == "traceback":
            return self.exception or "(traceback without exception line)"
        return self.text[0].strip() if self.text else self.kind


def strip_prefixes(line: str) -> tuple[str, str]:
    """Return (stream key, line without ANSI/srun/process/log prefixes)."""
    s = ANSI_RE.sub("", line.rstrip("\n"))
    stream = ""
    for _ in range(3):  # prefixes can nest in any order
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
            s = s[m.end():]
            changed = True
        if not changed:
            break
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


def find_events(lines: list[str], extra_noise: list[re.Pattern] | None = None
                ) -> list[Event]:
    """Parse all failure events, ordered by first line."""
    extra_noise = extra_noise or []
    streams: dict[str, list[tuple[int, str]]] = {}
    for i, raw in enumerate(lines, start=1):
        key, s = strip_prefixes(raw)
        streams.setdefault(key, []).append((i, s))

    events: list[Event] = []
    for key, items in streams.items():
        pending_thread = ""
        pending_thread_line = 0
        j = 0
        while j < len(items):
            lineno, s = items[j]
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
                ev = Event("traceback", lineno, lineno, key, [s])
                if pending_thread:
                    ev.thread = pending_thread
                    ev.start_line = pending_thread_line
                k = j + 1
                while k < len(items):
                    ln, t = items[k]
                    ts = t.strip()
                    ev.text.append(t)
                    ev.end_line = ln
                    em = EXC_LINE_RE.match(t) if not t.startswith(" ") else None
                    if em:
                        ev.exception = ts
                        # Chained exceptions continue the same event.
                        nxt = items[k + 1][1].strip() if k + 1 < len(items) else ""
                        nxt2 = items[k + 2][1].strip() if k + 2 < len(items) else ""
                        if CHAINED_RE.match(nxt) or (not nxt and CHAINED_RE.match(
                                nxt2)):
                            k += 1
                            continue
                        # Multi-line messages: keep unindented non-empty lines
                        # that are not a new event.
                        while k + 1 < len(items):
                            ln2, t2 = items[k + 1]
                            t2s = t2.strip()
                            if (not t2s or t2s == TRACEBACK_START
                                    or THREAD_HEADER_RE.match(t2s)
                                    or any(rx.search(t2) for _, rx in
                                           DEVICE_EVENT_RES)
                                    or any(rx.search(t2s) for rx in
                                           MARKER_RES.values())
                                    or VLLM_LOG_PREFIX_RE.match(t2s)
                                    or t2s.startswith(("INFO", "WARNING",
                                                       "DEBUG"))):
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
            for kind, rx in DEVICE_EVENT_RES:
                if rx.search(s):
                    ev = Event(kind, lineno, lineno, key, [s])
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

    def to_dict(self) -> dict:
        return {
            "blocker": asdict(self.blocker) if self.blocker else None,
            "events": [
                {k: v for k, v in asdict(e).items() if k != "text"}
                for e in self.events
            ],
            "markers": self.markers,
        }


def analyze(text: str, extra_noise: list[str] | None = None) -> BlockerReport:
    lines = text.splitlines()
    noise = [re.compile(p) for p in (extra_noise or [])]
    events = find_events(lines, noise)
    markers: dict[str, list[tuple[int, str]]] = {}
    for i, raw in enumerate(lines, start=1):
        _, s = strip_prefixes(raw)
        for name, rx in MARKER_RES.items():
            if rx.search(s.strip()):
                markers.setdefault(name, []).append((i, s.strip()[:200]))
    main = [e for e in events if e.classification == "main"]
    return BlockerReport(main[0] if main else None, events, markers)


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
        lo = max(1, b.start_line - context)
        hi = min(len(lines), b.end_line + context)
        out.append(f"--- raw log lines {lo}-{hi} ---")
        for i in range(lo, hi + 1):
            mark = ">>" if b.start_line <= i <= b.end_line else "  "
            out.append(f"{mark}{i:6d}| {lines[i - 1]}")
        out.append("--- end ---")
    skipped = [e for e in report.events if e is not b]
    if skipped:
        out.append("Other events (not chosen):")
        for e in skipped:
            tag = e.classification + (f" [{e.reason}]" if e.reason else "")
            out.append(f"  line {e.start_line}: {e.kind}: {e.headline()} -> {tag}")
    for name in ("ENGINE_READY", "TOKEN_IDS", "DSV4_VERDICT", "PY_EXIT"):
        hits = report.markers.get(name)
        if hits:
            out.append(f"{name}: line {hits[-1][0]}: {hits[-1][1]}")
        else:
            out.append(f"{name}: not found")
    if b is not None and "ENGINE_READY" in report.markers:
        ready = report.markers["ENGINE_READY"][0][0]
        phase = "after" if b.start_line > ready else "before"
        out.append(f"blocker is {phase} ENGINE_READY (line {ready})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", help="raw log file ('-' for stdin)")
    p.add_argument("--context", type=int, default=5, help="lines around it")
    p.add_argument("--ignore", action="append", default=[],
                   help="extra noise regex (repeatable)")
    p.add_argument("--json", action="store_true", help="JSON output")
    a = p.parse_args(argv)
    if a.log == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(a.log, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            print(f"first_blocker: cannot read log {a.log!r}: {e}", file=sys.stderr)
            return 2
    rep = analyze(text, a.ignore)
    if a.json:
        print(json.dumps(rep.to_dict(), indent=1, ensure_ascii=False))
    else:
        print(format_report(rep, text.splitlines(), a.context))
    return 1 if rep.blocker else 0


if __name__ == "__main__":
    sys.exit(main())
