import logging

from mixprec.precision.monitor import ScaleMonitor


def test_overflow_lines_are_summarised_not_flooded(caplog):
    monitor = ScaleMonitor(verbose=3, summary_every=10)
    with caplog.at_level(logging.INFO, logger="mixprec"):
        for step in range(1, 31):
            monitor.record(step, overflow=True, before=2.0, after=1.0, growth_interval=2000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "[OVERFLOW] step 1: loss scale 2 -> 1 (overflow 1/1)"
    assert sum("[OVERFLOW] step " in line for line in lines) == 3
    summaries = [line for line in lines if line.startswith("[OVERFLOW] steps")]
    assert summaries == ["[OVERFLOW] steps 4-10: 7 overflows, loss scale now 1 (overflow 10/10)",
                         "[OVERFLOW] steps 11-20: 10 overflows, loss scale now 1 (overflow 20/20)",
                         "[OVERFLOW] steps 21-30: 10 overflows, loss scale now 1 (overflow 30/30)"]
    assert monitor.overflows == monitor.consecutive == 30


def test_growth_is_logged_and_clean_steps_reset_the_run(caplog):
    monitor = ScaleMonitor()
    with caplog.at_level(logging.INFO, logger="mixprec"):
        monitor.record(1, True, 4.0, 2.0, 3)
        monitor.record(2, False, 2.0, 4.0, 3)
    assert "[SCALE] loss scale 2 -> 4 after 3 clean steps" in caplog.text
    assert monitor.consecutive == 0 and monitor.overflows == 1
