"""The suite's time kept in bounds, as pytest hooks (a plugin of tests/conftest.py):

- a test that takes longer than `slow_after` seconds (20; setup and call together: a module fixture's work counts
  for the test that first needs it) without the `slow` mark fails, saying so;
- a whole run (the suite as the README runs it: no paths, -k or -m) whose slow-marked tests take `slow_share`
  of the tests' time or more (default a third; pyproject says what holds today) ends failed, with one line giving
  the shares: the mark is for the few long tests, and a
  `-m "not slow"` run is the quick answer most changes want.

Both count a test's time without Inductor's code generation and compilation of graphs its cache did not hold
(its `fx_codegen_and_compile`, in the test's own process): a cold cache (CI's fresh machine) adds minutes to the compiled
tests that a warm one does not, and a rule that judged them by it would pass or fail by the cache, not the test.
Under pytest-xdist the first rule runs in each worker (where the test ran) and the second in the controller,
which receives every report."""

from __future__ import annotations

import pytest

_SETUP = pytest.StashKey[float]()
_COLD_AT_START = pytest.StashKey[float]()


def cold_compile_s() -> float:
    """Seconds Inductor has spent in this process generating and compiling code for graphs its cache did not
    hold (torch._inductor.compile_fx.fx_codegen_and_compile, timed from `pytest_configure` on)."""
    return _COLD[0]


_COLD = [0.0, 0]  # seconds, the depth of the call being timed


def _time_cold_compiles() -> None:
    import functools
    import time

    from torch._inductor import compile_fx

    fn = compile_fx.fx_codegen_and_compile
    if hasattr(fn, "suite_time"):  # timed already (a pytester run in this process configures again)
        return

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start, _COLD[1] = time.perf_counter(), _COLD[1] + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _COLD[1] -= 1
            if not _COLD[1]:  # the outermost call: a graph's inner compiles are within it
                _COLD[0] += time.perf_counter() - start

    timed.suite_time = True
    compile_fx.fx_codegen_and_compile = timed  # _compile_fx_inner looks it up by name at each call


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
    if getattr(config, "workerinput", None) or config.getoption("numprocesses", None) in (None, 0):
        _time_cold_compiles()  # where the tests run


def _whole_run(config) -> bool:
    testpaths = config.getini("testpaths")
    return (not config.getoption("keyword") and not config.getoption("markexpr")
            and [str(a) for a in config.args] in ([], list(testpaths)))


def _over(config) -> tuple[float, float, bool] | None:
    """(the slow tests' share, the limit, whether this run fails by it); None before any report."""
    shares = config.pluginmanager.get_plugin("suite_time_shares")
    if shares is None or not shares.total:
        return None
    share, limit = shares.slow / shares.total, float(config.getini("slow_share"))
    return share, limit, share >= limit and _whole_run(config)


def pytest_sessionfinish(session):
    over = _over(session.config)
    if over and over[2]:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    over = _over(config)
    if over is None:
        return
    shares = config.pluginmanager.get_plugin("suite_time_shares")
    terminalreporter.write_line(f"suite time: slow-marked tests {shares.slow:.0f} s of {shares.total:.0f} s of test "
                                f"time, Inductor's cold compiles apart ({over[0]:.0%}; accepted: under {over[1]:.0%})")
    if over[2]:
        terminalreporter.write_line("suite time: too much of the run is marked slow: make those tests quicker")
