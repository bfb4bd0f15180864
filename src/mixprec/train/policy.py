"""The precision policy a run trains under, built from its config's [precision], [fp8], [loss_scale] tables and
TorchTitan's [training] dtype keys (the config itself stays torch-free)."""

from __future__ import annotations

import logging

from mixprec.config import Precision, Training
from mixprec.errors import UserError
from mixprec.precision.fp8_config import FP8Config
from mixprec.precision.scaling_config import LossScaleConfig


def build_policy(precision: Precision, training: Training,
                 loss_scale: LossScaleConfig = LossScaleConfig(), fp8: FP8Config = FP8Config()):
    """The precision policy (a mixprec.Policy) from [precision], [fp8] and TorchTitan's
    [training] dtype keys. The same field given twice with different values is an error
    naming both keys."""
    from mixprec.precision import Policy, parse_dtype
    from mixprec.precision.presets import FP32, preset_for

    sources = {
        "storage_dtype": [("precision.storage_dtype", precision.storage_dtype), ("training.dtype", training.dtype)],
        "param_dtype": [("precision.param_dtype", precision.param_dtype),
                        ("training.mixed_precision_param", training.mixed_precision_param)],
        "reduce_dtype": [("precision.reduce_dtype", precision.reduce_dtype),
                         ("training.mixed_precision_reduce", training.mixed_precision_reduce)],
    }
    given, labels = {}, {"preset": "precision.preset"}
    for field, pairs in sources.items():
        pairs = [(label, value) for label, value in pairs if value]
        dtypes = {parse_dtype(value, label) for label, value in pairs}
        if len(dtypes) > 1:
            (l1, v1), (l2, v2) = pairs
            raise UserError(f"{l1} = {v1!r} contradicts {l2} = {v2!r}; give one")
        if pairs:
            labels[field], given[field] = pairs[0]
    from mixprec.precision.spec import Override

    overrides = tuple(Override.parse(r) for r in precision.override)
    if precision.plan:
        from mixprec.plan.file import read_plan

        plan = read_plan(precision.plan)
        if plan.base and plan.base != (precision.preset or "bf16-mixed"):
            logging.getLogger("mixprec").warning("precision.plan %s was measured under %s; this run's base mode is %s",
                                                 precision.plan, plan.base, precision.preset or "from the dtype keys")
        overrides += plan.overrides()
    fp8_args = dict(fp8_recipe=fp8.recipe, fp8_options=fp8.options, fp8_exclude=fp8.filter_fqns,
                    fp8_emulate=fp8.emulate, overrides=overrides)
    from mixprec.precision.presets import PRESETS, resolve_preset_name

    preset_states = PRESETS[resolve_preset_name(precision.preset)].optimizer_states if precision.preset else None
    states = precision.states(preset_states)
    if states is not None:
        fp8_args["optimizer_states"] = states
    if precision.preset:
        return Policy.from_preset(precision.preset, labels=labels, emulate_matmul=precision.emulate,
                                  loss_scale=loss_scale, tf32=precision.tf32, update_seed=training.seed, **fp8_args,
                                  **given)
    # TorchTitan's defaults: training.dtype float32, mixed_precision_param bfloat16; a
    # bfloat16 model (training.dtype = "bfloat16") computes in bfloat16.
    storage = parse_dtype(given.get("storage_dtype", "float32"), labels.get("storage_dtype", "storage_dtype"))
    param = parse_dtype(given.get("param_dtype", "bfloat16" if storage == FP32 else storage),
                        labels.get("param_dtype", "param_dtype"))
    reduce = given.get("reduce_dtype", "float32")
    name = preset_for(storage, param)
    if name is None:  # no mode stores in one dtype and computes in a wider one: Policy says why
        return Policy(param_dtype=param, storage_dtype=storage, reduce_dtype=reduce, tf32=precision.tf32,
                      **({"optimizer_states": states} if states is not None else {}))
    return Policy.from_preset(name, emulate_matmul=precision.emulate, loss_scale=loss_scale, tf32=precision.tf32,
                              reduce_dtype=reduce, **fp8_args)
