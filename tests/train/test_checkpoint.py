from pathlib import Path

import pytest
import torch

from mixprec import UserError
from mixprec.train.checkpoint import CheckpointManager


def state(step):
    filler = dict.fromkeys(("scheduler", "data", "policy", "rng", "trainer", "model", "optimizer"), {})
    return {"format": 1, "meta": {}, "step": step, **filler, "w": torch.full((3,), float(step))}


def test_save_load_latest_and_pruning(tmp_path):
    ckpt = CheckpointManager(tmp_path, keep_latest_k=2)
    for step in (1, 2, 3):
        ckpt.save(step, state(step))
    assert ckpt.steps() == [2, 3]
    assert ckpt.load()["step"] == 3 and torch.equal(ckpt.load(2)["w"], torch.full((3,), 2.0))


def test_a_crash_mid_save_leaves_nothing_loadable(tmp_path, monkeypatch):
    ckpt = CheckpointManager(tmp_path, keep_latest_k=0)
    ckpt.save(1, state(1))

    def dies(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, state(2))
    monkeypatch.undo()
    assert ckpt.steps() == [1] and ckpt.load()["step"] == 1  # the partial .tmp is never picked up
    ckpt.save(2, state(2))  # and does not block the next save
    assert ckpt.load()["step"] == 2


def test_foreign_files_are_user_errors(tmp_path):
    ckpt = CheckpointManager(tmp_path, keep_latest_k=0)
    torch.save({"weights": torch.ones(2)}, tmp_path / "step-5.pt")
    with pytest.raises(UserError, match="not a mixprec checkpoint"):
        ckpt.load()
    (tmp_path / "step-5.pt").write_text("not a checkpoint")
    with pytest.raises(UserError, match="corrupt"):
        ckpt.load()


def test_a_checkpoint_written_before_the_precision_redesign_resumes(tmp_path):
    """tests/fixtures/before-redesign/step-3.pt was written by commit 2e9a727 (before the
    precision spec, the builder and TrainingState) with these arguments and --training.steps 3
    --checkpoint.interval 3 --checkpoint.keep_latest_k 0, on an AVX2 CPU."""
    import shutil

    from conftest import run_train

    fixture = Path(__file__).parent.parent / "fixtures" / "before-redesign"
    corpus = fixture / "corpus.txt"
    flags = ("--precision.preset", "fp16-mixed", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0")
    (tmp_path / "old" / "checkpoint").mkdir(parents=True)
    shutil.copy(fixture / "step-3.pt", tmp_path / "old" / "checkpoint")
    resumed = run_train(tmp_path / "old", corpus, *flags)
    # this tree's own checkpoint of the same three steps, resumed the same way (the schedule
    # continues from the saved one, as any resume with more training.steps does)
    run_train(tmp_path / "new", corpus, *flags, "--training.steps", "3")
    fresh = run_train(tmp_path / "new", corpus, *flags)
    assert [r["step"] for r in resumed] == [4, 5, 6] and [r["step"] for r in fresh[3:]] == [4, 5, 6]
    for old, new in zip(resumed, fresh[3:]):
        # bit-identical on the CPU that wrote the fixture (same_numbers.py); within float
        # rounding where another CPU computed this tree's first three steps
        assert old["loss"] == pytest.approx(new["loss"], rel=1e-3)
        assert old["loss_scale"] == new["loss_scale"] and old["lr"] == pytest.approx(new["lr"], rel=1e-9)
