"""mixprec.lightning's FabricPrecision and TrainerPrecision through Fabric and the Lightning Trainer against mixprec's own
loop: the same tiny model, data and seed give bit-identical losses and weights over 20 steps."""

import pytest
import torch

L = pytest.importorskip("lightning")

from common import (BAD_STEPS, DRILL_STEP, MAX_NORM, PRESETS, STEPS, batches, check_delayed_location,  # noqa: E402
                    check_drill, optimizer, own_loop, poison, poison_batch, same_weights, settings, tiny_model)
from mixprec.lightning import FabricPrecision, TrainerPrecision  # noqa: E402


def fabric_loop(preset, data, drill=False, read_every=None, bad=()):
    # the drill's NaN is transient (a hook during one step): located only when read at once
    plugin = FabricPrecision(preset, max_norm=MAX_NORM, device_type="cpu", read_every=1 if drill else read_every,
                             **settings(preset))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = tiny_model()
    model, opt = fabric.setup(model, optimizer(model.parameters()))
    for batch in bad:  # after setup: the conversion replaces the Linear modules (and their hooks)
        poison_batch(model, batch)
    losses = []
    for step, batch in enumerate(data, 1):
        hook = poison(model) if drill and step == DRILL_STEP else None
        loss = model(**batch).loss
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if hook is not None:
            hook.remove()
    plugin.steps.read()  # Fabric has no end of training to hook: the steps not read yet
    return losses, model.state_dict(), plugin


class Module(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model, self.by_step = model, {}

    def training_step(self, batch, index):
        loss = self.model(**batch).loss
        self.by_step[self.trainer.global_step] = loss.item()  # the locator's re-run of a step runs this again
        return loss

    @property
    def losses(self) -> list[float]:
        return [self.by_step[k] for k in sorted(self.by_step)]

    def configure_optimizers(self):
        return optimizer(self.parameters())


def trainer(plugin, **kwargs):
    kwargs.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], gradient_clip_val=MAX_NORM, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


class Drill(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, index):
        if trainer.global_step + 1 == DRILL_STEP:
            self.hook = poison(module)

    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        if getattr(self, "hook", None) is not None:
            self.hook = self.hook.remove()


class PoisonBatches(L.Callback):
    def __init__(self, bad):
        self.bad = bad

    def on_train_start(self, trainer, module):
        for batch in self.bad:
            poison_batch(module, batch)


def trainer_loop(preset, data, drill=False, read_every=None, bad=()):
    plugin = TrainerPrecision(preset, device_type="cpu", read_every=1 if drill else read_every, **settings(preset))
    module = Module(tiny_model())
    callbacks = ([Drill()] if drill else []) + [PoisonBatches(bad)]
    trainer(plugin, max_steps=len(data), callbacks=callbacks).fit(
        module, torch.utils.data.DataLoader(data, batch_size=None))
    return module.losses, module.state_dict(), plugin


@pytest.fixture(scope="module")
def data():
    return batches()


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("loop", [fabric_loop, trainer_loop], ids=["fabric", "trainer"])
def test_bit_identical_to_mixprecs_own_loop(preset, loop, data):
    ref_losses, ref_weights = own_loop(preset, data)
    losses, weights, plugin = loop(preset, data)
    assert len(losses) == STEPS
    assert losses == ref_losses
    assert same_weights(ref_weights, weights)
    if preset == "fp16-mixed":  # the forced overflows were skipped and the scale came down
        assert plugin.policy.state_dict()["skipped"] >= 1


@pytest.mark.parametrize("loop", [fabric_loop, trainer_loop], ids=["fabric", "trainer"])
def test_a_nan_drill_is_skipped_located_and_the_layer_promoted(loop, data):
    losses, weights, plugin = loop("fp8-rowwise", data, drill=True)
    check_drill(losses, plugin.incidents, plugin.policy, weights)


@pytest.mark.parametrize("loop", [fabric_loop, trainer_loop], ids=["fabric", "trainer"])
def test_a_step_read_later_is_located_on_its_own_batch(loop, data):
    """Issue 45: the locator re-ran the batch current at the read, not the non-finite step's."""
    _, _, plugin = loop("fp8-rowwise", data, read_every=8, bad=[data[step - 1] for step in BAD_STEPS])
    check_delayed_location(plugin.incidents)


def test_reads_follow_the_trainers_logging_interval(data):
    plugin = TrainerPrecision("bf16-mixed", device_type="cpu")
    assert plugin.steps.read_every == 10  # before the Trainer connects: mixprec train's log_freq
    trainer(plugin, max_steps=2, log_every_n_steps=7).fit(Module(tiny_model()),
                                                         torch.utils.data.DataLoader(data[:2], batch_size=None))
    assert plugin.steps.read_every == 7
    fabric = FabricPrecision("bf16-mixed", read_every=3)
    assert fabric.steps.read_every == fabric.policy.reads.every == 3  # one schedule: the policy's


class Batches:
    """A loader that keeps its position (Lightning's stateful-loader protocol): a mid-epoch checkpoint resumes at
    the next batch, not at the epoch's first."""

    def __init__(self, data):
        self.data, self.pos = data, 0

    def __len__(self):
        return len(self.data)

    def __iter__(self):
        while self.pos < len(self.data):
            self.pos += 1
            yield self.data[self.pos - 1]
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


@pytest.mark.parametrize("preset, drill", [("fp16-mixed", False), ("fp8-delayed", True)])
def test_a_resumed_trainer_continues_bit_for_bit(preset, drill, data, tmp_path):
    # loss scale (fp16-mixed); amax histories and a layer promoted at step 5 (fp8-delayed with the drill)
    path = tmp_path / "step10.ckpt"

    class SaveAtStep10(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            if trainer.global_step == 10 and not path.exists():
                trainer.save_checkpoint(path)

    def fit(ckpt=None):
        plugin = TrainerPrecision(preset, device_type="cpu", read_every=1, **settings(preset))  # the drill read at once
        module = Module(tiny_model())
        t = trainer(plugin, max_steps=STEPS, callbacks=[SaveAtStep10()] + ([Drill()] if drill else []))
        t.fit(module, Batches(data), ckpt_path=ckpt)
        return module, plugin

    whole, whole_plugin = fit()  # also writes the checkpoint after step 10
    resumed, plugin = fit(ckpt=str(path))
    assert resumed.losses == whole.losses[10:]
    a, b = whole.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert plugin.policy.state_dict()["scaler"] == whole_plugin.policy.state_dict()["scaler"]
    assert list(plugin.policy.promoted) == list(whole_plugin.policy.promoted) and (not drill or plugin.policy.promoted)


@pytest.mark.parametrize("preset", ["bf16-master", "bf16-kahan", "bf16-mixed-8bit"])
def test_presets_that_follow_the_optimizer_through_the_trainer(preset, data):
    # master weights and bf16 update rules are set up in connect(), where the Trainer hands the optimizer over
    ref_losses, ref_weights = own_loop(preset, data[:6])
    losses, weights, plugin = trainer_loop(preset, data[:6])
    assert losses == ref_losses
    assert same_weights(ref_weights, weights)
    if preset.endswith("8bit"):  # connect() handed the Trainer mixprec's AdamW: its moments in 1-byte codes
        assert plugin.policy.optimizer.states.name == "8bit"
        assert torch.uint8 in {s["exp_avg"].dtype for s in plugin.policy.optimizer.state.values()}


def test_refusals_are_one_line(data):
    import mixprec.lightning
    from mixprec import UserError

    with pytest.raises(AttributeError, match="now two classes: FabricPrecision .* and TrainerPrecision"):
        mixprec.lightning.Precision("bf16-mixed")

    with pytest.raises(UserError, match="FabricPrecision\\('bf16-master'\\): this preset keeps master weights"):
        fabric_loop("bf16-master", data[:1])
    plugin = TrainerPrecision("bf16-mixed", device_type="cpu")
    with pytest.raises(UserError, match="gradient_clip_algorithm 'value'"):
        trainer(plugin, max_steps=1, gradient_clip_algorithm="value").fit(
            Module(tiny_model()), torch.utils.data.DataLoader(data[:1], batch_size=None))
    f = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricPrecision("bf16-mixed", device_type="cpu")])
    model = tiny_model()
    model, opt = f.setup(model, optimizer(model.parameters()))
    f.backward(model(**data[0]).loss)
    with pytest.raises(UserError, match="accepted: FabricPrecision\\(..., max_norm=1.0\\)"):
        f.clip_gradients(model, opt, max_norm=1.0)
    # each plugin in the other's place (Fabric takes any Lightning precision plugin: the Trainer's too)
    f = L.Fabric(accelerator="cpu", devices=1, plugins=[TrainerPrecision("bf16-mixed", device_type="cpu")])
    with pytest.raises(UserError, match="TrainerPrecision under Fabric; accepted: mixprec.lightning.FabricPrecision"):
        f.setup(tiny_model(), optimizer(tiny_model().parameters()))


def test_without_lightning_the_import_names_the_extra(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "mixprec.lightning")
    with pytest.raises(ImportError, match=r"pip install 'mixprec\[lightning\]'"):
        importlib.import_module("mixprec.lightning")
