"""The command line on a Hugging Face causal LM from a local config.json (transformers
installed, tiny configs written here, nothing downloaded)."""

import json
import sys

import pytest
import torch

from conftest import run_train, tiny_args
from mixprec.cli import main

transformers = pytest.importorskip("transformers")


def write(tmp_path, config) -> str:
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    return str(path)


def llama(tmp_path, vocab=256):
    return write(tmp_path, transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=176,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                    max_position_embeddings=128))


def gpt2(tmp_path):
    # GPT-2's default dropout (0.1) draws each rank's masks from its own generator: two ranks
    # then compute another function than one process (measured: losses 0.16% apart), so off
    return write(tmp_path, transformers.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=2,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def qwen2(tmp_path):
    return write(tmp_path, transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=176,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                    max_position_embeddings=128))


CONFIGS = {"llama": llama, "gpt2": gpt2, "qwen2": qwen2}
# a module deep in each architecture's second decoder layer, by its name in the trainer's model
MLP_OUT = {"llama": "hf.model.layers.1.mlp.down_proj", "gpt2": "hf.transformer.h.1.mlp.c_proj",
           "qwen2": "hf.model.layers.1.mlp.down_proj"}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_train_resume_and_audit_a_transformers_config(tmp_path, text_file, capsys, arch):
    config = {"llama": llama, "gpt2": gpt2}[arch](tmp_path)
    flags = ("--model.hf_config", config, "--precision.preset", "bf16-mixed", "--checkpoint.interval", "3",
             "--checkpoint.keep_latest_k", "0")
    full = run_train(tmp_path / "run", text_file, *flags)
    assert len(full) == 6 and full[-1]["loss"] < full[0]["loss"]
    (tmp_path / "run" / "checkpoint" / "step-6.pt").unlink()
    resumed = run_train(tmp_path / "run", text_file, *flags)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]  # resumed at step 3, bit for bit
    capsys.readouterr()
    args = tiny_args(tmp_path / "unused", text_file, "--model.hf_config", config, "--precision.preset", "fp16-mixed")
    args[0] = "audit"
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]


def test_bad_hf_configs_are_one_line_and_exit_2(tmp_path, text_file, capsys):
    def refused(config, *extra):
        assert main(tiny_args(tmp_path / "r", text_file, "--model.hf_config", str(config), *extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        return err[-1]

    assert "no file" in refused(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    assert "is not JSON" in refused(tmp_path / "bad.json")
    (tmp_path / "untyped.json").write_text(json.dumps({"hidden_size": 64}))
    assert "has no model_type" in refused(tmp_path / "untyped.json")
    vit = tmp_path / "vit"
    vit.mkdir()
    write(vit, transformers.ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2))
    assert "'vit' is not a causal language model" in refused(vit)
    small = tmp_path / "small"
    small.mkdir()
    assert "tokenizer has 256 token ids but the config's vocab_size is 100" in refused(llama(small, vocab=100))
    assert "model.loss chunked: not supported" in refused(llama(tmp_path), "--model.loss", "chunked")
    assert not (tmp_path / "r" / "checkpoint").exists()  # nothing was written


@pytest.mark.slow
def test_compare_two_presets_on_a_transformers_config(tmp_path, text_file):
    args = tiny_args(tmp_path / "cmp", text_file, "--model.hf_config", llama(tmp_path))
    assert main(["compare", "--presets", "fp32,bf16-mixed", *args[1:]]) == 0
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [p["passed"] for p in report["presets"]] == [True, True]


@pytest.mark.parametrize("arch", CONFIGS)
def test_fsdp2_on_two_ranks_matches_one_process_in_fp32(tmp_path, text_file, arch):
    import rank_pool

    config = CONFIGS[arch](tmp_path)
    flags = ("--model.hf_config", config, "--precision.preset", "fp32", "--checkpoint.enable", "false")
    single = run_train(tmp_path / "one", text_file, *flags)
    args = tiny_args(tmp_path / "two", text_file, *flags, "--training.local_batch_size", "2",
                     "--parallelism.data_parallel_shard_degree", "2")
    proc = rank_pool.torchrun("-m", "mixprec", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(sharded) == len(single)
    for a, b in zip(sharded, single):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-5


@pytest.mark.slow  # cold (an empty Inductor cache) over 20 s beyond its code generation
def test_activation_checkpointing_and_compile_per_decoder_layer(tmp_path, text_file):
    config = llama(tmp_path)
    flags = ("--model.hf_config", config, "--precision.preset", "fp32", "--checkpoint.enable", "false")
    plain = run_train(tmp_path / "plain", text_file, *flags)
    recomputed = run_train(tmp_path / "ac", text_file, *flags, "--activation_checkpoint.mode", "full")
    assert [r["loss"] for r in recomputed] == [r["loss"] for r in plain]  # recomputation changes no bit
    compiled = run_train(tmp_path / "compiled", text_file, *flags, "--compile.enable", "--activation_checkpoint.mode",
                         "selective")
    for a, b in zip(compiled, plain):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-4  # Inductor reorders sums


@pytest.mark.parametrize("arch", CONFIGS)
def test_a_nan_drill_in_a_decoder_module_is_located_and_skipped(tmp_path, text_file, arch):
    module = MLP_OUT[arch]
    assert main(tiny_args(tmp_path / "run", text_file, "--model.hf_config", CONFIGS[arch](tmp_path),
                          "--training.steps", "12", "--stability.window", "8", "--stability.threshold", "25",
                          "--stability.snapshot_interval", "4", "--stability.inject", f"nan@10:{module}")) == 0
    (incident,) = json.loads((tmp_path / "run" / "summary.json").read_text())["stability"]["incident_log"]
    # the policy skipped the step and the state stayed finite: that batch is all it cost
    assert incident["finding"]["module"] == module and "rewound_to" not in incident
    assert incident["action"].startswith("skipped")


def test_mixprec_memory_plans_a_transformers_config(tmp_path, capsys):
    import sys
    from pathlib import Path

    import torch

    from mixprec.models.hf import HFCausalLM, load_hf_config

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from any_model import measured_peak

    config = llama(tmp_path)
    assert main(["memory", "--hf-config", config, "--preset", "bf16-mixed", "--batch", "2", "--seq-len", "32",
                 "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["peak_bytes"]
    tokens = torch.zeros(2, 32, dtype=torch.long)
    measured = measured_peak(lambda: HFCausalLM(load_hf_config(config)), "bf16-mixed", (tokens, tokens))
    assert abs(planned / measured - 1) < 0.02
    assert main(["memory", "--hf-config", config, "--tp", "2"]) == 2
    assert "--tp 2: not planned yet" in capsys.readouterr().err


# torch 2.11 (the GPU image's), on this CPU: the planner gave 10,436,400 bytes for both presets, the real step
# under the fake process group 4,110,051 (fp32) and 4,542,344 (bf16-mixed): the plan is off there, not settled
OLD_FSDP_PLAN = pytest.mark.xfail(torch.__version__ < "2.13", strict=True,
                                  reason="torch < 2.13: the FSDP2 memory plan is about twice the real step's peak")


@pytest.mark.slow
@OLD_FSDP_PLAN
@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed"])
def test_planned_memory_under_fsdp2_is_the_real_steps_and_gloo_adds_one_reduce_scatter_output(tmp_path, capsys,
                                                                                            preset):
    # The planner runs the step on fake tensors under a fake process group. The same step on
    # real tensors under that process group peaks at the planned bytes (byte for byte here,
    # 2026-11-26, AVX512). On two gloo ranks it peaks higher by what gloo's reduce-scatter
    # allocates for itself while it runs: a rank's shard of a unit's FP32 gradients on this
    # machine (369,152 of 5,402,332 bytes under bf16-mixed, whose peak is in the backward), a
    # whole unit's on another (the test of 64-wide layers there: planned/measured 0.891,
    # where 0.942 here); under fp32 the peak is the forward's and the buffer adds nothing.
    # NCCL writes the output in place: the planner plans the program, not gloo's copies.
    import functools
    import sys
    from pathlib import Path

    import torch

    from mixprec.models.hf import HFCausalLM, load_hf_config

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from any_model import measured_peak

    config = write(tmp_path, transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=128))
    assert main(["memory", "--hf-config", config, "--preset", preset, "--batch", "4", "--seq-len", "16",
                 "--dp-shard", "2", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["peak_bytes"]
    tokens = torch.zeros(4, 16, dtype=torch.long)
    build = functools.partial(HFCausalLM, load_hf_config(config))  # picklable: each rank builds its own
    real = measured_peak(build, preset, (tokens, tokens), dp_shard=2, backend="fake")
    assert abs(real - planned) <= 1e-3 * planned, (real, planned)
    unit = max(sum(p.numel() for p in layer.parameters()) for layer in build().hf.model.layers)
    shard = unit * 4 // 2  # the reduce-scatter's FP32 output on each of 2 ranks
    gap = measured_peak(build, preset, (tokens, tokens), dp_shard=2) - planned
    slack = 4096  # the allocator's 512-byte blocks, a few tensors' worth
    assert (shard if preset == "bf16-mixed" else 0) - slack <= gap <= 2 * shard + slack, (gap, shard)


def test_without_transformers_the_config_is_refused_in_one_line(tmp_path, text_file, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama"}))
    assert main(tiny_args(tmp_path / "r", text_file, "--model.hf_config", str(config))) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "needs the transformers package; accepted: pip install 'mixprec[hf]'" in line
