"""Weights out: a run exported as a Hugging Face folder that transformers loads, its logits
against mixprec's, imported back, sampled."""

import json

import pytest
import torch

from conftest import run_train
from mixprec.cli import main
from mixprec.runs.export import export
from mixprec.runs.generate import generate, load_model


def trained(tmp_path_factory, text_file, flavor: str, preset: str, steps: int):
    """A run folder of `steps` steps with a checkpoint at the end."""
    folder = tmp_path_factory.mktemp(f"export-{flavor}") / "run"
    run_train(folder, text_file, "--precision.preset", preset, "--training.steps", str(steps),
              "--checkpoint.interval", str(steps), "--model.flavor", flavor)
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory, text_file):
    """The debug flavor, 20 steps in fp32, a checkpoint at the end."""
    return trained(tmp_path_factory, text_file, "debug", "fp32", 20)


def _logits(model, x):
    with torch.no_grad():
        out = model(input_ids=x).logits if hasattr(model, "generation_config") else model(x)
    return out.float()


def test_fp32_export_loads_in_transformers_with_mixprecs_logits(tmp_path, run):
    import transformers

    result = export(run, tmp_path / "hf", dtype=torch.float32)
    assert result["step"] == 20 and result["files"] == ["model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.dtype == torch.float32
    ours, tokenizer = load_model(str(run), torch.device("cpu"))
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    assert (_logits(hf, x) - _logits(ours, x)).abs().max() < 1e-5  # same weights, sums ordered differently
    # the run's tokens (UTF-8 bytes) as a tokenizer.json transformers reads
    text = "héllo, wörld\n\tdef f(): ✓"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == list(text.encode())


def test_a_tied_llama_exports_its_embeddings_once(tmp_path, text_file):
    """The tie rule (mixprec.models.ties) decides what export stores once: the output
    projection is the embeddings, so the folder has no lm_head.weight and says it is tied."""
    import transformers
    from safetensors import safe_open

    run_train(tmp_path / "run", text_file, "--precision.preset", "fp32", "--training.steps", "2",
              "--checkpoint.interval", "2", "--model.flavor", "debug", "--model.tie_embeddings", "true")
    export(tmp_path / "run", tmp_path / "hf", dtype=torch.float32)
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, _ = load_model(str(tmp_path / "run"), torch.device("cpu"))
    assert ours.output.weight is ours.tok_embeddings.weight
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert (_logits(hf, x) - _logits(ours, x)).abs().max() < 1e-5


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_a_transformers_model_loaded_trained_and_exported_has_the_runs_logits(tmp_path, text_file, model_type):
    """Issue 45: every run trained with model.hf_config failed to export (its checkpoint also
    holds the decoder layers under HFCausalLM's second name, `layers.*`)."""
    import transformers
    from helpers import save_tiny

    save_tiny(tmp_path / "start", model_type)
    run_train(tmp_path / "run", text_file, "--model.hf_config", str(tmp_path / "start"), "--checkpoint.initial_load",
              str(tmp_path / "start"), "--precision.preset", "fp32", "--training.steps", "3")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "start").eval()
    assert type(hf) is type(start)
    ours, _ = load_model(str(tmp_path / "run"), torch.device("cpu"))
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(hf, x), _logits(ours, x))  # the same transformers code on the same weights
    assert not torch.equal(_logits(hf, x), _logits(start, x))  # and they are the trained ones


def test_bf16_export_is_the_weights_rounded_once(tmp_path, run):
    import transformers

    export(run, tmp_path / "hf", max_shard_bytes=100_000)  # bfloat16 by default, in shards
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours, _ = load_model(str(run), torch.device("cpu"))
    for p in ours.parameters():
        p.data = p.data.bfloat16().float()  # the same rounding, then both compute in float32
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    assert (_logits(hf, x) - _logits(ours, x)).abs().max() < 1e-5


def test_the_export_imported_back_trains_as_the_checkpoint_does(tmp_path, run, text_file):
    """Fine-tuning from the fp32 export and from the checkpoint it came from: the same numbers."""
    export(run, tmp_path / "hf", dtype=torch.float32)
    checkpoint = run / "checkpoint" / "step-20.pt"
    runs = [run_train(tmp_path / name, text_file, "--precision.preset", "fp32", "--checkpoint.initial_load",
                      str(source), "--training.steps", "4", "--checkpoint.enable", "false")
            for name, source in (("from_hf", tmp_path / "hf"), ("from_checkpoint", checkpoint))]
    assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]]
    assert runs[0][-1]["val_loss"] == runs[1][-1]["val_loss"]


def test_generate_greedy_equals_transformers_generate(tmp_path, run, capsys):
    import transformers

    export(run, tmp_path / "hf", dtype=torch.float32)
    model, tokenizer = load_model(str(run), torch.device("cpu"))
    ours = generate(model, tokenizer, "def main(", max_new_tokens=12, temperature=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = hf.generate(torch.tensor([list(b"def main(")]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert ours == tokenizer.decode(ids[0, 9:].tolist())
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "hf"), "--prompt", "def main(", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "def main(" + ours + "\n"  # the folder writes what the run writes


@pytest.mark.parametrize("args, match", [
    (lambda t, r: ["export", str(r), str(t / "full")], "not an empty folder"),
    (lambda t, r: ["export", str(t / "nowhere"), str(t / "out")], "no such file or folder"),
    (lambda t, r: ["export", str(t / "junk.pt"), str(t / "out")], "not a mixprec checkpoint"),
    (lambda t, r: ["export", str(r), str(t / "out"), "--dtype", "int8"], "unknown dtype"),
    (lambda t, r: ["generate", str(r), "--prompt", "x", "--top-k", "-1"], "--top-k"),
])
def test_bad_export_and_generate_input_is_one_line(tmp_path, run, capsys, args, match):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    (tmp_path / "junk.pt").write_bytes(b"\x80\x04not a checkpoint")
    capsys.readouterr()
    assert main(args(tmp_path, run)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert not (tmp_path / "out").exists() and [p.name for p in (tmp_path / "full").iterdir()] == ["mine.txt"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, text_file):
    """moe-debug, 12 steps in fp8-rowwise (the balancing bias moved off zero), a checkpoint at the end."""
    return trained(tmp_path_factory, text_file, "moe-debug", "fp8-rowwise", 12)


def test_an_moe_exports_as_glm4_moe_with_the_runs_logits_and_generates_the_same(tmp_path, moe_run, capsys):
    # DeepSeek-V3's MoE in transformers beside Llama's attention: sigmoid router with its correction bias,
    # shared experts, top-k normalised; the routers stay float32 in a bfloat16 folder
    import transformers
    from safetensors import safe_open

    export(moe_run, tmp_path / "hf", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "Glm4MoeForCausalLM"
    ours, tokenizer = load_model(str(moe_run), torch.device("cpu"))
    bias = ours.layers[1].feed_forward.router.bias
    assert bias.abs().max() > 0 and torch.equal(hf.model.layers[1].mlp.gate.e_score_correction_bias, bias)
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    assert (_logits(hf, x) - _logits(ours, x)).abs().max() < 1e-5
    ids = hf.generate(torch.tensor([list(b"def main(")]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = tokenizer.decode(ids[0, 9:].tolist())
    assert generate(ours, tokenizer, "def main(", max_new_tokens=12, temperature=0) == want
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "hf"), "--prompt", "def main(", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "def main(" + want + "\n"
    export(moe_run, tmp_path / "bf16")
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}
    assert {n for n, d in dtypes.items() if d == torch.float32} == {
        f"model.layers.{i}.mlp.gate.{w}" for i in range(2) for w in ("weight", "e_score_correction_bias")}
