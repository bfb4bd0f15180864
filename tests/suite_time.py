"""The suite's time kept in bounds, as pytest hooks (tests/conftest.py imports them):

- a test that takes longer than `slow_after` seconds (20; setup and call together: a module fixture's work counts
  for the test that first needs it) without the `slow` mark fails, saying so;
- a whole run (the suite as the README runs it: no paths, -k or -m) whose slow-marked tests take a third of the
  tests' time or more ends failed, with one line giving the shares: the mark is for the few long tests, and a
  `-m "not slow"` run is the quick answer most changes want.

Both count a test's time without Inductor's code generation and compilation of graphs its cache did not hold
(torch._dynamo's `fx_codegen_and_compile` time): a cold cache (CI's fresh machine) adds minutes to the compiled
tests that a warm one does not, and a rule that judged them by it would pass or fail by the cache, not the test.
Under pytest-xdist the first rule runs in each worker (where the test ran) and the second in the controller,
which receives every report."""

from __future__ import annotations

import sys

import pytest

_SETUP = pytest.StashKey[float]()
_COLD_AT_START = pytest.StashKey[float]()


def cold_compile_s() -> float:
    """Seconds Inductor has spent in this process generating and compiling code for graphs its cache did not
    hold (0 where torch._dynamo was never imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return sum(utils.compilation_time_metrics.get("fx_codegen_and_compile", ())) if utils else 0.0


def pytest_addoption(parser):
    parser.addini("slow_after", "seconds a test may take without the slow mark", default="20")
    parser.addini("slow_share", "the largest share of a whole run's test time the slow tests may take",
                  default="0.3333")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "setup":
        item.stash[_COLD_AT_START] = cold_compile_s()
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item.stash[_SETUP] = report.duration
    if call.when != "call":
        return
    cold = cold_compile_s() - item.stash.get(_COLD_AT_START, 0.0)
    report.user_properties.append(("cold_compile_s", cold))
    took = item.stash.get(_SETUP, 0.0) + report.duration - cold
    limit = float(item.config.getini("slow_after"))
    if took > limit and not report.failed and not item.get_closest_marker("slow"):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {took:.1f} s (setup and call, {cold:.1f} s of Inductor's cold "
                           f"compile not counted) without the slow mark; accepted: under {limit:g} s, or "
                           "@pytest.mark.slow (tests/suite_time.py)")


class _Shares:
    def __init__(self):
        self.slow = self.total = 0.0

    def pytest_runtest_logreport(self, report):
        took = report.duration - dict(report.user_properties).get("cold_compile_s", 0.0)
        self.total += took
        if "slow" in report.keywords:
            self.slow += took


def pytest_configure(config):
    if not getattr(config, "workerinput", None):  # the controller, or a run without xdist
        config.pluginmanager.register(_Shares(), "suite_time_shares")


def _whole_run(config) -> bool:
    testpaths = config.getini("testpaths")
    return (not config.getoption("keyword") and not config.getoption("markexpr")
            and [str(a) for a in config.args] in ([], list(testpaths)))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    shares = config.pluginmanager.get_plugin("suite_time_shares")
    if shares is None or not shares.total:
        return
    share, limit = shares.slow / shares.total, float(config.getini("slow_share"))
    line = (f"suite time: slow-marked tests {shares.slow:.0f} s of {shares.total:.0f} s of test time, Inductor's "
            f"cold compiles apart ({share:.0%}; accepted: under {limit:.0%})")
    terminalreporter.write_line(line)
    if share >= limit and _whole_run(config):
        terminalreporter.write_line("suite time: too much of the run is marked slow: make those tests quicker")
        terminalreporter._session.exitstatus = pytest.ExitCode.TESTS_FAILED
