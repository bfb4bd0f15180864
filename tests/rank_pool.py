"""Gloo ranks kept alive for a whole test session, standing in for `torchrun --standalone` and
`torch.multiprocessing.spawn`: each call runs `python -m mixprec ...` (or a script, or a function) on every rank
at once, in the environment torchrun gives its workers, and returns what torchrun would (exit code, stdout,
stderr), or raises as spawn would.

A fresh interpreter pays about 3 s of imports a rank (torch, torch.distributed, DTensor, dynamo, mixprec's
trainer) and torchrun's agent 1.5 s more: most of a small distributed test. A pool pays them once per test
worker, as PyTorch's own MultiProcessTestCase keeps its ranks for a class. Each call gets a fresh process group
(a new port, a new TORCHELASTIC_RUN_ID, so mixprec.distributed.elastic's store namespace is new), its own
environment and sys.argv, torch._dynamo reset afterwards, and os._exit turned into a return (mixprec leaves its
process group that way under torchrun); what a call that exits leaves behind is kept, never freed, as an exiting
process frees nothing (`_ABANDONED`). A rank that fails, or that has not finished within the timeout, ends
the pool, as torchrun's agent ends the other workers when one fails: they may be waiting in a collective. The
next call starts a fresh pool. The tests that need torchrun itself (restarts, rendezvous, a documented command
line) still start it."""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from multiprocessing.connection import wait

_POOLS: dict[int, "_Pool"] = {}


def torchrun(*argv: str, ranks: int = 2, env: dict[str, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """What `torchrun --standalone --nproc-per-node RANKS ARGV...` returns: ARGV as torchrun takes it,
    `-m module args...` or `script.py args...`; the return code 1 where any rank failed, as torchrun's."""
    argv = list(argv)
    kind, target, args = ("module", argv[1], argv[2:]) if argv[0] == "-m" else ("script", argv[0], argv[1:])
    return _pool(ranks).run(kind, target, args, env or {}, timeout)


def spawn(fn, args: tuple = (), nprocs: int = 2, timeout: float = 300) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs, join=True)`: fn(rank, *args) on every rank; raises
    with the failed ranks' output where one failed."""
    done = _pool(nprocs).run("function", pickle.dumps((fn, args)), [], {}, timeout)
    if done.returncode != 0:
        raise RuntimeError(f"a spawned rank failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def _pool(world: int) -> "_Pool":
    if world not in _POOLS:
        _POOLS[world] = _Pool(world)
    return _POOLS[world]


@atexit.register
def _close_all() -> None:
    for pool in _POOLS.values():
        pool.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pool:
    def __init__(self, world: int):
        self.world, self.procs, self.conns, self.calls = world, [], [], 0
        self.dir = tempfile.mkdtemp(prefix=f"rank_pool{world}-")
        self.logs = [f"{self.dir}/{rank}.log" for rank in range(world)]

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        for rank in range(self.world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, rank, self.world, os.getpid(), self.logs[rank]))
            proc.start()
            self.procs.append(proc)
            self.conns.append(mine)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs, self.conns = [], []
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.join()
        self.procs, self.conns, self.calls = [], [], 0

    def run(self, kind: str, target, args: list[str], env: dict[str, str],
            timeout: float) -> subprocess.CompletedProcess:
        """One call on every rank. A rank found dead before it took the call (a pool rank can die between
        calls: gloo's threads outlive a process group) is the pool's failure, not the call's: the pool is
        started afresh and the call made once more."""
        for attempt in (1, 2):
            if not self.procs or not all(p.is_alive() for p in self.procs) or self.calls >= CALLS_PER_POOL:
                self.kill()
                self.start()
            self.calls += 1
            fresh = {"MASTER_PORT": str(_free_port()), "TORCHELASTIC_RUN_ID": uuid.uuid4().hex, **env}
            with tempfile.TemporaryDirectory() as out:
                try:
                    for conn in self.conns:
                        try:
                            conn.send((kind, target, args, fresh, out, sys.path))
                        except OSError:
                            raise _Lost() from None
                    codes, why = self._wait(timeout)
                except _Lost:  # a rank died before it took the call
                    if attempt == 2:
                        raise RuntimeError(f"rank_pool: a rank died twice before taking a call:\n{self._logs()}")
                    self.kill()
                    continue
                self._dump_stacks([r for r, c in enumerate(codes) if c is None])  # into their call files
                stdout = "".join(_read(f"{out}/{r}.out") for r in range(self.world))
                stderr = "".join(_read(f"{out}/{r}.err") for r in range(self.world))
            if why:
                stderr += f"\nrank_pool: {why}\n{self._logs()}"
            if None in codes or any(not p.is_alive() for p in self.procs):
                self.kill()  # a rank left behind may wait in a collective forever
            failed = any(c != 0 for c in codes)
            return subprocess.CompletedProcess([kind, target, *args], 1 if failed else 0, stdout, stderr)

    def _wait(self, timeout: float) -> tuple[list[int | None], str]:
        """Every rank's exit code, and what went wrong in words ("" when nothing did); None for a rank that
        had not finished by the timeout, or within a few seconds of another rank's failure (torchrun's agent
        would end it then). Raises _Lost where a rank died before it took the call."""
        codes: list[int | None] = [None] * self.world
        taken = [False] * self.world
        why = []
        deadline = time.monotonic() + timeout
        waiting = dict(zip(self.conns, range(self.world)))
        while waiting:
            ready = wait(list(waiting), max(0.0, deadline - time.monotonic()))
            if not ready:
                late = [r for r, c in enumerate(codes) if c is None]
                failed = any(c not in (None, 0) for c in codes)
                why.append(f"ranks {late} did not finish " + ("within 5 s of another rank's failure" if failed
                                                              else f"within the timeout of {timeout:.0f} s"))
                break
            for conn in ready:
                rank = waiting[conn]
                try:
                    got = conn.recv()
                except (EOFError, OSError):  # the process died
                    self.procs[rank].join(1)
                    if not taken[rank]:
                        raise _Lost() from None
                    got = 1
                    why.append(f"rank {rank} died during the call (exit code {self.procs[rank].exitcode})")
                if got == "taken":
                    taken[rank] = True
                    continue
                codes[rank] = got
                waiting.pop(conn)
                if got != 0:
                    deadline = min(deadline, time.monotonic() + 5)
        return codes, "; ".join(why)

    def _dump_stacks(self, ranks: list[int]) -> None:
        """The Python stacks of these (unfinished) ranks, through faulthandler (registered on SIGUSR1 in
        _serve)."""
        for rank in ranks:
            if self.procs[rank].is_alive():
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        if ranks:
            time.sleep(1)

    def _logs(self) -> str:
        """What each rank printed outside its calls (a crash between calls lands here)."""
        return "".join(f"rank {r}'s own output (last 1500 characters):\n{_read(log)[-1500:]}\n"
                       for r, log in enumerate(self.logs) if _read(log))


class _Lost(Exception):
    """A rank died before it took a call."""


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


# What each call that ended by an exit (os._exit, sys.exit) or an exception left behind, kept whole: the exception
# holds its frames and their locals, the process group's objects among them (a DDP reducer, gloo's work and
# threads). A worker that exits frees none of them; freeing them here, when the call unwinds, ran their C++
# destructors against a process group already destroyed, and one waited for gloo's threads for ever (a rank hung
# after its call, 2026-11-28). The pool is started afresh every CALLS_PER_POOL calls, which bounds what is kept.
_ABANDONED: list[BaseException] = []
CALLS_PER_POOL = 16


class _Exit(BaseException):
    def __init__(self, code: int):
        self.code = code


def _serve(conn, rank: int, world: int, parent: int, log: str) -> None:
    """A rank: torchrun's worker environment, its own output kept in `log` (a call's goes to the call's files),
    the imports paid once, then one call after another."""
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the pool's view of a hung call
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                      OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1
    # the imports every call would otherwise pay
    import mixprec.cli  # noqa: F401
    import mixprec.train.trainer  # noqa: F401

    while True:
        while not conn.poll(2):
            if os.getppid() != parent:  # the test worker is gone
                os._exit(0)
        message = conn.recv()
        if message is None:
            break
        conn.send("taken")
        conn.send(_call(rank, *message))
    os._exit(0)  # gloo's threads may abort a finalizing interpreter (mixprec.distributed.parallel)


def _call(rank: int, kind: str, target, args: list[str], env: dict[str, str], out: str, path: list[str]) -> int:
    import logging
    import runpy
    import traceback

    saved_env, saved_argv, saved_path = dict(os.environ), sys.argv[:], sys.path[:]
    os.environ.update(env)
    sys.path[:] = path
    sys.stdout.flush()
    sys.stderr.flush()
    kept = os.dup(1), os.dup(2)
    with open(f"{out}/{rank}.out", "w") as stdout, open(f"{out}/{rank}.err", "w") as stderr:
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        real_exit = os._exit

        def leave(code):
            raise _Exit(code)

        os._exit = leave
        try:
            if kind == "module":
                sys.argv = [target, *args]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            elif kind == "script":
                sys.argv = [target, *args]
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                runpy.run_path(target, run_name="__main__")
            else:
                fn, fn_args = pickle.loads(target)
                fn(rank, *fn_args)
            code = 0
        except _Exit as e:
            code = e.code
            _ABANDONED.append(e)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            _ABANDONED.append(e)
        except BaseException as e:
            traceback.print_exc()
            code = 1
            _ABANDONED.append(e)
        finally:
            os._exit = real_exit
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(kept[0], 1)
            os.dup2(kept[1], 2)
            for fd in kept:
                os.close(fd)
    _clean()
    logging.getLogger("mixprec").handlers.clear()
    os.environ.clear()
    os.environ.update(saved_env)
    sys.argv[:], sys.path[:] = saved_argv, saved_path
    return code


def _clean() -> None:
    """What one call must not hand the next: its process group, its compiled frames."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if "torch._dynamo" in sys.modules:
        import torch._dynamo

        torch._dynamo.reset()
