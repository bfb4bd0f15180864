"""The trainer's step never reads a device value on the host: every decision (skip, clip,
loss scale, step counts) is made on the device, and the loop reads once per read step
(metrics.log_freq, evaluation, checkpoint, guard snapshot). Counted with a dispatch mode
(tests/train/host_reads.py) in every preset, with clipping, two micro-batches, the
stability guard and a non-finite step that is not a read step; compiled; on two gloo
ranks under FSDP2 and DDP."""

import json
from pathlib import Path

import pytest

from host_reads_run import NAN_STEP, check, counted_run
import rank_pool
from mixprec.precision.presets import PRESETS

# a read step reads the losses and the policy's step figures (2); after the last one the loop
# also evaluates and writes the summary (the loss scale): 4
AT_MOST = 4


def overrides(folder: Path, source: Path, preset: str, **extra) -> dict[str, str]:
    return {"model.flavor": "debug", "data.source": str(source), "job.dump_folder": str(folder),
            "training.steps": "12", "training.seq_len": "32", "training.local_batch_size": "2",
            "training.global_batch_size": "4", "training.warmup_steps": "2", "training.eval_interval": "0",
            "training.max_norm": "1.0", "stability.snapshot_interval": "10", "metrics.progress_bar": "false",
            "metrics.plot": "false", "training.device": "cpu", "checkpoint.enable": "false",
            "precision.preset": preset, "training.eps": "1e-4" if preset == "fp16-true" else "1e-8", **extra}


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_no_step_reads_the_device_in_any_preset(tmp_path, text_file, preset):
    trainer, reads = counted_run(overrides(tmp_path, text_file, preset))
    counts = check(trainer, reads, AT_MOST)
    assert trainer.accum == 2 and counts  # the read steps did read
    assert {label[1] for label in counts if label} <= {10, 12}  # log_freq 10 and the last step
    rows = records(tmp_path)
    assert len(rows) == 12 and rows[NAN_STEP - 1]["skipped"]  # the non-finite step, skipped on the device
    assert sum(r["skipped"] for r in rows) <= (2 if PRESETS[preset].loss_scaling else 1)
    assert [i["step"] for i in trainer.guard.incidents] == [NAN_STEP]  # and handed to the guard at the read
    assert trainer.guard.rewinds == 0


def test_log_freq_1_reads_every_step(tmp_path, text_file):
    trainer, reads = counted_run(overrides(tmp_path, text_file, "bf16-mixed", **{"metrics.log_freq": "1"}),
                                 nan_step=None)
    counts = check(trainer, reads, AT_MOST)
    assert sorted({label[1] for label in counts if label}) == list(range(1, 13))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_no_step_reads_the_gpu(tmp_path, text_file, preset):
    # on CUDA a read is a copy to the CPU (tolist included) or a _local_scalar_dense: both counted;
    # and any other synchronising call inside a step raises (the CPU twin: the test above)
    trainer, reads = counted_run(overrides(tmp_path, text_file, preset, **{"training.device": "cuda"}),
                                 sync_errors=True)
    check(trainer, reads, AT_MOST)
    assert records(tmp_path)[NAN_STEP - 1]["skipped"]


@pytest.mark.slow
def test_no_compiled_step_reads_the_device(tmp_path, text_file, preset="fp32"):
    # fp32: compiled on every CPU (bf16-mixed runs eager where this CPU emulates its GEMMs) and
    # the same step path as bf16-mixed (the fused AdamW, no loss scaler)
    import torch._dynamo.utils

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # no NaN injected: a hook added to a compiled block is not seen (the drills run such a step eagerly)
    trainer, reads = counted_run(overrides(tmp_path, text_file, preset, **{"compile.enable": "true"}), nan_step=None,
                                 python=True)
    check(trainer, reads, AT_MOST)
    if not trainer.policy.emulate_matmul:  # an emulated mode runs eager, logged (a CPU without native bf16 GEMMs)
        assert torch._dynamo.utils.counters["frames"]["ok"] > 0  # the blocks ran compiled


# each distinct step path on two ranks (every preset is counted in one process above): the
# fused AdamW on FSDP2's shards, FP32 shards as masters with the loss scaler's all-reduced
# flag, the bf16 kernels, the delayed amaxes' all-reduce, mixprec's AdamW, a microscaled format,
# DDP's replicated masters
@pytest.mark.slow
@pytest.mark.parametrize("layout,presets", [
    ({"parallelism.data_parallel_shard_degree": "2"},
     ["fp32", "fp16-master", "bf16-kahan", "fp8-delayed", "fp8-blockwise", "nvfp4"]),
    ({"parallelism.data_parallel_replicate_degree": "2", "parallelism.data_parallel_shard_degree": "1"},
     ["bf16-mixed", "fp16-master", "fp8-blockwise"]),
], ids=["fsdp2", "ddp"])
def test_no_step_reads_the_device_on_two_ranks(tmp_path, text_file, layout, presets):
    # Collectives (the gradient reduction, the overflow flag's all-reduce, the norm of DTensor
    # gradients, the delayed-scaling amaxes' all-reduce) make a rank wait for its peers; none
    # reads a value to the host. Every preset in one process group, one after the other.
    run = overrides(tmp_path / "run", text_file, ",".join(presets), **{"training.local_batch_size": "1", **layout})
    script = Path(__file__).with_name("host_reads_run.py")
    proc = rank_pool.torchrun(str(script), str(tmp_path), *(f"{k}={v}" for k, v in run.items()), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for preset in presets:
        for rank in (0, 1):
            seen = json.loads((tmp_path / f"{preset}-rank{rank}.json").read_text())
            inside = [e for e in seen["events"] if e[0] and e[0][0] == "in"
                      and not (e[0][1] in seen["read_steps"] and e[2].endswith(" settle"))]
            stray = [e for e in seen["events"] if e[0] and e[0][1] not in seen["read_steps"]]
            assert not inside and not stray, (preset, (inside + stray)[:5])
            assert seen["incidents"] == [NAN_STEP], preset
        assert NAN_STEP in json.loads((tmp_path / f"{preset}-rank0.json").read_text())["skipped"], preset


@pytest.mark.parametrize("preset", ["fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4", "mxfp4"])
def test_no_step_of_a_mixture_of_experts_reads_the_device(tmp_path, text_file, preset):
    # the routing, the grouped experts in the recipe and the combine: no read between the read steps
    # (inside the experts' operators, where this counter does not look, tests/narrow/test_experts.py
    # traces them on the meta device, where any read fails)
    trainer, reads = counted_run(overrides(tmp_path, text_file, preset, **{"model.flavor": "moe-debug"}), nan_step=None)
    counts = check(trainer, reads, AT_MOST)
    assert counts and {label[1] for label in counts if label} <= {10, 12}
