"""The guard in a user's own loop: StabilityGuard.for_loop beside a Policy."""

import pytest
import torch

from mixprec.errors import TrainingUnstable
from mixprec.models.llama import build_model, model_args
from mixprec.precision import Policy
from mixprec.stability import StabilityConfig, StabilityGuard
from mixprec.narrow.linear.fp8 import FP8Linear
from mixprec.stability.drills import _bad_scale, _poison

W2 = "layers.1.feed_forward.w2"


class Loop:
    """A plain training loop (the README's) with the guard's one call per step."""

    def __init__(self, preset: str, **config):
        self.policy = Policy.from_preset(preset)
        model = build_model(model_args("debug", 256), device=torch.device("cpu"),
                            storage_dtype=self.policy.storage_dtype, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.model, self.opt = self.policy.setup(model, opt)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + s))
        self.guard = StabilityGuard.for_loop(self.model, self.opt, policy=self.policy, scheduler=self.sched,
                                             config=StabilityConfig(window=8, **config))
        self.gen = torch.Generator().manual_seed(0)
        self.lrs, self.first, self.last = [], {}, {}  # the lr each optimizer step used; weights after each step
        self.opt.register_step_pre_hook(lambda o, a, k: self.lrs.append(o.param_groups[0]["lr"]))

    def run(self, steps: int, poison=(), blowup=(), max_norm: float = 1.0, start: int = 0) -> int:
        """Train from step `start` to `steps`; a NaN goes into W2's output the first time each step in `poison`
        runs, and the gradients are multiplied by 1000 the first time each step in `blowup` runs."""
        step, poison, blowup = start, set(poison), set(blowup)
        while step < steps:
            x, y = torch.randint(0, 256, (2, 2, 32), generator=self.gen).unbind(0)
            handle = None
            if step + 1 in poison:
                poison.remove(step + 1)
                handle = self.model.get_submodule(W2).register_forward_hook(_poison)

            def forward():
                with self.policy.autocast("cpu"):
                    return self.model(x, y)

            loss = forward()
            self.policy.backward(loss)
            if step + 1 in blowup:
                blowup.remove(step + 1)
                for p in self.model.parameters():
                    p.grad.mul_(1000)
            result = self.policy.step(self.opt, max_norm=max_norm)
            if result.applied:
                self.sched.step()
            step = self.guard.after_step(step + 1, loss.item(), result, rerun=[(forward, self.policy.backward)])
            if handle is not None:
                handle.remove()
            self.last[step] = [p.detach().clone() for p in self.model.parameters()]
            self.first.setdefault(step, self.last[step])
        return step


def test_a_skipped_nonfinite_step_with_a_finite_state_costs_only_its_batch():
    loop = Loop("bf16-mixed", snapshot_interval=5)
    loop.run(10, poison={7})
    (incident,) = loop.guard.incidents
    assert incident["finding"]["module"] == W2 and incident["action"].startswith("skipped")
    assert loop.guard.rewinds == 0 and loop.guard.skipped == [] and "rewound_to" not in incident
    assert incident["nonfinite_parameters"] == incident["nonfinite_optimizer_state"] == 0
    # the weights after step 7 are those after step 6: its update was never applied, and nothing went back
    assert all(torch.equal(a, b) for a, b in zip(loop.last[6], loop.last[7]))
    # no back-off: every step that was applied used the schedule's learning rate
    schedule = [1.0e-3 / (1 + s) for s in range(10)]
    assert loop.lrs == pytest.approx(schedule[:9])
    assert loop.policy.summary()["nonfinite_steps"] == 1


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-mixed", "bf16-mixed-8bit"])
def test_a_repeated_nonfinite_step_rewinds_to_the_snapshot_and_backs_off(preset):
    loop = Loop(preset, snapshot_interval=5, backoff_steps=3)
    scale_before = loop.policy.summary()["loss_scale"]
    loop.run(12, poison={6, 7})
    first, second = loop.guard.incidents
    assert first["action"].startswith("skipped") and "rewound_to" not in first
    assert second["finding"]["module"] == W2 and second["finding"]["phase"] == "forward"
    assert "2 non-finite steps within 8 steps: rewound" in second["action"]
    assert second["rewound_to"] == 5 and loop.guard.skipped == [[6, 7]]
    # the weights went back to the step-5 snapshot exactly; the steps after it differ (other data, lower lr)
    assert all(torch.equal(a, b) for a, b in zip(loop.first[5], loop.last[5]))
    assert not all(torch.equal(a, b) for a, b in zip(loop.first[6], loop.last[6]))
    if preset.endswith("8bit"):  # the snapshot's quantized moments came back as they were: 1-byte codes, FP32 scales
        assert {s["exp_avg"].dtype for s in loop.opt.state.values()} == {torch.uint8, torch.float32}
    # the lrs the optimizer used: steps 1-5 (6 and 7 were skipped: NaN), then 6, 7, 8 backed off
    # x0.5 and back up linearly over 3 steps, then the schedule
    schedule = [1.0e-3 / (1 + s) for s in range(13)]
    lrs = loop.lrs
    if preset.endswith("8bit"):  # mixprec's AdamW skips on the device: steps 6 and 7 called it (and changed nothing)
        assert lrs[5:7] == pytest.approx(schedule[5:6] * 2)
        lrs = lrs[:5] + lrs[7:]  # torch's foreach AdamW was not called at all (its skip is read on the host)
    assert lrs[:5] == pytest.approx(schedule[:5])
    assert lrs[5:8] == pytest.approx([f * lr for f, lr in zip((1 / 2, 2 / 3, 5 / 6), schedule[5:8])])
    assert lrs[8:] == pytest.approx(schedule[8:12])
    assert loop.opt.param_groups[0]["lr"] == pytest.approx(schedule[12])  # the back-off never sticks
    # the rewind put the snapshot's counters back, but the two non-finite steps happened: they stay counted
    summary = loop.policy.summary()
    counted = "overflow_count" if scale_before is not None else "nonfinite_steps"  # fp16: the scaler's overflows
    assert summary[counted] == 2 and summary["skipped_steps"] == 2 and summary["steps"] == 14
    if scale_before is not None:  # fp16: the scale went back to the snapshot's, then one back-off
        assert "loss scale" in second["action"] and summary["loss_scale"] < scale_before


def test_a_nonfinite_parameter_rewinds_at_once():
    loop = Loop("bf16-mixed", snapshot_interval=4)
    loop.run(5)
    with torch.no_grad():
        loop.model.get_submodule(W2).weight[0, 0] = float("nan")  # as a corrupted update would leave it
    loop.run(6, start=5)  # step 6 trains on the NaN weight
    (incident,) = loop.guard.incidents
    assert incident["nonfinite_parameters"] == 1 and incident["rewound_to"] == 4
    assert incident["action"].startswith("1 parameter and 0 optimizer-state tensors are non-finite: rewound")
    assert all(bool(torch.isfinite(p).all()) for p in loop.model.parameters())


@pytest.mark.parametrize("max_norm", [1.0, 0.0])
def test_a_gradient_spike_with_a_healthy_loss_is_a_warning_clipped_or_not(max_norm, caplog):
    # issue 55 item 10: with clipping off such a spike was an incident and rewound (healthy runs stopped as unstable)
    loop = Loop("bf16-mixed", snapshot_interval=4)
    loop.run(10, blowup={7}, max_norm=max_norm)
    spikes, other = (loop.guard.clipped_spikes, loop.guard.grad_spikes)[::1 if max_norm else -1]
    assert spikes == [7] and other == [] and loop.guard.rewinds == 0
    assert all(i["step"] != 7 for i in loop.guard.incidents)
    assert max(loop.guard.monitor.norms) < 100  # the spike stays out of the window
    assert "step 7: gradient norm" in caplog.text
    assert ("clipping bounded the update" if max_norm else "the loss is healthy (clipping is off") in caplog.text
    summary = loop.guard.summary()
    assert summary["clipped_grad_spikes"] == loop.guard.clipped_spikes and summary["grad_spikes"] == loop.guard.grad_spikes


def test_a_loop_of_ones_own_needs_snapshots_to_rewind():
    # issue 55 item 11: accepted before, then the first rewind raised TypeError
    from mixprec.errors import UserError
    from mixprec.stability import StabilityConfig, StabilityGuard

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UserError, match="snapshot_interval 0 rewinds to the last checkpoint"):
        StabilityGuard.for_loop(model, opt, config=StabilityConfig(snapshot_interval=0))
    guard = StabilityGuard.for_loop(model, opt, config=StabilityConfig(snapshot_interval=0, max_rewinds=0))
    assert guard.after_step(1, float("nan"), grad_norm=float("nan")) == 1  # reported, nothing to rewind to
    assert guard.incidents[0]["action"].startswith("none (stability.max_rewinds 0")


def test_the_rewound_state_equals_the_snapshot_bit_for_bit():
    a = Loop("bf16-mixed", snapshot_interval=4)
    a.run(4)
    at_snapshot = [p.detach().clone() for p in a.model.parameters()]
    moments = [s["exp_avg"].clone() for s in a.opt.state.values()]
    a.guard.after_step(5, float("nan"), grad_norm=float("nan"))  # an incident without a re-run
    assert all(torch.equal(x, p) for x, p in zip(at_snapshot, a.model.parameters()))
    assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, a.opt.state.values()))


def test_it_gives_up_after_max_rewinds():
    loop = Loop("bf16-mixed", snapshot_interval=2, max_rewinds=1)
    with pytest.raises(TrainingUnstable, match="still unstable after 1 rewinds"):
        loop.run(8, poison={3, 4, 5})  # 3: skipped; 4: a repeat, rewind to 2; 3 and 4 again; 5: gives up
    assert [i["action"].split(" (")[0] for i in loop.guard.incidents][-1].startswith("gave up")


def test_report_only_never_rewinds():
    loop = Loop("bf16-mixed", max_rewinds=0)
    assert loop.run(6, poison={3}) == 6
    (incident,) = loop.guard.incidents
    assert incident["step"] == 3 and "report only" in incident["action"] and loop.guard.rewinds == 0


def test_an_fp8_layer_that_makes_the_first_nonfinite_value_is_promoted_without_a_rewind(caplog):
    loop = Loop("fp8-rowwise", snapshot_interval=4)
    fp8 = loop.model.get_submodule(W2)
    assert isinstance(fp8, FP8Linear)
    loop.run(3)
    handle = fp8.register_forward_hook(_bad_scale)  # a fault of its FP8 scale: gone once it is out of FP8
    loop.run(4, start=3)  # step 4 goes non-finite in W2's FP8 GEMM
    handle.remove()
    loop.run(8, start=4)
    (incident,) = loop.guard.incidents
    assert incident["finding"]["module"] == W2 and incident["promoted"]["from"] == "fp8-rowwise"
    assert incident["action"].startswith(f"promoted {W2} from fp8-rowwise to bfloat16") and loop.guard.rewinds == 0
    layer = loop.model.get_submodule(W2)
    assert layer is fp8 and not layer.fp8_enabled  # the same module (FSDP2 keeps it), its GEMM a plain one
    assert loop.policy.layout.modules[W2].compute == torch.bfloat16 and W2 not in loop.policy.layout.fp8()
    assert loop.policy.summary()["promoted"][W2]["step"] == 4
    assert loop.policy.state_dict()["promoted"] == loop.policy.promoted  # checkpoints keep it
    assert f"[PROMOTE] step 4: {W2} computes in bfloat16 from now on, not fp8-rowwise" in caplog.text
    assert all(bool(torch.isfinite(p).all()) for p in loop.model.parameters())


def test_a_promotion_whose_replay_still_fails_is_put_back():
    loop = Loop("fp8-rowwise", snapshot_interval=4)
    weight = loop.model.get_submodule(W2).weight

    def poison_w2(module, args, output):  # by the weight: reaches W2 in FP8 or out of it
        return _poison(module, args, output) if getattr(module, "weight", None) is weight else output

    loop.run(3)
    handle = torch.nn.modules.module.register_module_forward_hook(poison_w2)
    try:
        loop.run(4, start=3)
    finally:
        handle.remove()
    (incident,) = loop.guard.incidents
    assert incident["finding"]["module"] == W2 and "promoted" not in incident
    assert loop.model.get_submodule(W2).fp8_enabled and loop.policy.promoted == {}
    assert incident["action"].startswith("skipped")  # the usual recovery: the step was not applied


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-mixed-8bit"])
def test_training_after_a_rewind_leaves_the_snapshot_as_it_was(preset):
    """A second rewind restores the snapshot's state, not what the steps after the first wrote into it."""
    loop = Loop(preset, snapshot_interval=4)
    loop.run(4)
    saved = loop.guard._snapshot[1]["optimizer"]["state"]
    before = {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for i, s in saved.items()}
    loop.guard.after_step(5, float("nan"), grad_norm=float("nan"))  # rewound to step 4
    loop.run(7, start=4)
    assert all(torch.equal(v, saved[i][k]) for i, s in before.items() for k, v in s.items())
    loop.guard.after_step(8, float("nan"), grad_norm=float("nan"))  # rewound to step 4 again
    live = loop.opt.state_dict()["state"]
    assert all(torch.equal(v, live[i][k]) for i, s in before.items() for k, v in s.items())
