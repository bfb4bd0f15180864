"""mixprec.hf.Trainer against mixprec's own loop: the same tiny model, data and seed give
bit-identical losses and weights over 20 steps; Accelerate's own mixed precision is refused."""

import math
import pathlib

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from common import (BAD_STEPS, DRILL_STEP, MAX_NORM, PRESETS, STEPS, batches, check_delayed_location,  # noqa: E402
                    check_drill, optimizer, own_loop, poison, poison_batch, same_weights, settings, tiny_model)
from mixprec import UserError  # noqa: E402
from mixprec.hf import Trainer  # noqa: E402


class Rows(torch.utils.data.IterableDataset):
    """The batches' rows in order: the Trainer's dataloader stacks them back into the same batches."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        for batch in self.data:
            for i in range(batch["input_ids"].shape[0]):
                yield {k: v[i] for k, v in batch.items()}


class Recording(Trainer):
    losses: list

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss.item())
        return loss


def arguments(folder, steps=STEPS, **kwargs):
    kwargs.setdefault("save_strategy", "no")
    kwargs.setdefault("logging_steps", 1)
    return transformers.TrainingArguments(
        output_dir=str(folder), use_cpu=True, max_steps=steps, per_device_train_batch_size=4, max_grad_norm=MAX_NORM,
        report_to=[], dataloader_num_workers=0, disable_tqdm=True, **kwargs)


def hf_trainer(preset, data, folder, model=None, steps=STEPS, trainer_class=Recording, **kwargs):
    model = model or tiny_model()
    opt = optimizer(model.parameters())
    trainer = trainer_class(model=model, args=arguments(folder, steps, **kwargs), train_dataset=Rows(data),
                            optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)),
                            precision=preset, precision_settings=settings(preset))
    trainer.model_accepts_loss_kwargs = False  # the model's own mean loss, as the reference loop computes it
    trainer.losses = []
    return trainer


@pytest.fixture(scope="module")
def data():
    return batches()


@pytest.mark.parametrize("preset", PRESETS)
def test_bit_identical_to_mixprecs_own_loop(preset, data, tmp_path):
    ref_losses, ref_weights = own_loop(preset, data)
    trainer = hf_trainer(preset, data, tmp_path)
    trainer.train()
    assert trainer.losses == ref_losses
    assert same_weights(ref_weights, trainer.model.state_dict())
    if preset == "fp16-mixed":
        assert trainer.policy.state_dict()["skipped"] >= 1


def test_accelerates_own_mixed_precision_is_refused(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=True, report_to=[])
    with pytest.raises(UserError, match="Accelerate's mixed precision 'bf16'"):
        Trainer(model=tiny_model(), args=args, precision="bf16-mixed")


class Drill(transformers.TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.hook = trainer, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == DRILL_STEP:
            self.hook = poison(self.trainer.model)

    def on_step_end(self, args, state, control, **kwargs):
        if self.hook is not None:
            self.hook = self.hook.remove()


def test_a_nan_drill_is_skipped_located_and_the_layer_promoted(data, tmp_path):
    trainer = hf_trainer("fp8-rowwise", data, tmp_path)
    trainer.add_callback(Drill(trainer))
    trainer.train()
    check_drill(trainer.losses, trainer.incidents, trainer.policy, trainer.model.state_dict())


@pytest.mark.parametrize("preset, drill", [("fp16-mixed", False), ("fp8-delayed", True)])
def test_a_resumed_trainer_continues_bit_for_bit(preset, drill, data, tmp_path):
    def run(**kwargs):
        trainer = hf_trainer(preset, data, tmp_path, save_strategy="steps", save_steps=10)
        if drill:
            trainer.add_callback(Drill(trainer))
        trainer.train(**kwargs)
        return trainer

    whole = run()  # also writes checkpoint-10 (and its mixprec_precision.pt)
    assert (tmp_path / "checkpoint-10" / "mixprec_precision.pt").exists()
    resumed = run(resume_from_checkpoint=str(tmp_path / "checkpoint-10"))
    assert resumed.losses == whole.losses[10:]
    assert same_weights(whole.model.state_dict(), resumed.model.state_dict())
    assert resumed.policy.state_dict()["scaler"] == whole.policy.state_dict()["scaler"]
    assert list(resumed.policy.promoted) == list(whole.policy.promoted) and (not drill or resumed.policy.promoted)


def test_the_audit_on_the_trainers_own_batches(data, tmp_path):
    from mixprec import format_audit

    trainer = hf_trainer("fp8-rowwise", data, tmp_path)
    report = trainer.audit()
    assert report["ok"], format_audit(report)
    rows = {r["stage"]: r for r in report["stages"]}
    assert rows["narrow layers (forward GEMMs in float8 or e2m1)"]["observed"] == ["14 ran"]


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-kahan", "bf16-kahan-8bit"])
def test_presets_that_follow_the_optimizer(preset, data, tmp_path):
    ref_losses, ref_weights = own_loop(preset, data[:6])
    trainer = hf_trainer(preset, data[:6], tmp_path, steps=6)
    trainer.train()
    assert trainer.losses == ref_losses
    assert same_weights(ref_weights, trainer.model.state_dict())
    if preset.endswith("8bit"):  # the Trainer steps mixprec's AdamW: its moments in 1-byte codes
        assert trainer.policy.optimizer.states.name == "8bit"
        assert torch.uint8 in {s["exp_avg"].dtype for s in trainer.policy.optimizer.state.values()}


def test_without_transformers_the_import_names_the_extra(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "mixprec.hf")
    with pytest.raises(ImportError, match=r"pip install 'mixprec\[hf\]'"):
        importlib.import_module("mixprec.hf")


class _RunsCode:
    """Unpickled with code execution on, this touches `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_precision_state_whose_unpickling_runs_code_is_refused_in_one_line(tmp_path):
    """Issue 45: the resume folder's precision state was read with pickle's code execution on."""
    from mixprec.hf import load_precision_state

    marker, path = tmp_path / "ran", tmp_path / "mixprec_precision.pt"
    torch.save({"precision": "bf16-mixed", "payload": _RunsCode(marker)}, path)
    with pytest.raises(UserError, match="not a mixprec precision state") as refused:
        load_precision_state(str(path))
    assert len(str(refused.value).splitlines()) == 1 and not marker.exists()
    torch.load(path, weights_only=False)  # what the file does where pickle may run code
    assert marker.exists()


class PoisonBatches(transformers.TrainerCallback):
    def __init__(self, trainer, bad):
        self.trainer, self.bad = trainer, bad

    def on_train_begin(self, args, state, control, **kwargs):  # after the conversion
        for batch in self.bad:
            poison_batch(self.trainer.model, batch)


def test_a_step_read_later_is_located_on_its_own_batch(data, tmp_path):
    """Issue 45: the locator re-ran the batch current at the read, not the non-finite step's."""
    trainer = hf_trainer("fp8-rowwise", data, tmp_path, logging_steps=8)  # reads every 8 steps, and at the end
    trainer.add_callback(PoisonBatches(trainer, [data[step - 1] for step in BAD_STEPS]))
    trainer.train()
    assert trainer.mixprec.read_every == 8
    check_delayed_location(trainer.incidents)


def test_the_optimizers_own_hooks_run_and_the_logged_norm_is_unscaled(data, tmp_path):
    """Issue 45: PolicyOptimizer skipped Optimizer.__init__ (register_step_pre_hook failed), and
    under fp16-mixed the Trainer logged the norm of the scaled gradients (4.8e4 for 0.8)."""
    trainer = hf_trainer("fp16-mixed", data, tmp_path)  # starts at a scale that overflows: the first steps skip
    calls = []
    trainer.create_optimizer()
    trainer.optimizer.register_step_pre_hook(lambda *a: calls.append("pre"))
    trainer.optimizer.register_step_post_hook(lambda *a: calls.append("post"))
    trainer.train()
    assert calls == ["pre", "post"] * STEPS
    logged = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]
    # mixprec's own loop (bit-identical to the Trainer's): the norm each step clipped with
    results = []
    own_loop("fp16-mixed", data, results=results)
    want = [r.grad_norm for r in results]
    applied = [i for i, n in enumerate(want) if math.isfinite(n)]
    assert 0 < len(applied) < STEPS  # some steps overflowed and were skipped
    assert [logged[i] for i in applied] == [want[i] for i in applied]
    assert max(logged[i] for i in applied) < 10  # not the scaled gradients' norm (x 2^k)
