"""tests/suite_time.py's rules, on a small suite run by pytester: a test past `slow_after` without the slow
mark fails; a whole run whose slow tests take a third of the time or more fails; a partial run only says it."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
HERE = Path(__file__).parent

SUITE = """
import time
import pytest

def test_quick():
    time.sleep(0.01)

@pytest.mark.slow
def test_marked_slow():
    time.sleep(0.3)
"""


def run(pytester, *args, **tests):
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\ntestpaths = .\n")
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(HERE)!r})\npytest_plugins = ['suite_time']\n")
    pytester.makepyfile(**tests)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


def test_a_long_test_without_the_mark_fails_saying_so(pytester):
    result = run(pytester, "-o", "slow_after=0.1", "-o", "slow_share=0.99",
                 test_long="import time\n\ndef test_long():\n    time.sleep(0.3)\n")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_long took 0.3 s (setup and call, 0.0 s of Inductor*s cold compile not counted) without the slow mark;"
                                 " accepted: under 0.1 s, or @pytest.mark.slow*"])


def test_the_slow_share_of_a_whole_run_is_bounded(pytester):
    result = run(pytester, "-o", "slow_after=0.1", test_suite=SUITE)
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["suite time: slow-marked tests 0 s of 0 s of test time, Inductor*s cold compiles apart (9?%; accepted: under 33%)",
                                 "suite time: too much of the run is marked slow*"])
    # a part of the suite (here: -k) may be all slow tests: the line only
    partial = run(pytester, "-o", "slow_after=0.1", "-k", "slow or quick", test_suite=SUITE)
    assert partial.ret == pytest.ExitCode.OK
    partial.stdout.fnmatch_lines(["suite time: slow-marked tests*"])
    # within the share, a whole run passes
    assert run(pytester, "-o", "slow_after=0.1", "-o", "slow_share=0.99", test_suite=SUITE).ret == pytest.ExitCode.OK
