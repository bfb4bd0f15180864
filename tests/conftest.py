import inspect
import json
from pathlib import Path

import pytest

from mixprec.cli import main

pytest_plugins = ["suite_time"]  # the slow mark's rules (tests/suite_time.py)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """About 300 KB of real text: the sources of a few standard-library modules."""
    import argparse, difflib, json as json_mod, pathlib, textwrap  # noqa: E401

    text = "\n".join(inspect.getsource(m) for m in (argparse, difflib, json_mod.decoder, pathlib, textwrap))
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(text)
    return path


def tiny_args(folder: Path, source: Path, *extra: str) -> list[str]:
    """`mixprec train` arguments for the debug flavor: a few steps in a second or two."""
    return ["train", "--model.flavor", "debug", "--data.source", str(source), "--job.dump_folder", str(folder),
            "--training.steps", "6", "--training.seq_len", "32", "--training.local_batch_size", "4",
            "--training.warmup_steps", "2", "--training.eval_interval", "3", "--training.eval_batches", "2",
            "--metrics.progress_bar", "false", "--metrics.plot", "false", "--training.device", "cpu", *extra]


def tiny_qwen3_moe(folder: Path) -> Path:
    """A transformers Qwen3-MoE config.json of moe-debug's size (8 experts, 2 a token) in `folder`."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=64)))
    return folder


def run_train(folder: Path, source: Path, *extra: str) -> list[dict]:
    """Train and return the records of metrics.jsonl."""
    assert main(tiny_args(folder, source, *extra)) == 0
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def once_per_run(tmp_path_factory, name: str, compute) -> dict:
    """compute(path) writes a JSON file at `path`: done once for the whole run and read by every test worker
    (pytest-xdist's workers share the run's base temporary folder; one computes while the others wait on its
    lock), so a long fixture whose results do not depend on the worker is not computed on each."""
    import fcntl
    import os

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the parent: this run's, not pytest's
    path = shared / f"once-{name}.json"
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.is_file():
            compute(path)
    return json.loads(path.read_text())


def kill_9_after(cmd: list[str], saved: Path, timeout: float = 240) -> None:
    """Start `cmd` and SIGKILL it as soon as the file `saved` exists (or it ended, or `timeout`)."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not saved.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


class Payload:
    """What a hostile checkpoint may hold: unpickling it runs code (here: creates a file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def pytest_configure(config):
    """Under pytest-xdist (the README's command runs two workers on two cores), one thread per
    worker: two workers of two threads each would oversubscribe the cores."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped where there is no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _mixprec_logs_reach_caplog():
    """The command line stops mixprec's logger propagating (it prints its own lines); a test
    that ran it must not hide later tests' log records from caplog."""
    import logging

    yield
    logging.getLogger("mixprec").propagate = True


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """torch's CPU scaled GEMM taken wherever it agrees with the emulation, whatever its speed here (where it is
    oneDNN's reference code, as on AMX CPUs, mixprec.narrow.gemm.fp8.route_on emulates): for the tests of the
    kernel path itself."""
    from mixprec.narrow.gemm import fp8 as gemm

    monkeypatch.setattr(gemm, "cpu_speed", lambda *args: None)
