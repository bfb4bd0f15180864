"""`torchrun -m mixprec train` on two CPU processes (gloo) against one process: the commands run on
tests/rank_pool.py's ranks, in the environment torchrun gives its workers (torchrun itself: test_elastic.py)."""

import json

import pytest

import rank_pool
from conftest import run_train, tiny_args, tiny_qwen3_moe
import torch

from mixprec import UserError
from mixprec.config import Parallelism, load_config
from mixprec.train.policy import build_policy
from mixprec.distributed.parallel import ParallelDims
from mixprec.train.parallelize import parallelize


def torchrun(folder, source, *extra, ranks: int = 2) -> list[dict]:
    args = tiny_args(folder, source, "--checkpoint.enable", "false", "--training.local_batch_size", str(4 // ranks),
                     *extra)
    proc = rank_pool.torchrun("-m", "mixprec", *args, ranks=ranks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tmp_path_factory, text_file):
    folder = tmp_path_factory.mktemp("single")
    return run_train(folder, text_file, "--checkpoint.enable", "false", "--precision.preset", "fp32")


@pytest.mark.parametrize("layout", [
    ("--parallelism.data_parallel_shard_degree", "2"),  # FSDP2
    ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),  # DDP
])
def test_two_ranks_match_one_process_in_fp32(tmp_path, text_file, single, layout):
    records = torchrun(tmp_path / "run", text_file, "--precision.preset", "fp32", *layout)
    assert len(records) == len(single)
    for a, b in zip(records, single):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-5
        assert ("val_loss" in a) == ("val_loss" in b)
        if "val_loss" in a:
            assert abs(a["val_loss"] - b["val_loss"]) / b["val_loss"] < 1e-5


@pytest.mark.slow
def test_fsdp_with_checkpointing_chunked_loss_and_compile_matches_one_process(tmp_path, text_file, single):
    # fully_shard over compiled blocks that recompute in backward, the loss in chunks
    records = torchrun(tmp_path / "run", text_file, "--precision.preset", "fp32", "--activation_checkpoint.mode",
                       "full", "--model.loss", "chunked", "--compile.enable")
    for a, b in zip(records, single):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-4  # Inductor reorders sums: not 1e-5


def test_hsdp_on_four_ranks_matches_one_process(tmp_path, text_file, single):
    # a (replicate 2, shard 2) mesh: shard within pairs, all-reduce across them
    records = torchrun(tmp_path / "hsdp", text_file, "--precision.preset", "fp32",
                       "--parallelism.data_parallel_replicate_degree", "2", ranks=4)
    for a, b in zip(records, single):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-5


def test_fsdp_gradient_accumulation_matches(tmp_path, text_file, single):
    # 2 ranks x 1 sequence x 2 micro-batches = the single process's 4 sequences
    records = torchrun(tmp_path / "acc", text_file, "--precision.preset", "fp32", "--training.local_batch_size", "1",
                       "--training.global_batch_size", "4")
    for a, b in zip(records, single):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-5


@pytest.mark.parametrize("degrees, words", [
    ((3, -1, 1, 2), ["replicate_degree 3", "world size 2"]),
    ((1, 3, 1, 2), ["product is 2"]),
    ((1, -1, 3, 2), ["tensor_parallel_degree 3", "divisor of 2"]),
    ((2, 1, 2, 4), ["DDP", "does not combine"]),
])
def test_bad_degrees(degrees, words):
    with pytest.raises(UserError) as e:
        ParallelDims.resolve(*degrees)
    assert all(w in str(e.value) for w in words)


@pytest.mark.parametrize("tp, ranks, extra", [
    (2, 2, ()),  # tensor parallel alone: every rank trains on the whole batch
    (2, 4, ("--training.local_batch_size", "2")),  # FSDP 2 x TP 2
])
def test_tensor_parallel_matches_one_process(tmp_path, text_file, single, tp, ranks, extra):
    records = torchrun(tmp_path / "tp", text_file, "--precision.preset", "fp32", "--training.local_batch_size", "4",
                       "--parallelism.tensor_parallel_degree", str(tp), *extra, ranks=ranks)
    for a, b in zip(records, single):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-5


def test_tensor_parallel_degree_must_divide_the_heads(tmp_path, text_file):
    folder = tmp_path / "bad"
    args = tiny_args(folder, text_file, "--parallelism.tensor_parallel_degree", "2", "--model.n_kv_heads", "1")
    proc = rank_pool.torchrun("-m", "mixprec", *args)
    assert proc.returncode != 0
    assert "tensor_parallel_degree 2 does not divide the model's n_kv_heads 1" in proc.stderr
    assert not folder.exists()


def test_pipeline_parallelism_is_refused():
    with pytest.raises(UserError, match="pipeline parallelism is out of scope"):
        Parallelism(pipeline_parallel_degree=2)


def torchrun_ckpt(folder, source, *extra) -> list[dict]:
    args = tiny_args(folder, source, "--training.local_batch_size", "2", "--checkpoint.interval", "3",
                     "--checkpoint.keep_latest_k", "0", "--precision.preset", "fp32", *extra)
    proc = rank_pool.torchrun("-m", "mixprec", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def plant_payload(folder, marker):
    """Rewrite the DCP shards of `folder` (extras.pt kept) with the first param group's lr an
    object whose unpickling creates `marker`; returns it."""
    import pathlib
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from conftest import Payload

    flat = folder.parent / "flat.pt"
    dcp_to_torch_save(folder, flat)  # this run's own folder, just written
    state = torch.load(flat, weights_only=False)
    state["optimizer"]["param_groups"][0]["lr"] = Payload(marker)
    for f in folder.iterdir():
        if f.name != "extras.pt":
            f.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    return pathlib.Path(marker)


def test_dcp_checkpoint_from_two_ranks_resumes_on_one_and_on_two(tmp_path, text_file):
    import shutil

    full = torchrun_ckpt(tmp_path / "run", text_file)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir()) == ["step-3", "step-6"]
    saved, planted = tmp_path / "saved", tmp_path / "planted"
    shutil.copytree(tmp_path / "run", saved)
    shutil.copytree(tmp_path / "run", planted)
    # a folder whose optimizer entry would run code when unpickled: one line, exit 2, and no code ran
    marker = plant_payload(planted / "checkpoint" / "step-6", tmp_path / "code-ran")
    from mixprec.cli import main

    assert main(tiny_args(planted, text_file, "--training.local_batch_size", "4", "--checkpoint.interval", "3",
                          "--precision.preset", "fp32", "--training.steps", "9")) == 2
    assert not marker.exists()
    # 2 -> 1: lose step 6, resume in one process on the same global batch
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-6")
    one = run_train(tmp_path / "run", text_file, "--training.local_batch_size", "4", "--checkpoint.interval", "3",
                    "--checkpoint.keep_latest_k", "0", "--precision.preset", "fp32")
    # 2 -> 2
    shutil.rmtree(saved / "checkpoint" / "step-6")
    two = torchrun_ckpt(saved, text_file)
    for a, b, c in zip(full, one, two):
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5 and abs(a["loss"] - c["loss"]) / a["loss"] < 1e-5


@pytest.mark.slow  # four runs on two ranks: 9-22 s here
@pytest.mark.parametrize("preset", ["bf16-kahan", "bf16-sr"])
def test_bf16_updates_under_fsdp_track_one_process_and_resume_exactly(tmp_path, text_file, preset):
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    one = run_train(tmp_path / "one", text_file, "--checkpoint.enable", "false", "--precision.preset", preset)
    full = torchrun_ckpt(tmp_path / "run", text_file, "--precision.preset", preset)
    for a, b in zip(full, one):  # not bit-identical: the ranks' gradients are summed in another order
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-2
    keys = FileSystemReader(str(tmp_path / "run" / "checkpoint" / "step-3")).read_metadata().state_dict_metadata
    compensations = [k for k in keys if k.endswith("kahan_compensation")]
    assert len(compensations) == (len([k for k in keys if k.endswith(".exp_avg")]) if preset == "bf16-kahan" else 0)
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-6")
    resumed = torchrun_ckpt(tmp_path / "run", text_file, "--precision.preset", preset)  # 2 -> 2 from step 3
    assert [r["loss"] for r in resumed[3:]] == [r["loss"] for r in full[3:]]


@pytest.mark.parametrize("layout", [
    (),  # FSDP2
    ("--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"),
    ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),  # DDP
])
def test_one_process_checkpoint_resumes_on_two_ranks(tmp_path, text_file, layout):
    flags = ("--training.local_batch_size", "4", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0",
             "--precision.preset", "fp32")
    one = run_train(tmp_path / "run", text_file, *flags)
    (tmp_path / "run" / "checkpoint" / "step-6.pt").unlink()
    two = torchrun_ckpt(tmp_path / "run", text_file, *layout)  # 1 -> 2: each rank cuts its shard from the file
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps_this_run"] == 3  # resumed at 3
    assert len(two) == len(one)
    for a, b in zip(one[3:], two[3:]):
        assert abs(a["loss"] - b["loss"]) / a["loss"] < 1e-5


def test_fp16_mixed_under_ddp_and_fsdp_tracks_one_process(tmp_path, text_file):
    flags = ("--precision.preset", "fp16-mixed", "--loss_scale.init_scale", "1e9", "--loss_scale.max_scale", "1e9",
             "--loss_scale.fallback_after", "0")
    one = run_train(tmp_path / "one", text_file, "--checkpoint.enable", "false", *flags)
    ddp = torchrun(tmp_path / "ddp", text_file, *flags, "--parallelism.data_parallel_replicate_degree", "2",
                   "--parallelism.data_parallel_shard_degree", "1")
    fsdp = torchrun(tmp_path / "fsdp", text_file, *flags)
    for run in (ddp, fsdp):
        # the same steps overflow (a 1e9 scale overflows float16 at first) and the scale follows
        assert [r["skipped"] for r in run] == [r["skipped"] for r in one]
        assert [r["loss_scale"] for r in run] == [r["loss_scale"] for r in one]
        for a, b in zip(run, one):
            assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-3  # float16 sums in another order


def test_audit_under_fsdp_sees_the_collectives(tmp_path, text_file):
    args = tiny_args(tmp_path / "unused", text_file, "--precision.preset", "bf16-mixed", "--training.local_batch_size",
                     "2", "--json")
    proc = rank_pool.torchrun("-m", "mixprec", "audit", *args[1:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    stages = {r["stage"]: r["observed"] for r in report["stages"]}
    assert report["path"].startswith("fully_shard")
    assert stages["stored parameters"] == ["float32"] and stages["compute parameters (matmul operands)"] == ["bfloat16"]
    assert stages["all-gather traffic"] == ["bfloat16"] and stages["reduce-scatter traffic"] == ["float32"]
    assert stages["reduced gradients"] == ["float32"] and stages["optimizer states"] == ["float32"]


@pytest.mark.parametrize("layout", [
    ("--parallelism.data_parallel_shard_degree", "2"),  # FSDP2: all-gathered in bfloat16, then cast to FP8
    ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),  # DDP
], ids=["fsdp2", "ddp"])
def test_fp8_delayed_on_two_ranks_tracks_one_process(tmp_path, text_file, layout):
    # Not bit-identical: each rank scales its half of the batch by its own amax in the first
    # step; after that the amax histories are reduced to their max over ranks.
    single = run_train(tmp_path / "one", text_file, "--checkpoint.enable", "false", "--precision.preset", "fp8-delayed")
    records = torchrun(tmp_path / "run", text_file, "--precision.preset", "fp8-delayed", *layout)
    assert len(records) == len(single)
    for a, b in zip(records, single):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-2


def test_fp8_with_tensor_parallel_is_refused_before_any_work():
    cfg = load_config(overrides={"precision.preset": "fp8-tensorwise"})
    policy = build_policy(cfg.precision, cfg.training, fp8=cfg.fp8)
    with pytest.raises(UserError, match="FP8 layers are not tensor-parallel"):
        parallelize(torch.nn.Module(), ParallelDims.resolve(1, 1, 2, 2), policy, torch.device("cpu"),
                    pcfg=cfg.parallelism, ac_mode="none", compile_components=None)


def test_ddp_saves_one_file_and_resumes_exactly(tmp_path, text_file, preset="fp16-master"):
    # under DDP every rank holds the whole state, the masters of fp16-master included (which
    # DCP's state-dict helpers cannot name): rank 0 writes one file, as one process does; the
    # guard's snapshots (every 3 steps here) are each rank's own copy
    ddp = ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
           "--precision.preset", preset, "--stability.snapshot_interval", "3")
    full = torchrun_ckpt(tmp_path / "run", text_file, *ddp)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir()) == ["step-3.pt", "step-6.pt"]
    (tmp_path / "run" / "checkpoint" / "step-6.pt").unlink()
    resumed = torchrun_ckpt(tmp_path / "run", text_file, *ddp)  # 2 -> 2 from step 3
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps_this_run"] == 3
    assert [r["loss"] for r in resumed[3:]] == [r["loss"] for r in full[3:]]


def test_a_moe_model_under_fsdp_tracks_one_process(tmp_path, text_file):
    """A transformers Qwen3-MoE model, fp8-rowwise, on two FSDP2 ranks: its routers sharded as units of
    their own gathered in float32 (FSDP2 would hand them over in bfloat16 otherwise, and the float32
    router fail), the experts in the recipe; the losses track one process (FSDP2 gathers the weights in
    bfloat16 before their FP8 casts, where one process casts the FP32 weights: close, not equal)."""
    pytest.importorskip("transformers")
    config = tiny_qwen3_moe(tmp_path / "moe")
    hf = ("--model.hf_config", str(config), "--data.tokenizer", "byte", "--precision.preset", "fp8-rowwise")
    one = run_train(tmp_path / "one", text_file, "--checkpoint.enable", "false", *hf)
    two = torchrun(tmp_path / "two", text_file, "--parallelism.data_parallel_shard_degree", "2", *hf)
    a, b = [r["loss"] for r in one if "loss" in r], [r["loss"] for r in two if "loss" in r]
    assert len(a) == len(b) and all(abs(x - y) / x < 0.02 for x, y in zip(a, b)), (a, b)


def test_the_moe_flavor_on_two_fsdp_ranks_matches_one_process_in_fp32(tmp_path, text_file):
    # moe-debug: experts sharded by FSDP2 (4 of 8 a rank), routers units of their own, the balancing bias
    # moved by both ranks' token counts summed: the losses and the routers' load and bias as one process's
    flags = ("--checkpoint.enable", "false", "--precision.preset", "fp32", "--model.flavor", "moe-debug",
             "--metrics.log_freq", "1")
    one = run_train(tmp_path / "one", text_file, *flags)
    two = torchrun(tmp_path / "two", text_file, "--parallelism.data_parallel_shard_degree", "2", *flags)
    assert len(one) == len(two)
    for a, b in zip(two, one):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 1e-5, (a, b)
        assert a["router_load"] == b["router_load"]
        assert (a["expert_bias_min"], a["expert_bias_max"]) == pytest.approx((b["expert_bias_min"],
                                                                              b["expert_bias_max"]), abs=1e-7)
