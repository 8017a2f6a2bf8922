"""CLI: python -m tools.stack <command>. The Makefile targets call these."""
from __future__ import annotations

import argparse
import signal
import os
import sys

from . import engine, pin as pin_mod, wheel
from .errors import StackError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.stack", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("upstream", help="put pristine pinned upstream into vllm/ (submodule or sdist)")
    sub.add_parser("apply", help="apply patches/series to vllm/ as one commit per patch")
    u = sub.add_parser("unapply", help="return vllm/ to pristine upstream")
    u.add_argument("--force", action="store_true", help="drop unrefreshed commits (kept in a backup ref)")
    sub.add_parser("status", help="which patches are applied / modified")
    sub.add_parser("refresh", help="export vllm/'s patch commits back to patches/")
    n = sub.add_parser("new", help="start a new patch on top of the series")
    n.add_argument("name")
    e = sub.add_parser("edit", help="stop an interactive rebase at one patch to edit it")
    e.add_argument("name")
    sub.add_parser("check", help="lint series + headers, apply to pristine with zero fuzz, check pin")
    w = sub.add_parser("wheel", help="build the fork's wheel from pristine upstream + series")
    w.add_argument("--flavour", choices=wheel.FLAVOURS, default="python")
    w.add_argument("--dtk", default=os.environ.get("DTK_VERSION"))
    w.add_argument("--out", default=str(wheel.DIST))
    w.add_argument("-v", "--verbose", action="store_true", help="show the compiler output (pip -v)")
    sub.add_parser("version", help="print the fork version of the python flavour")
    rb = sub.add_parser("rebase", help="carry the series onto a new upstream; report in build/rebase-<X>/")
    rb.add_argument("target", help="release version (sdist from the index) or 40-hex upstream commit")
    rr = sub.add_parser("rebase-reports", help="rebase onto each version and write docs/rebase-<X>.md "
                        "(the committed reports), each recommendation comparing all of them")
    rr.add_argument("targets", nargs="+", help="release versions (or 40-hex commits)")
    for sp in (rb, rr):
        sp.add_argument("--run-tests", action="store_true",
                        help="run each patch's engine-free tests (Tests:, tests/runtime/) on the new "
                        "upstream without the patch: passing = probably obsolete (slow: minutes)")
        sp.add_argument("--test-python", help="Python with torch and pytest for --run-tests "
                        "(default .venv/bin/python)")
        sp.add_argument("--tests-timeout", type=int, default=300,
                        help="seconds per pytest run of --run-tests (default 300)")
    ra = sub.add_parser("rebase-accept", help="install build/rebase-<X>/: pin, gitlink, patches/, changelog")
    ra.add_argument("target", help="the X given to rebase")
    ra.add_argument("--version", help="release version of a bare-commit rebase")
    args = ap.parse_args(argv)

    try:
        pin = pin_mod.load()
        if args.cmd == "upstream":
            print(engine.ensure_upstream(pin))
        elif args.cmd == "apply":
            results = engine.apply(pin)
            for r in results:
                print(f"applied {r.name}" + (f"  ({len(r.offsets)} hunk(s) at an offset)" if r.offsets else ""))
            print(f"{len(results)} patch(es) applied" if results else "series already applied")
        elif args.cmd == "unapply":
            print(engine.unapply(pin, force=args.force))
        elif args.cmd == "status":
            print(engine.status(pin))
        elif args.cmd == "refresh":
            changed = engine.refresh(pin)
            print("\n".join(f"refreshed patches/{c}" for c in changed) or "patches/ already up to date")
        elif args.cmd == "new":
            print(engine.new(pin, args.name))
        elif args.cmd == "edit":
            print(engine.edit(pin, args.name))
        elif args.cmd == "check":
            problems = engine.check(pin)
            if problems:
                print("make check: FAILED", file=sys.stderr)
                for p in problems:
                    print(f"  - {p}", file=sys.stderr)
                return 1
            print("make check: series, headers, zero-fuzz apply, pin and changelog OK")
        elif args.cmd == "wheel":
            from pathlib import Path
            print(wheel.build(pin, args.flavour, args.dtk, Path(args.out), verbose=args.verbose))
        elif args.cmd == "version":
            print(wheel.fork_version(pin, "python"))
        elif args.cmd == "rebase":
            from . import rebase
            report, ready = rebase.rebase(pin, args.target, run_tests=args.run_tests,
                                          test_python=args.test_python,
                                          tests_timeout=args.tests_timeout)
            print(f"rebase: report written to {report}")
            if rebase.LAST:
                print(f"rebase: {rebase.summary_line(list(rebase.LAST.values())[-1])}")
            if not ready:
                print("rebase: NOT ready to accept (conflicts, lost files or failed compat guards); "
                      "see the report", file=sys.stderr)
                return 1
        elif args.cmd == "rebase-reports":
            from . import rebase
            from .pin import ROOT
            for label, ready, line in rebase.reports(pin, args.targets, ROOT / "docs", run_tests=args.run_tests,
                                                     test_python=args.test_python,
                                                     tests_timeout=args.tests_timeout):
                print(f"rebase-reports: docs/rebase-{label}.md: {line}")
        elif args.cmd == "rebase-accept":
            from . import rebase
            print(rebase.accept(pin, args.target, args.version))
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `make status | head` ends quietly
    sys.exit(main())
