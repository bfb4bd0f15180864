"""Config to the parts of a run: one builder for the trainer, the audit and the
out-of-memory advice (which plans the model the trainer would build).

    parts = build(config)                 # device, policy, data, model, optimizer, scheduler,
                                          # training state, stability guard
    parts = build(config, accum=2)        # the audit: two micro-batches whatever the config says
    args = model_shape(config, vocab_size, device_type)   # the model's shape, nothing built

Checks that can fail on bad input run before anything is written or built.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mixprec.config import Config
from mixprec.data.corpus import load_corpus
from mixprec.data.loader import TrainLoader, val_batches
from mixprec.data.shards import is_prepared, open_prepared
from mixprec.data.tokenizer import build_tokenizer, tokenizer_path
from mixprec.distributed.expert_parallel import check as check_expert_parallel
from mixprec.distributed.parallel import ParallelDims, init_distributed, resolve_device
from mixprec.distributed.tensor_parallel import check_tensor_parallel
from mixprec.errors import UserError
from mixprec.interop.adapters import llama_fields
from mixprec.interop.checkpoint import CheckpointManager
from mixprec.interop.hf_folder import HFFolder, is_hf_folder
from mixprec.interop.load import empty_parameters, load_weights, materialize, open_source
from mixprec.models.llama import FLAVORS, ModelArgs, build_model, model_args, resolve_attention
from mixprec.models.loss import GPU_LOGITS_SHARE, loss_chunk
from mixprec.optim import AdamW
from mixprec.optim.state_formats import StateFormat
from mixprec.precision import Policy
from mixprec.precision.optimizer_states import embeddings_of
from mixprec.precision.spec import Update
from mixprec.rng import seed_all
from mixprec.plan.live import Replanner
from mixprec.stability.guard import StabilityGuard
from mixprec.train.parallelize import parallelize
from mixprec.train.policy import build_policy
from mixprec.train.run_folder import check_writable
from mixprec.train.state import TrainingState

logger = logging.getLogger(__name__)


@dataclass
class Parts:
    config: Config
    folder: Path
    device: torch.device
    policy: Policy
    rank: int
    dims: ParallelDims
    accum: int  # micro-batches per optimizer step
    tokenizer: object
    loader: TrainLoader
    val: list
    args: ModelArgs
    raw_model: torch.nn.Module  # the Llama module itself
    model: torch.nn.Module  # what the loop calls: raw_model, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    meta: dict  # what a checkpoint must match to be resumed
    state: TrainingState | None = None  # save, resume, snapshot and rewind over these parts
    guard: StabilityGuard | None = None  # the stability guard, where [stability] enables it
    replanner: Replanner | None = None  # re-planning of the FP8 layers, where plan.interval asks for it


def build_optimizer(model: torch.nn.Module, cfg, fused: bool = True, foreach: bool | None = None,
                    states: StateFormat | None = None, compensated: bool = False,
                    convert: bool = False) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norm weights); with moments other than
    its parameters' dtype (`states`: the policy's optimizer_states), mixprec's AdamW (same
    update, narrower state; `compensated`: bf16-kahan's weights)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if states is not None:
        logger.info("optimizer: AdamW with %s moments (one parameter at a time, FP32 arithmetic)", states.label)
        return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, states=states,
                     embeddings=embeddings_of(model), compensated=compensated, convert=convert)
    # The fused kernel updates all tensors in one pass on CPU and CUDA.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None,
                             foreach=foreach)


def lr_lambda(cfg):
    """Linear warm-up to 1, then cosine decay to min_lr_factor at the last step."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.min_lr_factor + (1 - cfg.min_lr_factor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def model_shape(config: Config, vocab_size: int, device_type: str, log: bool = False,
                pretrained: dict | None = None) -> ModelArgs:
    """The model the trainer builds: the flavor (or `pretrained`, the shape of a Hugging Face
    Llama's config.json) with [model]'s attention, heads, tying and loss choices resolved for
    this device and micro-batch."""
    mcfg, tcfg = config.model, config.training
    if mcfg.hf_config:
        raise UserError("model_shape describes mixprec's own Llama, not model.hf_config")
    overrides = {"attention": resolve_attention(mcfg.attention, device_type), "balance": mcfg.balance}
    if log and mcfg.attention == "auto":
        logger.info("model.attention auto: %s on %s", overrides["attention"], device_type)
    if pretrained is not None and (mcfg.n_kv_heads or mcfg.tie_embeddings != "flavor"):
        raise UserError("model.n_kv_heads and model.tie_embeddings do not apply to pretrained weights (their "
                        "config.json fixes them); accepted: leave them at their defaults")
    if mcfg.n_kv_heads:
        overrides["n_kv_heads"] = mcfg.n_kv_heads
    if mcfg.tie_embeddings != "flavor":
        overrides["tie_embeddings"] = mcfg.tie_embeddings == "true"
    if pretrained is not None:
        args = replace(ModelArgs(**pretrained), **overrides)
        if vocab_size > args.vocab_size:
            raise UserError(f"checkpoint.initial_load: the tokenizer has {vocab_size} token ids, the model "
                            f"{args.vocab_size}; accepted: data.tokenizer set to the model's own tokenizer.json")
    else:
        args = model_args(mcfg.flavor, vocab_size, **overrides)
    tokens, vocab = tcfg.local_batch_size * tcfg.seq_len, args.vocab_size
    gpu_memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
        if device_type == "cuda" and torch.cuda.is_available() else None
    compiled = config.compile.enable and "loss" in config.compile.components  # the rule's measurement: compiled
    args = replace(args, loss_chunk=loss_chunk(mcfg.loss, vocab, tokens, gpu_memory, compiled))
    if log and mcfg.loss == "auto" and gpu_memory and compiled and not args.loss_chunk:
        logger.info("model.loss auto: the full logits (%.0f MiB in FP32, within 1/%d of this GPU's %.0f GiB; "
                    "compiled, the upcast fuses into the softmax)", tokens * vocab * 4 / 2**20, GPU_LOGITS_SHARE,
                    gpu_memory / 2**30)
    if log and args.loss_chunk:
        logger.info("model.loss %s: output layer and loss in chunks of %d tokens (%.0f MiB of FP32 logits; a "
                    "micro-batch's full logits would be %.0f MiB)", mcfg.loss, args.loss_chunk,
                    args.loss_chunk * vocab * 4 / 2**20, tokens * vocab * 4 / 2**20)
    if tcfg.seq_len > args.max_seq_len:
        where = "pretrained model" if pretrained is not None else f"{mcfg.flavor} flavor"
        raise UserError(f"training.seq_len {tcfg.seq_len} exceeds the {where}'s max_seq_len {args.max_seq_len}")
    return args


def hf_model(config: Config, vocab_size: int, tokenizer_name: str, dims: ParallelDims, device: torch.device,
             pretrained: bool = False):
    """(its config, the model, checkpoint meta) for model.hf_config, or one line saying what
    this first version does not do with such a model. pretrained: parameters left on the meta
    device (materialised after sharding, then loaded)."""
    from mixprec.models.hf import HFCausalLM, load_hf_config, max_positions, meta_of

    hf = load_hf_config(config.model.hf_config)
    refused = [(dims.tp_enabled, "tensor parallel", "parallelism.tensor_parallel_degree 1 (FSDP2 and DDP work)"),
               (config.model.loss == "chunked", "model.loss chunked", "model.loss auto or full")]
    for bad, what, accepted in refused:
        if bad:
            raise UserError(f"model.hf_config with {what}: not supported for Hugging Face models yet; accepted: "
                            f"{accepted}")
    if vocab_size > hf.vocab_size:
        raise UserError(f"model.hf_config: the {tokenizer_name} tokenizer has {vocab_size} token ids but the "
                        f"config's vocab_size is {hf.vocab_size}; accepted: a config with vocab_size >= {vocab_size}, "
                        "or a smaller data.bpe_vocab_size")
    positions = max_positions(hf)
    if positions is not None and config.training.seq_len > positions:
        raise UserError(f"training.seq_len {config.training.seq_len} exceeds the config's {positions} positions")
    torch.manual_seed(config.training.seed)
    if pretrained:
        with empty_parameters():
            model = HFCausalLM(hf)
    else:
        model = HFCausalLM(hf).to(device)
    logger.info("model: %s from %s (%s), %d decoder layers", type(model.hf).__name__, config.model.hf_config,
                "weights from checkpoint.initial_load" if pretrained else "random init", len(model.layers))
    return hf, model, {"hf_config": meta_of(hf), "tokenizer": tokenizer_name}


def load_tokens(data, folder: Path):
    """(tokenizer, its name in checkpoints, training tokens, validation tokens): a prepared
    folder's shards, checked and read a window at a time, or text read and tokenized here."""
    t0 = time.perf_counter()  # each setup phase logs its duration: a log without a terminal shows progress
    if is_prepared(data.source):
        prepared = open_prepared(data.source)
        logger.info("data: %s: prepared shards, %d training and %d validation tokens (%s tokenizer, vocabulary %d), "
                    "checked in %.1f s; data.tokenizer and data.val_fraction do not apply", prepared.folder,
                    len(prepared.train), len(prepared.val), prepared.tokenizer_name, prepared.vocab_size,
                    time.perf_counter() - t0)
        return prepared.tokenizer(), prepared.tokenizer_name, prepared.train, prepared.val
    corpus = load_corpus(data.source, data.val_fraction)
    tokenizer = build_tokenizer(data.tokenizer, corpus.train, data.bpe_vocab_size, folder / "tokenizer.json")
    # a tokenizer.json is named by its digest, as mixprec prepare names it: moving the file keeps its runs
    name = data.tokenizer if data.tokenizer in ("byte", "bpe") else \
        f"file {hashlib.sha256(tokenizer_path(data.tokenizer).read_bytes()).hexdigest()[:16]}"
    train_tokens, val_tokens = tokenizer.encode(corpus.train), tokenizer.encode(corpus.val)
    logger.info("data: %s: %d training and %d validation tokens (%s tokenizer, vocabulary %d) in %.1f s",
                corpus.name, len(train_tokens), len(val_tokens), data.tokenizer, tokenizer.vocab_size,
                time.perf_counter() - t0)
    return tokenizer, name, train_tokens, val_tokens


def initial_load(ccfg, checkpoints: CheckpointManager | None) -> str:
    """checkpoint.initial_load, unless the run folder has a checkpoint to resume (TorchTitan's rule)."""
    if not ccfg.initial_load:
        return ""
    if checkpoints is not None and checkpoints.steps():
        logger.info("checkpoint.initial_load: not loaded, the run folder has checkpoints (resuming)")
        return ""
    path = Path(ccfg.initial_load).expanduser()
    if not path.exists():
        raise UserError(f"checkpoint.initial_load {ccfg.initial_load}: no such file or folder; accepted: a Hugging "
                        "Face model folder or a mixprec checkpoint (step-N.pt or a step-N folder)")
    return str(path)


def load_initial(path: str, model: torch.nn.Module, policy: Policy) -> None:
    """The weights of `path` into the (sharded, materialised) model and its FP32 masters."""
    t0 = time.perf_counter()
    source, adapter = open_source(path, model)
    masters = policy.masters.named_masters(model) if policy.masters is not None else {}
    load_weights(model, source, adapter, extra={n: [m] for n, m in masters.items()})
    tokenizer = Path(path) / "tokenizer.json"
    logger.info("checkpoint.initial_load: weights of %s loaded in %.1f s%s", path, time.perf_counter() - t0,
                f" (its tokenizer: --data.tokenizer {path})" if tokenizer.is_file() else "")


def build(config: Config, *, accum: int | None = None) -> Parts:
    """Everything a run trains with, in the order whose random draws every checkpoint and
    test relies on. accum: micro-batches per step instead of the config's batch sizes'."""
    tcfg = config.training
    device = resolve_device(tcfg.device)
    policy = build_policy(config.precision, tcfg, config.loss_scale, config.fp8)
    if config.stability.enable and not config.stability.snapshot_interval and not config.checkpoint.enable:
        raise UserError("stability.snapshot_interval 0 rewinds to the last checkpoint, but checkpoint.enable is "
                        "false; accepted: a snapshot_interval > 0, or checkpoint.enable true")
    folder = Path(config.job.dump_folder)
    check_writable(folder, "job.dump_folder")
    if config.checkpoint.enable:
        check_writable(folder / config.checkpoint.folder, "checkpoint.folder")
    seed_all(tcfg.seed)
    pcfg = config.parallelism
    rank, world = init_distributed(device, pcfg.timeout_s)
    dims = ParallelDims.resolve(pcfg.data_parallel_replicate_degree, pcfg.data_parallel_shard_degree,
                                pcfg.tensor_parallel_degree, world, pcfg.expert_parallel_degree)
    if dims.ep_enabled:  # before any data or model work
        if config.model.hf_config:
            raise UserError(f"parallelism.expert_parallel_degree {dims.ep} with model.hf_config: expert parallelism "
                            "runs mixprec's own MoE flavors; accepted: 1 for a Hugging Face model (FSDP2 shards its "
                            "experts)")
        check_expert_parallel(FLAVORS.get(config.model.flavor, {}).get("n_experts", 0), dims,
                              f"{config.model.flavor} flavor")
    dp, lbs = dims.dp_degree, tcfg.local_batch_size
    global_bs = lbs * dp if tcfg.global_batch_size == -1 else tcfg.global_batch_size
    if global_bs % (lbs * dp):
        raise UserError(f"training.global_batch_size {global_bs} is not a multiple of local_batch_size {lbs} x "
                        f"{dp} data-parallel ranks")
    accum = accum or global_bs // (lbs * dp)

    tokenizer, tokenizer_name, train_tokens, val_tokens = load_tokens(config.data, folder)
    t0 = time.perf_counter()
    # Every rank draws the same global micro-batch and reads its own rows of it.
    dp_rank = dims.dp_rank(rank)
    mine = slice(dp_rank * lbs, (dp_rank + 1) * lbs)  # this rank's rows of every global batch, validation's too
    loader = TrainLoader(train_tokens, tcfg.seq_len, lbs * dp, tcfg.seed, device, rows=mine)
    val = val_batches(val_tokens, tcfg.seq_len, lbs * dp, tcfg.eval_batches, device, rows=mine)

    ccfg, scfg = config.checkpoint, config.stability
    checkpoints = CheckpointManager(folder / ccfg.folder, ccfg.keep_latest_k) if ccfg.enable else None
    if checkpoints is not None:
        if rank == 0:
            checkpoints.recover()  # what a killed save left, before any rank lists the checkpoints
        if world > 1:
            torch.distributed.barrier()
    initial = initial_load(ccfg, checkpoints)
    if config.model.hf_config:
        args, model, meta = hf_model(config, tokenizer.vocab_size, tokenizer_name, dims, device, bool(initial))
        raw_model = model
    else:
        pretrained = None
        if initial and is_hf_folder(initial):
            pretrained = llama_fields(HFFolder(initial).config, "checkpoint.initial_load")
            logger.info("model: mixprec's Llama shaped by %s/config.json (model.flavor does not apply)", initial)
        args = model_shape(config, tokenizer.vocab_size, device.type, log=True, pretrained=pretrained)
        if dims.tp_enabled:
            check_tensor_parallel(args, dims.tp)
        check_expert_parallel(args.n_experts, dims, "pretrained model" if pretrained else f"{config.model.flavor} flavor")
        model = raw_model = build_model(args, device=device, storage_dtype=policy.storage_dtype,
                                        seed=None if initial else tcfg.seed)
        meta = {**args.architecture(), "tokenizer": tokenizer_name}
    parallelize(model, dims, policy, device, pcfg=pcfg, ac_mode=config.activation_checkpoint.mode,
                compile_components=config.compile.components if config.compile.enable else None)
    if initial:  # sharded first: each rank allocates only what it holds
        materialize(model, device)
    # The fused kernel skips an overflowed step on the device (found_inf), FSDP2's DTensor
    # shards included; under tensor parallel the parameters mix DTensors of two meshes (or
    # with plain tensors), which one fused or foreach call cannot take.
    # several meshes' DTensors (tensor parallel, expert parallel) go one at a time: one fused call takes one mesh
    meshes = dims.tp_enabled or dims.ep_enabled
    optimizer = build_optimizer(model, tcfg, fused=not meshes, foreach=False if meshes else None,
                                states=policy.optimizer_states, compensated=policy.spec.update is Update.KAHAN,
                                convert=config.checkpoint.convert_optimizer_states)
    model, optimizer = policy.setup(model, optimizer, convert_states=config.checkpoint.convert_optimizer_states)
    if initial:
        load_initial(initial, raw_model, policy)
    if dims.ddp_enabled:
        logger.info("parallelism: DDP over %d processes", world)
        model = torch.nn.parallel.DistributedDataParallel(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tcfg))
    name = config.model.hf_config or (f"Llama of {initial}" if initial and is_hf_folder(initial)
                                      else f"{config.model.flavor} flavor")
    logger.info("model: %s, %.2fM parameters, %s, built in %.1f s", name, raw_model.num_params() / 1e6, policy,
                time.perf_counter() - t0)
    parts = Parts(config, folder, device, policy, rank, dims, accum, tokenizer, loader, val, args, raw_model,
                  model, optimizer, scheduler, meta)
    parts.state = TrainingState(parts, checkpoints, first_checkpoint_step=ccfg.interval)
    if config.plan.interval and policy.layout.fp8():
        parts.replanner = Replanner(config.plan, policy, raw_model, dims.world_size)
    if scfg.enable:
        parts.guard = parts.state.guard = StabilityGuard(
            scfg, raw_model, capture=parts.state.snapshot, restore=parts.state.rewind_to, policy=policy,
            optimizer=optimizer, rank=rank, world_size=dims.world_size)
    return parts
