"""Activation checkpointing, torch.compile and the chunked loss in the trainer, on the CPU
(tests/test_gpu.py runs the same on CUDA)."""

import json

import pytest
import torch

from conftest import run_train
from mixprec.train.parallelize import _backward_outside_autocast, checkpointed_blocks


def losses(records):
    return [r["loss"] for r in records]


def test_checkpointed_blocks():
    assert checkpointed_blocks(4, "none") == []
    assert checkpointed_blocks(4, "selective") == [1, 3]  # every other block, as the planner counts
    assert checkpointed_blocks(5, "selective") == [1, 3]
    assert checkpointed_blocks(3, "full") == [0, 1, 2]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_recomputes_the_same_numbers(tmp_path, text_file, mode):
    # the recompute runs the same kernels on the same inputs: bitwise equal losses
    base = run_train(tmp_path / "none", text_file, "--precision.preset", "bf16-mixed")
    ac = run_train(tmp_path / mode, text_file, "--precision.preset", "bf16-mixed", "--activation_checkpoint.mode", mode)
    assert losses(ac) == losses(base)
    assert [r["grad_norm"] for r in ac] == [r["grad_norm"] for r in base]


def test_chunked_loss_trains_like_the_full_loss(tmp_path, text_file):
    full = run_train(tmp_path / "full", text_file, "--precision.preset", "fp32", "--model.loss", "full")
    chunked = run_train(tmp_path / "chunked", text_file, "--precision.preset", "fp32", "--model.loss", "chunked")
    for a, b in zip(losses(full), losses(chunked)):
        assert abs(a - b) / a < 1e-5
    # a checkpoint made under one loss resumes under the other (it is how, not what, the model computes)
    assert run_train(tmp_path / "full", text_file, "--precision.preset", "fp32", "--model.loss", "chunked",
                     "--training.steps", "8")[-1]["step"] == 8


@pytest.mark.slow
def test_compiled_fp32_matches_eager_and_resumes_uncompiled(tmp_path, text_file, capsys):
    eager = run_train(tmp_path / "eager", text_file, "--precision.preset", "fp32")
    capsys.readouterr()
    compiled = run_train(tmp_path / "compiled", text_file, "--precision.preset", "fp32", "--compile.enable",
                         "--activation_checkpoint.mode", "selective", "--model.loss", "chunked")
    assert "compile: torch.compile (Inductor) applied" in capsys.readouterr().out
    for a, b in zip(losses(eager), losses(compiled)):
        assert abs(a - b) / a < 1e-4  # Inductor fuses and reorders: not bitwise
    # parameter names do not change under compile: the checkpoint resumes eager
    resumed = run_train(tmp_path / "compiled", text_file, "--precision.preset", "fp32", "--training.steps", "8")
    assert [r["step"] for r in resumed][-2:] == [7, 8]
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["final_val_loss"] < losses(eager)[0]


def test_compile_says_why_it_stays_eager_where_matmuls_are_emulated(tmp_path, text_file, capsys):
    # emulation is forced: it is the default only on CPUs without native BF16 kernels
    run_train(tmp_path / "run", text_file, "--precision.preset", "bf16-mixed", "--precision.emulate_matmul", "true",
              "--compile.enable")
    assert "compile: running eager: bf16-mixed emulates its bfloat16 matmuls on this cpu" in capsys.readouterr().out


def test_a_compiled_backward_runs_outside_autocast_as_eager_does():
    """pytorch#153044: a compiled region's backward traced under the forward's autocast
    runs an FP32 region's backward matmul in float16, where 128000 overflows."""
    import torch._functorch.config as functorch_config

    w = torch.nn.Parameter(torch.full((64, 64), 2000.0))

    def region(x):
        with torch.autocast("cpu", enabled=False):
            return x.float() @ w.t()

    def grad(fn):
        x = torch.ones(64, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = fn(x)
        out.sum().backward()
        return x.grad

    eager = grad(region)
    assert torch.isfinite(eager).all() and eager.max() == 128000
    previous = functorch_config.backward_pass_autocast
    try:
        functorch_config.backward_pass_autocast = "same_as_forward"  # the trap, as torch <= 2.13 ships it
        torch._dynamo.reset()
        assert not torch.isfinite(grad(torch.compile(region))).all()
        _backward_outside_autocast()  # what apply_compile does
        torch._dynamo.reset()
        assert torch.equal(grad(torch.compile(region)), eager)
    finally:
        functorch_config.backward_pass_autocast = previous
        torch._dynamo.reset()
