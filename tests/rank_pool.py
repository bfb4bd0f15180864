"""Gloo ranks kept alive for a whole test session, standing in for `torchrun --standalone` and
`torch.multiprocessing.spawn`: each call runs `python -m mixprec ...` (or a script, or a function) on every rank
at once, in the environment torchrun gives its workers, and returns what torchrun would (exit code, stdout,
stderr), or raises as spawn would.

A fresh interpreter pays about 3 s of imports a rank (torch, torch.distributed, DTensor, dynamo, mixprec's
trainer) and torchrun's agent 1.5 s more: most of a small distributed test. A pool pays them once per test
worker, as PyTorch's own MultiProcessTestCase keeps its ranks for a class. Each call gets a fresh process group
(a new port, a new TORCHELASTIC_RUN_ID, so mixprec.distributed.elastic's store namespace is new), its own
environment and sys.argv, torch._dynamo reset afterwards, and os._exit turned into a return (mixprec leaves its
process group that way under torchrun). A rank that fails, or that has not finished within the timeout, ends
the pool, as torchrun's agent ends the other workers when one fails: they may be waiting in a collective. The
next call starts a fresh pool. The tests that need torchrun itself (restarts, rendezvous, a documented command
line) still start it."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
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
        self.world, self.procs, self.conns = world, [], []

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        for rank in range(self.world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, rank, self.world, os.getpid()))
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

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.join()
        self.procs, self.conns = [], []

    def run(self, kind: str, target, args: list[str], env: dict[str, str],
            timeout: float) -> subprocess.CompletedProcess:
        if not self.procs:
            self.start()
        env = {"MASTER_PORT": str(_free_port()), "TORCHELASTIC_RUN_ID": uuid.uuid4().hex, **env}
        with tempfile.TemporaryDirectory() as out:
            for conn in self.conns:
                conn.send((kind, target, args, env, out, sys.path))
            codes = self._wait(timeout)
            stdout = "".join(_read(f"{out}/{r}.out") for r in range(self.world))
            stderr = "".join(_read(f"{out}/{r}.err") for r in range(self.world))
        if None in codes:
            stderr += f"\nrank_pool: ranks {[r for r, c in enumerate(codes) if c is None]} did not finish\n"
            self.kill()  # a rank left behind may wait in a collective forever
        failed = any(c != 0 for c in codes)
        return subprocess.CompletedProcess([kind, target, *args], 1 if failed else 0, stdout, stderr)

    def _wait(self, timeout: float) -> list[int | None]:
        """Every rank's exit code; None for a rank that had not finished by the timeout, or within a few
        seconds of another rank's failure (torchrun's agent would end it then)."""
        codes: list[int | None] = [None] * self.world
        deadline = time.monotonic() + timeout
        waiting = dict(zip(self.conns, range(self.world)))
        while waiting:
            ready = wait(list(waiting), max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = waiting.pop(conn)
                try:
                    codes[rank] = conn.recv()
                except (EOFError, OSError):  # the process died
                    codes[rank] = 1
                if codes[rank] != 0:
                    deadline = min(deadline, time.monotonic() + 5)
        return codes


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


class _Exit(BaseException):
    def __init__(self, code: int):
        self.code = code


def _serve(conn, rank: int, world: int, parent: int) -> None:
    """A rank: torchrun's worker environment, the imports paid once, then one call after another."""
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
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
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
