"""`mixprec serve-gap`: what serving a run's model in a narrow format changes, against the trained forward."""

import json

import torch

from mixprec.cli import main
from mixprec.runs.export import export
from mixprec.runs.generate import load_model
from test_quantized import CPU, fp8_run  # noqa: F401 - fixtures
from test_quantized_experts import moe_run  # noqa: F401


def test_serve_gap_measures_each_format_against_the_trained_forward(fp8_run, monkeypatch, capsys):
    from mixprec.interop.quantized import compressed
    from mixprec.runs.serve_gap import serve_gap

    gap = serve_gap(fp8_run)
    assert list(gap) == ["fp8-block", "nvfp4", "mxfp4"]
    for fmt, r in gap.items():
        assert r["tokens"] == 2 * 4 * 32 and 0 < r["logprob_gap"] and 0 < r["kl"] and 0 <= r["top1_changed"] < 1
        assert abs(r["served_val_loss"] - r["val_loss"]) <= r["logprob_gap"]  # a mean gap bounds the loss's
    # 8 bits against 4 (measured: KL 4.5e-6 against 4.8e-5 and 6.3e-5)
    assert gap["fp8-block"]["kl"] < min(gap["nvfp4"]["kl"], gap["mxfp4"]["kl"])
    assert gap["fp8-block"]["served"] == "8 Linears' inputs in e4m3, 1x128 groups"
    # the trained side is the checkpoint's FP32 forward: its loss by torch's cross entropy
    from mixprec.data.loader import val_batches
    from mixprec.runs.resolve import _run_config
    from mixprec.train.build import load_tokens

    config = _run_config(fp8_run)
    data = val_batches(load_tokens(config.data, fp8_run)[3], 32, 4, 2)
    model, _ = load_model(str(fp8_run), CPU)
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
                  for x, y, _ in data]
    assert abs(float(sum(losses)) / 256 - gap["mxfp4"]["val_loss"]) < 1e-5
    # a format that changes nothing serves the trained model: every figure 0
    monkeypatch.setattr(compressed, "write", lambda tensors, config, linears, kept, fmt: (tensors, config, set()))
    same = serve_gap(fp8_run, ["mxfp4"])["mxfp4"]
    assert same["logprob_gap"] == same["kl"] == same["top1_changed"] == 0


def test_serve_gap_on_the_command_line(tmp_path, moe_run, capsys):
    assert main(["serve-gap", str(moe_run), "--format", "fp8-block", "--batches", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result) == ["fp8-block"] and result["fp8-block"]["tokens"] == 4 * 32
    assert main(["serve-gap", str(moe_run), "--format", "mxfp4", "--batches", "1"]) == 0
    assert "top-1 changed" in capsys.readouterr().out
    for args, words in ((["--format", "int4"], "--format 'int4' is not known; accepted: fp8-block, nvfp4, mxfp4"),
                        (["--batches", "-1"], "--batches: bad value -1")):
        assert main(["serve-gap", str(moe_run), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    export(moe_run, tmp_path / "hf")
    assert main(["serve-gap", str(tmp_path / "hf")]) == 2
    assert "not a run folder" in capsys.readouterr().err
