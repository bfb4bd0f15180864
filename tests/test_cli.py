"""The command line: its surface is frozen, bad input is one line and exit code 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_args
from mixprec.cli import build_parser, main

# Changing this list changes what users type: update docs/cli.md with it.
SURFACE = """
--config
--job.dump_folder --job.description
--model.flavor --model.n_kv_heads --model.tie_embeddings --model.attention --model.loss --model.balance --model.hf_config
--data.source --data.tokenizer --data.bpe_vocab_size --data.val_fraction
--training.steps --training.seq_len --training.local_batch_size --training.global_batch_size --training.lr
--training.warmup_steps --training.min_lr_factor --training.weight_decay --training.beta1 --training.beta2 --training.eps
--training.max_norm --training.seed --training.device --training.eval_interval --training.eval_batches
--training.early_stopping_patience --training.dtype --training.mixed_precision_param
--training.mixed_precision_reduce
--precision.preset --precision.param_dtype --precision.reduce_dtype --precision.storage_dtype
--precision.emulate_matmul --precision.override --precision.plan --precision.optimizer_states
--precision.optimizer_state_block --precision.optimizer_state_min_size --precision.optimizer_state_embeddings
--precision.tf32
--fp8.recipe --fp8.filter_fqns --fp8.amax_history_len --fp8.amax_compute_algo --fp8.margin --fp8.emulate
--fp8.grad_format --fp8.scale_rounding --fp8.weight_2d --fp8.stochastic_gradients --fp8.hadamard --fp8.four_over_six
--fp8.keep_last_blocks
--loss_scale.init_scale --loss_scale.growth_factor --loss_scale.backoff_factor --loss_scale.growth_interval
--loss_scale.min_scale --loss_scale.max_scale --loss_scale.hysteresis --loss_scale.fallback_after
--loss_scale.fallback_to
--parallelism.data_parallel_replicate_degree --parallelism.data_parallel_shard_degree
--parallelism.tensor_parallel_degree --parallelism.pipeline_parallel_degree --parallelism.fsdp_reshard_after_forward
--parallelism.enable_cpu_offload --parallelism.lowp_all_gather --parallelism.expert_parallel_degree
--parallelism.expert_dispatch --parallelism.timeout_s
--activation_checkpoint.mode
--compile.enable --compile.components
--checkpoint.enable --checkpoint.folder --checkpoint.convert_optimizer_states --checkpoint.interval --checkpoint.keep_latest_k --checkpoint.load_step
--checkpoint.initial_load
--metrics.log_freq --metrics.enable_tensorboard --metrics.plot --metrics.progress_bar
--stability.enable --stability.window --stability.threshold --stability.snapshot_interval --stability.max_rewinds
--stability.lr_backoff --stability.backoff_steps --stability.inject
--compare.max_loss_diff --compare.max_perplexity_diff --compare.max_overflow_rate
--plan.out --plan.steps --plan.measure_steps --plan.candidates --plan.objective --plan.target
--plan.forward_floor_db --plan.gradient_floor_db --plan.interval --plan.max_lost --plan.min_expert_tokens
""".split()


def test_cli_surface_is_frozen():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    flags = [o for a in train._actions for o in a.option_strings if o not in ("-h", "--help")]
    assert flags == SURFACE


def test_commands():
    sub = build_parser()._subparsers._group_actions[0].choices
    assert sorted(sub) == ["analyze", "audit", "compare", "demo", "export", "formats", "generate", "memory", "plan",
                           "prepare", "serve-gap", "train"]


def test_help_lists_every_key_with_doc_and_default():
    text = subprocess.run([sys.executable, "-m", "mixprec", "train", "--help"], capture_output=True, text=True,
                          check=True).stdout
    for flag in SURFACE:
        assert flag in text
    assert "default: 'bf16-mixed'" not in text  # the preset's default is empty: built from the dtype keys
    assert "Peak learning rate of AdamW. (default: 0.001)" in " ".join(text.split())


def one_line_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        code = main(argv)
        raise SystemExit(code)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("extra, words", [
    (["--model.flavr", "debug"], ["--model.flavr", "did you mean --model.flavor"]),
    (["--training.steps", "ten"], ["training.steps", "'ten'", "an integer"]),
    (["--training.steps", "0"], ["training.steps", "positive"]),
    (["--precision.preset", "fp8"], ["fp8", "accepted"]),
    (["--precision.param_dtype", "bfloat17"], ["bfloat17", "accepted"]),
    (["--precision.preset", "bf16-mixed", "--training.mixed_precision_param", "float32"],
     ["precision.preset", "training.mixed_precision_param"]),
    (["--training.global_batch_size", "6"], ["global_batch_size", "multiple of local_batch_size"]),
    (["--training.seq_len", "1024"], ["seq_len", "max_seq_len"]),
    (["--model.flavor", "huge"], ["huge", "accepted"]),
    (["--loss_scale.growth_factor", "1.0"], ["loss_scale.growth_factor", "> 1"]),
    (["--loss_scale.backoff_factor", "1.5"], ["loss_scale.backoff_factor", "(0, 1)"]),
    (["--loss_scale.min_scale", "8", "--loss_scale.max_scale", "4"], ["min_scale", "max_scale"]),
    (["--loss_scale.init_scale", "1e30"], ["loss_scale.init_scale", "[min_scale, max_scale]"]),
    (["--loss_scale.fallback_to", "fp8"], ["loss_scale.fallback_to", "fp32, bf16-mixed"]),
    (["--training.lr", "inf"], ["training.lr", "finite"]),
    (["--training.lr", "nan"], ["training.lr", "not NaN"]),
    (["--training.eps", "-1"], ["training.eps", "positive finite"]),
    (["--training.max_norm", "inf"], ["training.max_norm", "finite"]),
    (["--data.source", "~nosuchuser_mixprec/corpus"], ["data.source", "home folder"]),
    (["--compile.components", "model,optimizer"], ["compile.components", "model, loss"]),
    (["--activation_checkpoint.mode", "2"], ["activation_checkpoint.mode", "none, selective, full"]),
])
def test_bad_values(tmp_path, text_file, capsys, extra, words):
    err = one_line_error(capsys, tiny_args(tmp_path / "r", text_file, *extra))
    assert all(w in err for w in words), err
    assert not (tmp_path / "r").exists()  # nothing written


def test_bad_data_paths(tmp_path, text_file, capsys):
    err = one_line_error(capsys, tiny_args(tmp_path / "r", tmp_path / "nope"))
    assert "does not exist" in err
    (tmp_path / "empty").mkdir()
    assert "no UTF-8 text" in one_line_error(capsys, tiny_args(tmp_path / "r", tmp_path / "empty"))
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n" * 3)
    assert "shorter than one sequence" in one_line_error(capsys, tiny_args(tmp_path / "r", short))


def test_bad_config_files(tmp_path, text_file, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3")
    assert "not valid TOML" in one_line_error(capsys, tiny_args(tmp_path / "r", text_file, "--config", str(bad)))
    bad.write_text("[optimiser]\nlr = 1.0\n")
    assert "unknown config table [optimiser]" in one_line_error(
        capsys, tiny_args(tmp_path / "r", text_file, "--config", str(bad)))
    bad.write_text("[training]\nstep = 3\n")
    assert "unknown config key training.step" in one_line_error(
        capsys, tiny_args(tmp_path / "r", text_file, "--config", str(bad)))
    bad.write_text('[training]\nlr = "fast"\n')
    assert "training.lr" in one_line_error(capsys, tiny_args(tmp_path / "r", text_file, "--config", str(bad)))


def test_corrupt_and_mismatched_checkpoints_keep_what_is_saved(tmp_path, text_file, capsys):
    folder = tmp_path / "run"
    assert main(tiny_args(folder, text_file, "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0")) == 0
    saved = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    # A model that does not match the checkpoint.
    err = one_line_error(capsys, tiny_args(folder, text_file, "--model.n_kv_heads", "4", "--training.steps", "9"))
    assert "does not match" in err and "n_kv_heads" in err
    # A truncated checkpoint.
    ckpt = folder / "checkpoint" / "step-6.pt"
    ckpt.write_bytes(saved["step-6.pt"][:1000])
    err = one_line_error(capsys, tiny_args(folder, text_file, "--training.steps", "9"))
    assert "corrupt" in err and "step-6.pt" in err
    ckpt.write_bytes(saved["step-6.pt"])
    assert "no checkpoint at that step" in one_line_error(
        capsys, tiny_args(folder, text_file, "--checkpoint.load_step", "5"))
    after = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert after == saved


def test_python_dash_m_exit_code():
    proc = subprocess.run([sys.executable, "-m", "mixprec", "train", "--training.steps", "-1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "training.steps" in proc.stderr


def test_unwritable_run_and_checkpoint_folders_fail_before_any_work(tmp_path, text_file, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    cases = [
        ([], afile, "is a file"),  # job.dump_folder is an existing file
        ([], afile / "run", "is inside"),  # its parent is a file
        ([], tmp_path / ("x" * 300), "bytes"),  # a name longer than the file system takes
        ([], Path("/proc/mixprec-run"), "cannot write"),  # a folder nobody can create files in
    ]
    for extra, folder, words in cases:
        err = one_line_error(capsys, tiny_args(folder, text_file, *extra))
        assert words in err and "job.dump_folder" in err, err
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint").write_text("a file where the checkpoint folder goes")
    err = one_line_error(capsys, tiny_args(run, text_file))
    assert "checkpoint.folder" in err and "is a file" in err
    assert afile.read_text() == "keep me" and (run / "checkpoint").is_file()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint"]  # nothing was written


@pytest.mark.parametrize("damage, words", [
    (lambda s: s["model"].update({"layers.0.attention.wq.weight": torch.zeros(3, 3)}), "size mismatch"),
    (lambda s: s["optimizer"]["param_groups"].pop(), "parameter group"),
    (lambda s: s.pop("step"), "lacks step"),
    (lambda s: s.pop("rng"), "lacks rng"),
    (lambda s: s.update(meta="not a dict"), "does not match"),
])
def test_damaged_checkpoints_are_one_line_and_left_alone(tmp_path, text_file, capsys, damage, words):
    folder = tmp_path / "run"
    assert main(tiny_args(folder, text_file, "--training.steps", "3")) == 0
    ckpt = folder / "checkpoint" / "step-3.pt"
    state = torch.load(ckpt, weights_only=True)
    damage(state)
    torch.save(state, ckpt)
    saved = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    err = one_line_error(capsys, tiny_args(folder, text_file))
    assert words in err and "step-3.pt" in err, err
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == saved


def test_a_mismatch_names_the_file_that_mismatched(tmp_path, text_file, capsys):
    folder = tmp_path / "run"
    assert main(tiny_args(folder, text_file, "--training.steps", "3")) == 0
    (folder / "checkpoint" / "step-3.pt").rename(folder / "checkpoint" / "step-5.pt")  # content says step 3
    err = one_line_error(capsys, tiny_args(folder, text_file, "--model.n_kv_heads", "4", "--training.steps", "9"))
    assert "step-5.pt" in err and "n_kv_heads" in err


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path, text_file):
    folder = tmp_path / "run"
    assert main(tiny_args(folder, text_file, "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0")) == 0
    (folder / "checkpoint" / "step-6.pt").unlink()
    metrics = folder / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:4]) + "\n" + lines[4][:17])  # killed while writing step 5
    assert main(tiny_args(folder, text_file)) == 0
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_out_of_memory_is_one_line_with_the_plan(tmp_path, text_file):
    """The 8B flavor in a process capped at 12 GiB of address space."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (12 * 2**30, 12 * 2**30))

    proc = subprocess.run([sys.executable, "-m", "mixprec", *tiny_args(tmp_path / "r", text_file, "--model.flavor",
                                                                      "8B")[0:1], *tiny_args(tmp_path / "r", text_file,
                                                                                             "--model.flavor", "8B")[1:]],
                          preexec_fn=cap, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr[-2000:]
    assert "out of memory" in proc.stderr and "GiB per device" in proc.stderr and "8B" in proc.stderr


def test_help_parses_before_torch_loads():
    code = ("import sys; from mixprec.cli import build_parser; build_parser().format_help(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_commands_with_options_show_them_first():
    text = subprocess.run([sys.executable, "-m", "mixprec", "compare", "--help"], capture_output=True, text=True,
                          check=True).stdout
    assert text.index("--presets") < text.index("--config") < text.index("[job]") < text.index("--job.dump_folder")
    assert text.splitlines()[0].startswith("usage: mixprec compare [-h] [--presets")
