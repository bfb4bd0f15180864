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
