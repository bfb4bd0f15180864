"""The same tiny model, data and seed for mixprec's own loop and each framework integration."""

import torch

from mixprec import Policy
from mixprec.precision.scaling_config import LossScaleConfig

STEPS, LR, MAX_NORM = 20, 1e-3, 1.0
PRESETS = ["fp32", "bf16-mixed", "fp16-mixed", "fp8-rowwise"]


def settings(preset: str) -> dict:
    """fp16-mixed starts at a loss scale its gradients overflow: the first steps are skipped."""
    return {"loss_scale": LossScaleConfig(init_scale=2.0**24)} if preset == "fp16-mixed" else {}


def tiny_model(state: dict | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    if state is not None:
        model.load_state_dict(state)
    return model


def batches(n: int = STEPS) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 256, (4, 32), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR, foreach=False)


def own_loop(preset: str, data: list[dict], state: dict | None = None,
             results: list | None = None) -> tuple[list[float], dict]:
    """mixprec's own loop: the reference every integration is compared with. results: each
    step's StepResult is appended there."""
    model = tiny_model(state)
    policy = Policy.from_preset(preset, **settings(preset))
    policy.prepare_model(model, "cpu")
    # setup puts mixprec's AdamW in place where the preset keeps other moments (8-bit)
    _, opt = policy.setup(model, optimizer(model.parameters()))
    losses = []
    for batch in data:
        with policy.autocast("cpu"):
            loss = model(**batch).loss
        policy.backward(loss)
        result = policy.step(opt, max_norm=MAX_NORM)
        losses.append(loss.item())
        if results is not None:
            results.append(result)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    strip = lambda k: k.split("model.", 1)[1] if k.startswith("model.model.") or k.startswith("model.lm_head") else k  # noqa: E731
    b = {strip(k): v for k, v in b.items()}
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


DRILL_STEP = 5  # 1-based: the step whose forward puts a NaN into DRILL_MODULE's output
DRILL_MODULE = "layers.0.mlp.down_proj"


def poison(model: torch.nn.Module):
    """A NaN in the first element of DRILL_MODULE's output (stability.inject's nan drill); returns the hook handle."""
    from mixprec.stability.drills import _poison

    module = next(m for name, m in model.named_modules() if name.endswith(DRILL_MODULE))
    return module.register_forward_hook(_poison)


def check_drill(losses: list[float], incidents: list[dict], policy, weights: dict) -> None:
    """The drill's step was skipped, located at DRILL_MODULE (forward), reported, and the FP8 layer
    promoted; every other step and every weight stayed finite."""
    import math

    assert math.isnan(losses[DRILL_STEP - 1])
    assert all(math.isfinite(x) for i, x in enumerate(losses) if i != DRILL_STEP - 1)
    assert [i["step"] for i in incidents] == [DRILL_STEP]
    finding = incidents[0]["finding"]
    assert finding["module"].endswith(DRILL_MODULE) and finding["phase"] == "forward"
    assert "promoted" in incidents[0]["action"]
    assert [f for f in policy.promoted if f.endswith(DRILL_MODULE)]
    assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())


def poison_batch(model: torch.nn.Module, batch: dict):
    """A NaN in DRILL_MODULE's output whenever the model runs on `batch` (its input_ids), and
    only then: a fault that comes with the data, so only a re-run of that step's own batch
    reproduces it. Returns the two hook handles."""
    module = next(m for name, m in model.named_modules() if name.endswith(DRILL_MODULE))
    seen = {"bad": False}

    def look(_, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen["bad"] = ids is not None and ids.shape == batch["input_ids"].shape and torch.equal(ids, batch["input_ids"])

    def poison_if_bad(m, inputs, out):
        if seen["bad"]:
            out = out.clone()
            out.view(-1)[0] = float("nan")
            return out

    from transformers import LlamaForCausalLM

    top = next(m for m in model.modules() if isinstance(m, LlamaForCausalLM))  # inside any framework's wrapper
    return [top.register_forward_pre_hook(look, with_kwargs=True), module.register_forward_hook(poison_if_bad)]


BAD_STEPS = (5, 18)  # 1-based steps whose batch poisons DRILL_MODULE: read at step 8 and at the end (read_every 8)


def check_delayed_location(incidents: list[dict]) -> None:
    """Each bad step, read up to 7 steps later, was located on its own batch (a re-run of the
    batch current at the read stays finite and finds nothing)."""
    assert [i["step"] for i in incidents] == list(BAD_STEPS), incidents
    for incident in incidents:
        assert incident["finding"] and incident["finding"]["module"].endswith(DRILL_MODULE), incident
