"""No silent skips: under CI a test that skips fails the run, naming what was missing.

Strict mode is on when CI is set to a true value (``.ci/run`` runs with ``CI=true``), when
``VLLM_GFX936_REQUIRE_ALL=1``, or with ``--require-all`` (``make test`` and ``make e2e`` pass it).
Then every test is required: a skip (``pytest.skip``, ``importorskip``, ``skipif``, a fixture that
skips) is reported as a failure whose message is the skip's own reason (``transformers`` missing,
the CPU ops wheel unavailable, torch mismatch, ``openai``, ``hipcc``, ``shellcheck`` ...). A test
module that skips as a whole while it is collected (a module-level ``importorskip``) has no test
to turn red, so it is listed and the session's exit status is set to 1.

A test that cannot run on a CPU machine by its nature (the cluster matrix needs the real model on
DCU nodes) carries ``@pytest.mark.may_skip(reason="why")``; its skips stay skips, and every run
prints how many such skips happened and why. ``xfail`` is not a skip and is left alone.

The hooks live here and are re-exported by ``tests/conftest.py``; a test of this file loads it
the same way (``tests/tooling/test_required_skips.py``).
"""
from __future__ import annotations

import os
from collections import Counter

import pytest

ENV_SWITCH = "VLLM_GFX936_REQUIRE_ALL"
_TRUE = {"1", "true", "yes", "on"}
_STRICT = pytest.StashKey[bool]()
_ALLOWED = pytest.StashKey[list]()   # (nodeid, may_skip reason, skip reason)
_REQUIRED = pytest.StashKey[list]()  # (nodeid, skip reason)


def strict_from_env(environ=os.environ) -> bool:
    return any(environ.get(k, "").strip().lower() in _TRUE for k in ("CI", ENV_SWITCH))


def _skip_reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_addoption(parser):
    parser.addoption("--require-all", action="store_true", default=False,
                     help="a skipped test fails the run unless marked may_skip(reason=...) "
                          f"(also on with CI=true or {ENV_SWITCH}=1)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "may_skip(reason): this test may skip even under CI / --require-all "
        "(it cannot run on a CPU machine); say why")
    config.stash[_STRICT] = bool(config.getoption("--require-all", False)) or strict_from_env()
    config.stash[_ALLOWED] = []
    config.stash[_REQUIRED] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not rep.skipped or hasattr(rep, "wasxfail"):
        return
    reason = _skip_reason(rep.longrepr)
    allowed = item.get_closest_marker("may_skip")
    if allowed is not None:
        why = allowed.kwargs.get("reason") or (allowed.args[0] if allowed.args else "")
        if not why:
            rep.outcome = "failed"
            rep.longrepr = f"may_skip on {item.nodeid} gives no reason; say why it may skip"
            return
        item.config.stash[_ALLOWED].append((item.nodeid, why, reason))
        return
    if not item.config.stash[_STRICT]:
        return
    item.config.stash[_REQUIRED].append((item.nodeid, reason))
    rep.outcome = "failed"
    rep.longrepr = (f"required test skipped: {reason}\n(CI / make test run every test; install "
                    "what is missing, or mark the test may_skip(reason=...) if it cannot run on "
                    "a CPU machine)")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and collector.config.stash[_STRICT]:
        collector.config.stash[_REQUIRED].append((rep.nodeid, _skip_reason(rep.longrepr)))


def pytest_sessionfinish(session, exitstatus):
    req = [r for r in session.config.stash.get(_REQUIRED, []) if "::" not in r[0]]
    if req and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    allowed = config.stash.get(_ALLOWED, [])
    required = config.stash.get(_REQUIRED, [])
    if allowed:
        tr.write_sep("-", f"{len(allowed)} allowed skips (may_skip)")
        for why, n in Counter(w for _, w, _ in allowed).most_common():
            tr.write_line(f"{n:4d} x {why}")
    if required:
        tr.write_sep("=", f"{len(required)} required tests skipped: FAILED (CI / --require-all)",
                     red=True)
        for nodeid, reason in required:
            tr.write_line(f"{nodeid}: {reason}")
