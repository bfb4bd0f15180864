import os
import shutil
from pathlib import Path

import pytest
import torch

from mixprec import UserError
from mixprec.interop.checkpoint import EXTRAS_KEYS, CheckpointManager


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


def test_a_resume_that_fails_for_another_reason_is_not_called_a_mismatch(tmp_path, text_file, monkeypatch, capsys):
    """Issue 45: every error during a resume (a bug, CUDA out of memory) was reported as "does
    not fit this run", exit 2, no traceback. A defect keeps its traceback; running out of
    memory gets the command's out-of-memory line (what the planner says the run needs)."""
    from conftest import run_train, tiny_args
    from mixprec.cli import main
    from mixprec.data.loader import TrainLoader

    run_train(tmp_path / "run", text_file, "--checkpoint.interval", "3")
    args = tiny_args(tmp_path / "run", text_file, "--training.steps", "9")
    for error in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                  AttributeError("'NoneType' object has no attribute 'copy_'")):
        def fails(self, state, error=error):
            raise error

        monkeypatch.setattr(TrainLoader, "load_state_dict", fails)
        capsys.readouterr()
        if isinstance(error, AttributeError):
            with pytest.raises(AttributeError):
                main(args)
        else:
            assert main(args) == 2
            err = capsys.readouterr().err
            assert "out of memory (OutOfMemoryError)" in err and "does not fit" not in err, err


def test_a_checkpoint_that_lacks_a_key_or_holds_other_shapes_is_one_line(tmp_path, text_file, capsys):
    from conftest import run_train, tiny_args
    from mixprec.cli import main

    run_train(tmp_path / "run", text_file, "--checkpoint.interval", "6")
    path = tmp_path / "run" / "checkpoint" / "step-6.pt"
    good = torch.load(path, weights_only=True)
    edits = {"a key it lacks": lambda s: s["trainer"].pop("best_val"),
             "another shape": lambda s: s["model"].update({"norm.weight": torch.ones(3)})}
    for what, edit in edits.items():
        bad = torch.load(path, weights_only=True)
        edit(bad)
        torch.save(bad, path)
        capsys.readouterr()
        assert main(tiny_args(tmp_path / "run", text_file, "--training.steps", "9")) == 2, what
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "does not fit this run" in err, err
        torch.save(good, path)


def test_the_error_classes_of_a_checkpoint_read(tmp_path):
    # by where an error was raised and what it says, not by its Python type
    import pickle
    import traceback

    from mixprec.errors import dcp_failures, does_not_fit, unreadable

    def raised(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the error under test
            return e
        raise AssertionError("nothing raised")

    garbage = tmp_path / "step-3.pt"
    garbage.write_bytes(b"PK\x03\x04 not a zip at all")
    damaged = raised(lambda: torch.load(garbage, weights_only=True))
    assert isinstance(damaged, RuntimeError) and unreadable(damaged)  # torch's zip reader said it
    assert not unreadable(RuntimeError(str(damaged)))  # the same type and words raised anywhere else: a defect
    assert unreadable(pickle.UnpicklingError("weights only load failed")) and unreadable(EOFError())
    oom = torch.OutOfMemoryError("CUDA out of memory")
    assert not unreadable(oom) and not does_not_fit(oom) and not unreadable(MemoryError())
    lost = torch.distributed.DistBackendError("Connection reset by peer")
    device = RuntimeError("CUDA error: an illegal memory access was encountered")
    for e in (lost, device):
        assert not unreadable(e) and not does_not_fit(e)
    # torch's own word that a state does not fit: load_state_dict's and torch.optim's
    shape = raised(lambda: torch.nn.Linear(2, 2).load_state_dict({"weight": torch.ones(3, 2), "bias": torch.ones(2)}))
    groups = raised(lambda: torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1).load_state_dict(
        {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}))
    assert isinstance(groups, ValueError) and does_not_fit(shape) and does_not_fit(groups)
    for defect in (KeyError("best_val"), ValueError("x"), AttributeError("x"), TypeError("x"), IndexError("x")):
        assert not does_not_fit(defect) and not unreadable(defect)  # raised in mixprec's (here: this test's) code
    # another rank's failure arrives through DCP pickled, its frames kept beside it
    remote = pickle.loads(pickle.dumps(damaged))
    frames = traceback.extract_tb(damaged.__traceback__)
    gathered = type("CheckpointException", (Exception,), {})()
    gathered.failures = {1: (remote, frames)}
    assert [unreadable(f) for f in dcp_failures(gathered)] == [True]

    from mixprec.interop.checkpoint import restoring

    with pytest.raises(KeyError):  # a rewind restores the run's own snapshot: no error there is the user's
        with restoring("memory snapshot", from_user=False, saved={}, own=lambda: {"trainer": {"best_val": 1}}):
            raise KeyError("best_val")
    with pytest.raises(UserError, match=r"does not fit this run \(it lacks trainer.best_val\)"):
        with restoring("step-3.pt", saved={"trainer": {}}, own=lambda: {"trainer": {"best_val": 1.0}}):
            raise KeyError("best_val")
    with pytest.raises(KeyError):  # the checkpoint has all this run would save: the KeyError is mixprec's
        with restoring("step-3.pt", saved={"trainer": {"best_val": 1.0}}, own=lambda: {"trainer": {"best_val": 1.0}}):
            raise KeyError("best_val")


def _dcp_folder(tmp_path, plant: str):
    """A DCP checkpoint of a Linear and its AdamW, with a payload planted in the optimizer's
    param_groups (`plant` "entry") or in the folder's metadata (`plant` "metadata")."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from conftest import Payload

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    marker = tmp_path / "code-ran"
    if plant == "entry":
        optim_sd["param_groups"][0]["lr"] = Payload(marker)  # an entry the resume reads
    folder = tmp_path / "step-3"
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=folder, no_dist=True)
    if plant == "metadata":
        (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    return folder, marker, model, opt


@pytest.mark.parametrize("plant", ["entry", "metadata"])
def test_a_dcp_folder_that_would_run_code_is_refused_and_runs_none(tmp_path, plant):
    import warnings

    from mixprec.interop.checkpoint import load_sharded
    from mixprec.interop.load import _dcp_model

    folder, marker, model, opt = _dcp_folder(tmp_path, plant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group: one process" note
        with pytest.raises(UserError, match="corrupt or does not match") as e:
            load_sharded(str(folder), model, opt)
        assert len(str(e.value).splitlines()) == 1 and ("Unpickl" in str(e.value) or "not part of DCP" in str(e.value))
        assert not marker.exists()
        if plant == "metadata":  # the model-weights reader (export, generate, an initial load) refuses it too
            with pytest.raises(UserError, match="cannot be read"):
                _dcp_model(folder, "checkpoint.initial_load")
            assert not marker.exists()


def test_a_clean_dcp_folder_loads(tmp_path):
    import warnings

    from mixprec.interop.checkpoint import load_sharded

    folder, _, model, opt = _dcp_folder(tmp_path, "none")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    opt.param_groups[0]["lr"] = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_sharded(str(folder), model, opt)
    assert torch.equal(model.weight, want["weight"]) and opt.param_groups[0]["lr"] == 1e-3


# ---- a step saved again (after a rewind), killed at each point --------------------------------
class Killed(BaseException):
    pass


def kill_at(monkeypatch, n: int) -> None:
    """The n-th rename or folder removal of mixprec.interop.checkpoint raises Killed (a removal
    killed half-way: one file gone first)."""
    from mixprec.interop import checkpoint

    calls = [0]

    def counted(fn, partial=False):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                if partial and Path(args[0]).is_dir():
                    next(Path(args[0]).iterdir()).unlink()
                raise Killed
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(checkpoint.os, "replace", counted(os.replace))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", counted(shutil.rmtree, partial=True))


def save_sharded(ckpt, step: int, value: float) -> None:
    """CheckpointManager.save_sharded in a one-rank gloo group (DCP's folder, extras.pt)."""
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, value)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.save_sharded(step, model, optimizer, {k: {} for k in EXTRAS_KEYS} | {"format": 1, "step": step, "value": value}, 0)


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# 1 would be the removal of a stale step-10.tmp; then the old folder set aside, the new one in, the old removed
@pytest.mark.parametrize("point", [2, 3, 4])
def test_a_step_saved_again_leaves_a_loadable_checkpoint_when_killed_at_any_point(tmp_path, monkeypatch, one_rank,
                                                                                    point):
    folder = tmp_path / "checkpoint"
    ckpt = CheckpointManager(folder, keep_latest_k=1)
    save_sharded(ckpt, 10, 1.0)  # the save the rewind went back to
    kill_at(monkeypatch, point)
    with pytest.raises(Killed):
        save_sharded(ckpt, 10, 2.0)  # the same step after the rewind
    monkeypatch.undo()
    restarted = CheckpointManager(folder, keep_latest_k=1)
    restarted.recover()
    state = restarted.load()
    assert state["step"] == 10 and state["value"] == (2.0 if point == 4 else 1.0)
    assert sorted(p.name for p in folder.iterdir()) == ["step-10"]  # nothing half-done left beside it


def test_a_checkpoint_killed_while_removed_is_not_listed(tmp_path, monkeypatch, one_rank):
    folder = tmp_path / "checkpoint"
    ckpt = CheckpointManager(folder, keep_latest_k=1)
    save_sharded(ckpt, 10, 1.0)
    kill_at(monkeypatch, 4)  # the prune of step 10 after step 20 is in: killed with a file of it gone
    with pytest.raises(Killed):
        save_sharded(ckpt, 20, 2.0)
    monkeypatch.undo()
    assert ckpt.steps() == [20] and ckpt.load()["value"] == 2.0
    ckpt.recover()
    assert sorted(p.name for p in folder.iterdir()) == ["step-20"]


def test_a_killed_single_file_save_is_removed_at_the_next_start(tmp_path, monkeypatch):
    ckpt = CheckpointManager(tmp_path, keep_latest_k=0)
    ckpt.save(1, state(1))
    monkeypatch.setattr(torch, "save", lambda obj, f: (f.write(b"half"), (_ for _ in ()).throw(Killed)))
    with pytest.raises(Killed):
        ckpt.save(2, state(2))
    monkeypatch.undo()
    assert (tmp_path / "step-2.pt.tmp").exists()
    ckpt.recover()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1.pt"]


def test_extras_are_on_the_disk_before_the_folder_is_renamed(tmp_path, monkeypatch, one_rank):
    from mixprec.interop import checkpoint

    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                          real_fsync(fd)))
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: (renamed.append(len(synced)), real_replace(a, b)))
    save_sharded(CheckpointManager(tmp_path, keep_latest_k=0), 5, 1.0)
    assert len(renamed) == 1 and any(p.endswith("step-5.tmp/extras.pt") for p in synced[:renamed[0]])
