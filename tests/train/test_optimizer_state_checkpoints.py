"""8-bit optimizer states through the trainer's checkpoints: a run killed with SIGKILL resumes
bit for bit; a checkpoint of another state format is refused in one line (nothing saved
changes) or converted when asked."""

import hashlib
import json
import subprocess
import sys

from tests.conftest import kill_9_after, run_train, tiny_args
from tests.test_cli import one_line_error


def _records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_run_killed_with_sigkill_resumes_its_8bit_moments_bit_for_bit(tmp_path, text_file):
    flags = ("--training.steps", "12", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0",
             "--precision.preset", "bf16-kahan-8bit")
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_train(full, text_file, *flags)
    cmd = [sys.executable, "-m", "mixprec", *tiny_args(cut, text_file, *flags)]
    kill_9_after(cmd, cut / "checkpoint" / "step-8.pt")
    assert (cut / "checkpoint" / "step-8.pt").exists() and not (cut / "checkpoint" / "step-12.pt").exists()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    keys = ("step", "loss", "grad_norm", "val_loss")
    assert [[r.get(k) for k in keys] for r in _records(cut)] == [[r.get(k) for k in keys] for r in _records(full)]


def test_another_state_format_is_refused_in_one_line_or_converted_when_asked(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    run_train(run, text_file, "--precision.preset", "bf16-mixed-8bit", "--training.steps", "4")
    saved = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (run / "checkpoint").iterdir()}
    err = one_line_error(capsys, tiny_args(run, text_file, "--precision.preset", "bf16-mixed-8bit",
                                           "--precision.optimizer_states", "fp8", "--training.steps", "8"))
    assert "saved with 8bit (blocks of 256) moments, this run keeps fp8 (blocks of 256)" in err
    assert "checkpoint.convert_optimizer_states" in err
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (run / "checkpoint").iterdir()} == saved
    records = run_train(run, text_file, "--precision.preset", "bf16-mixed-8bit", "--precision.optimizer_states",
                        "fp8", "--training.steps", "8", "--checkpoint.convert_optimizer_states", "true")
    assert [r["step"] for r in records if "loss" in r][-1] == 8


def test_8bit_moments_resumed_under_torch_adamw_are_refused_or_dequantized(tmp_path, text_file, capsys):
    """The other direction: bf16-mixed keeps torch's AdamW, which would load the 8-bit codes as moments."""
    import torch

    run = tmp_path / "run"
    run_train(run, text_file, "--precision.preset", "bf16-mixed-8bit", "--training.steps", "4")
    saved = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (run / "checkpoint").iterdir()}
    err = one_line_error(capsys, tiny_args(run, text_file, "--precision.preset", "bf16-mixed", "--training.steps", "8"))
    assert "saved with 8bit (blocks of 256) moments, this run's AdamW keeps dense moments" in err
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (run / "checkpoint").iterdir()} == saved
    records = run_train(run, text_file, "--precision.preset", "bf16-mixed", "--training.steps", "8",
                        "--checkpoint.convert_optimizer_states", "true")
    assert [r["step"] for r in records if "loss" in r][-1] == 8
    state = torch.load(run / "checkpoint" / "step-8.pt", weights_only=False)["optimizer"]["state"]
    moments = [e["exp_avg_sq"] for e in state.values()]
    assert all(m.dtype == torch.float32 for m in moments) and max(float(m.max()) for m in moments) < 1.0
