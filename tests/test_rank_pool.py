"""The test ranks' pool (tests/rank_pool.py) survives what a torchrun launch would not see: a rank that died
between calls is replaced before the call, and a call that fails says how (a rank's exit code, a hung rank's
stack)."""

import os
import pickle
import signal
import time

import pytest

import rank_pool

pytestmark = pytest.mark.slow  # each starts (or restarts) a pool's ranks: 10-15 s under a full run


def _hello(rank: int) -> None:
    print(f"hello from rank {rank} of {os.environ['WORLD_SIZE']}")


def _hang_on_rank_0(rank: int) -> None:
    if rank == 0:
        time.sleep(120)


def _die_on_rank_1(rank: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def pool():
    pool = rank_pool._Pool(2)
    yield pool
    pool.close()


def _call(pool, fn, timeout=60):
    return pool.run("function", pickle.dumps((fn, ())), [], {}, timeout)


def test_a_rank_dead_between_calls_is_replaced_and_the_call_runs(pool):
    assert _call(pool, _hello).returncode == 0
    pool.procs[1].kill()
    pool.procs[1].join()
    done = _call(pool, _hello)
    assert done.returncode == 0, done.stderr
    assert "hello from rank 0 of 2" in done.stdout and "hello from rank 1 of 2" in done.stdout
    assert all(p.is_alive() for p in pool.procs)


def test_a_hung_rank_is_shown_and_its_pool_ended(pool):
    assert _call(pool, _hello).returncode == 0  # the ranks started (their imports are not the call's timeout)
    done = _call(pool, _hang_on_rank_0, timeout=5)
    assert done.returncode == 1
    assert "ranks [0] did not finish within the timeout of 5 s" in done.stderr
    assert "in _hang_on_rank_0" in done.stderr  # its Python stack
    assert pool.procs == []
    assert _call(pool, _hello).returncode == 0  # the next call starts a fresh pool


def test_a_rank_killed_in_the_call_fails_it_with_its_signal(pool):
    done = _call(pool, _die_on_rank_1)
    assert done.returncode == 1
    assert f"rank 1 died during the call (exit code {-signal.SIGKILL})" in done.stderr
    assert _call(pool, _hello).returncode == 0
