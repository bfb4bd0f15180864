"""The training loop: a Llama model on real text, under a precision policy.

The loop never looks at a dtype: it calls the policy's hooks (setup, autocast,
backward, step, state_dict). Each component gets its own config table.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from mixprec.config import Config, build_policy, to_toml
from mixprec.data.corpus import load_corpus
from mixprec.data.loader import TrainLoader, val_batches
from mixprec.data.tokenizer import build_tokenizer
from mixprec.distributed.parallel import ParallelDims, init_distributed, resolve_device
from mixprec.distributed.tensor_parallel import check_tensor_parallel
from mixprec.errors import TrainingUnstable, UserError
from mixprec.models.llama import ModelArgs, build_model, model_args, resolve_attention
from mixprec.models.loss import loss_chunk
from mixprec.optim import AdamW
from mixprec.precision import Policy, StepResult
from mixprec.dtypes import dtype_name
from mixprec.stability.guard import StabilityGuard, clone_state
from mixprec.rng import rng_state, set_rng_state
from mixprec.train.checkpoint import (CheckpointManager, check_compatible, keep_optimizer_kernels,
                                      load_full_into_sharded, load_sharded, restoring)
from mixprec.train.metrics import MetricsLogger, peak_flops, peak_memory_bytes
from mixprec.train.parallelize import parallelize
from mixprec.train.report import progress_bar, report_step, write_summary
from mixprec.train.run_folder import check_writable

logger = logging.getLogger(__name__)


def build_optimizer(model: torch.nn.Module, cfg, fused: bool = True, foreach: bool | None = None,
                    moments_dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norm weights); with moments in a
    narrower dtype than FP32, mixprec's AdamW (same update, narrower state)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if moments_dtype != torch.float32:
        logger.info("optimizer: AdamW with %s moments (one parameter at a time, FP32 arithmetic)",
                    dtype_name(moments_dtype))
        return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, moments_dtype=moments_dtype)
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


@torch.no_grad()
def evaluate(model, policy: Policy, batches) -> float:
    model.eval()
    total = 0.0
    for x, y in batches:
        with policy.autocast():
            total += model(x, y).item()
    model.train()
    return total / len(batches)


class Trainer:
    def __init__(self, config: Config):
        """Everything that can fail on bad input is checked here, before anything is written."""
        self.config = config
        tcfg = config.training
        self.device = resolve_device(tcfg.device)
        self.policy = build_policy(config.precision, tcfg, config.loss_scale, config.fp8)
        if config.stability.enable and not config.stability.snapshot_interval and not config.checkpoint.enable:
            raise UserError("stability.snapshot_interval 0 rewinds to the last checkpoint, but checkpoint.enable is "
                            "false; accepted: a snapshot_interval > 0, or checkpoint.enable true")
        self.folder = Path(config.job.dump_folder)
        check_writable(self.folder, "job.dump_folder")
        if config.checkpoint.enable:
            check_writable(self.folder / config.checkpoint.folder, "checkpoint.folder")
        torch.manual_seed(tcfg.seed)
        pcfg = config.parallelism
        self.rank, world = init_distributed(self.device)
        self.dims = ParallelDims.resolve(pcfg.data_parallel_replicate_degree, pcfg.data_parallel_shard_degree,
                                         pcfg.tensor_parallel_degree, world)
        dp, lbs = self.dims.dp_degree, tcfg.local_batch_size
        global_bs = lbs * dp if tcfg.global_batch_size == -1 else tcfg.global_batch_size
        if global_bs % (lbs * dp):
            raise UserError(f"training.global_batch_size {global_bs} is not a multiple of local_batch_size {lbs} x "
                            f"{dp} data-parallel ranks")
        self.accum = global_bs // (lbs * dp)

        t0 = time.perf_counter()  # each setup phase logs its duration: a log without a terminal shows progress
        corpus = load_corpus(config.data.source, config.data.val_fraction)
        self.tokenizer = build_tokenizer(config.data.tokenizer, corpus.train, config.data.bpe_vocab_size,
                                         self.folder / "tokenizer.json")
        train_tokens, val_tokens = self.tokenizer.encode(corpus.train), self.tokenizer.encode(corpus.val)
        logger.info("data: %s: %d training and %d validation tokens (%s tokenizer, vocabulary %d) in %.1f s",
                    corpus.name, len(train_tokens), len(val_tokens), config.data.tokenizer, self.tokenizer.vocab_size,
                    time.perf_counter() - t0)
        t0 = time.perf_counter()
        # Every rank draws the same global micro-batch and keeps its own rows.
        self.loader = TrainLoader(train_tokens, tcfg.seq_len, lbs * dp, tcfg.seed, self.device)
        dp_rank = self.dims.dp_rank(self.rank)
        self.rows = slice(dp_rank * lbs, (dp_rank + 1) * lbs)
        self.val = val_batches(val_tokens, tcfg.seq_len, lbs * dp, tcfg.eval_batches, self.device)

        mcfg = config.model
        overrides = {"attention": resolve_attention(mcfg.attention, self.device.type)}
        if mcfg.attention == "auto":
            logger.info("model.attention auto: %s on %s", overrides["attention"], self.device.type)
        if mcfg.n_kv_heads:
            overrides["n_kv_heads"] = mcfg.n_kv_heads
        if mcfg.tie_embeddings != "flavor":
            overrides["tie_embeddings"] = mcfg.tie_embeddings == "true"
        self.args = model_args(mcfg.flavor, self.tokenizer.vocab_size, **overrides)
        tokens, vocab = lbs * tcfg.seq_len, self.args.vocab_size
        self.args = replace(self.args, loss_chunk=loss_chunk(mcfg.loss, vocab, tokens))
        if self.args.loss_chunk:
            logger.info("model.loss %s: output layer and loss in chunks of %d tokens (%.0f MiB of FP32 logits; a "
                        "micro-batch's full logits would be %.0f MiB)", mcfg.loss, self.args.loss_chunk,
                        self.args.loss_chunk * vocab * 4 / 2**20, tokens * vocab * 4 / 2**20)
        if tcfg.seq_len > self.args.max_seq_len:
            raise UserError(f"training.seq_len {tcfg.seq_len} exceeds the {mcfg.flavor} flavor's "
                            f"max_seq_len {self.args.max_seq_len}")
        if self.dims.tp_enabled:
            check_tensor_parallel(self.args, self.dims.tp)
        self.model = self.raw_model = build_model(self.args, device=self.device,
                                                  storage_dtype=self.policy.storage_dtype, seed=tcfg.seed)
        parallelize(self.model, self.dims, self.policy, self.device, pcfg=pcfg,
                    ac_mode=config.activation_checkpoint.mode,
                    compile_components=config.compile.components if config.compile.enable else None)
        # The fused kernel needs plain tensors; under tensor parallel the parameters mix
        # DTensors of two meshes (or with plain tensors), which one foreach call cannot take.
        sharded = self.dims.fsdp_enabled or self.dims.tp_enabled
        self.optimizer = build_optimizer(self.model, tcfg, fused=not sharded,
                                         foreach=False if self.dims.tp_enabled else None,
                                         moments_dtype=self.policy.optimizer_moments_dtype)
        self.model, self.optimizer = self.policy.setup(self.model, self.optimizer)
        if self.dims.ddp_enabled:
            logger.info("parallelism: DDP over %d processes", world)
            self.model = torch.nn.parallel.DistributedDataParallel(self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(tcfg))
        logger.info("model: %s flavor, %.2fM parameters, %s, built in %.1f s", mcfg.flavor,
                    self.raw_model.num_params() / 1e6, self.policy, time.perf_counter() - t0)

        self.meta = {**{k: v for k, v in asdict(self.args).items() if k not in ModelArgs.RUNTIME_FIELDS},
                     "tokenizer": config.data.tokenizer}
        self.step, self.best_val, self.bad_evals = 0, math.inf, 0
        self.checkpoints, self.metrics, self._batches = None, None, []
        scfg = config.stability
        self.guard = StabilityGuard(scfg, self.raw_model, capture=self._snapshot, restore=self._rewind_to,
                                    policy=self.policy, optimizer=self.optimizer, rank=self.rank,
                                    world_size=self.dims.world_size) if scfg.enable else None
        if config.checkpoint.enable:
            self.checkpoints = CheckpointManager(self.folder / config.checkpoint.folder, config.checkpoint.keep_latest_k)
            t0 = time.perf_counter()
            state = self.checkpoints.load(config.checkpoint.load_step)
            if state is not None:
                self._restore(state)
                logger.info("checkpoint: restored in %.1f s", time.perf_counter() - t0)

    # ---- checkpoint state ---------------------------------------------------------------
    def _extras(self) -> dict:
        """Everything but the model and optimizer state."""
        return {
            "format": 1,
            "meta": self.meta,
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "policy": self.policy.state_dict(),
            "rng": rng_state(self.device),
            "trainer": {"best_val": self.best_val, "bad_evals": self.bad_evals},
            "stability": self.guard.state_dict() if self.guard is not None else None,
        }

    def _save(self) -> None:
        """One file from one process; sharded DCP folders from torchrun runs."""
        if self.dims.world_size > 1:
            self.checkpoints.save_sharded(self.step, self.model, self.optimizer, self._extras(), self.rank)
        else:
            self.checkpoints.save(self.step, {**self._extras(), "model": self.policy.model_state_dict(self.model),
                                              "optimizer": self.optimizer.state_dict()})

    def _restore(self, state: dict, rewind: bool = False) -> None:
        """A checkpoint (or, rewind True, a good state to go back to: the guard keeps its own record)."""
        check_compatible(state, self.meta, state["source"])
        with restoring(state["source"]):
            self.policy.load_state_dict(state["policy"])  # first: it may re-apply a fallback
            with keep_optimizer_kernels(self.optimizer):
                if "dcp" in state:
                    load_sharded(state["dcp"], self.model, self.optimizer)
                elif "sharded" in state:  # an in-memory snapshot of a torchrun run
                    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

                    model_sd, optim_sd = state["sharded"]
                    if optim_sd is None:  # taken before the first step
                        self.optimizer.state.clear()
                        set_model_state_dict(self.model, model_sd)
                    else:
                        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd,
                                       optim_state_dict=optim_sd)
                elif self.dims.fsdp_enabled or self.dims.tp_enabled:
                    load_full_into_sharded(self.model, self.optimizer, state["model"], state["optimizer"])
                else:  # one process, or DDP: every rank loads the whole file
                    self.policy.load_model_state_dict(self.raw_model, state["model"])
                    self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.loader.load_state_dict(state["data"])
            set_rng_state(state["rng"], self.device)
            self.step = int(state["step"])
            self.best_val, self.bad_evals = state["trainer"]["best_val"], state["trainer"]["bad_evals"]
            if self.guard is not None and state.get("stability") and not rewind:
                self.guard.load_state_dict(state["stability"])
        if not rewind:
            logger.info("checkpoint: resumed at step %d", self.step)

    # ---- the stability guard's snapshot and rewind ----------------------------------------
    def _snapshot(self) -> dict:
        """Everything a rewind puts back, copied (to CPU memory, or sharded on the device)."""
        if self.dims.world_size > 1:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

            # get_state_dict fills an empty optimizer state by a step with zero gradients (its
            # step count would differ from an unguarded run's): before the first step, none
            empty = not self.optimizer.state
            state = {"sharded": (get_model_state_dict(self.model), None) if empty
                     else get_state_dict(self.model, self.optimizer)}
        else:
            state = {"model": self.policy.model_state_dict(self.raw_model), "optimizer": self.optimizer.state_dict()}
        return clone_state({**self._extras(), **state, "source": "memory snapshot"})

    def _rewind_to(self, snapshot: dict | None):
        """Put a good state back, but not the data position: the batches since then are
        not replayed. None: the latest checkpoint."""
        data = self.loader.state_dict()
        if snapshot is None:
            snapshot = self.checkpoints.load()
            if snapshot is None:
                raise TrainingUnstable(f"step {self.step}: no checkpoint to rewind to yet (stability.snapshot_interval "
                                       f"0 uses checkpoints, the first comes at step {self.config.checkpoint.interval})")
        self._restore({**snapshot, "data": data}, rewind=True)
        return self.step, (snapshot.get("stability") or {}).get("monitor")

    def _after_rewind(self) -> None:
        """The steps past the one gone back to leave metrics.jsonl and the checkpoints, and
        the rewound state (with the guard's record of the rewind) is saved at once: a run
        killed now resumes after the rewind, with the same data skipped."""
        if self.metrics is not None:
            self.metrics.truncate(self.step)
        if self.checkpoints is not None:
            if self.rank == 0:
                self.checkpoints.drop_after(self.step)
            self._save()

    # ---- the loop -------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, tcfg = self.config, self.config.training
        done = self.folder / "summary.json"
        if self.step >= tcfg.steps and done.exists():
            # a finished run stays as it finished: no file is rewritten
            logger.info("%s is complete at step %d; raise training.steps to continue", self.folder, self.step)
            return json.loads(done.read_text())
        self.folder.mkdir(parents=True, exist_ok=True)
        lead = self.rank == 0  # the one process that writes files and logs
        if lead:
            (self.folder / "config.toml").write_text(to_toml(cfg))
        self.metrics = metrics = MetricsLogger(self.folder, self.step, cfg.metrics.enable_tensorboard) if lead else None
        accum = self.accum
        tokens_per_step = tcfg.local_batch_size * self.dims.dp_degree * accum * tcfg.seq_len
        flops_per_token = self.raw_model.flops_per_token(tcfg.seq_len) * self.dims.dp_degree
        peaks = {}  # by what the matmuls compute in: a fallback changes it
        logger.info("training %d steps of %d tokens (%d micro-batches of %d x %d) into %s",
                    tcfg.steps, tokens_per_step, accum, tcfg.local_batch_size, tcfg.seq_len, self.folder)
        bar = progress_bar(cfg.metrics.progress_bar and lead, self.step, tcfg.steps)
        speeds, loss, val_loss, stopped_early, start_step = [], math.nan, None, False, self.step
        if self.guard is not None:
            self.guard.start(self.step)
        while self.step < tcfg.steps:
            t0 = time.perf_counter()
            lr = self.scheduler.get_last_lr()[0] * (self.guard.lr_factor if self.guard is not None else 1.0)
            loss, result = self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dt = time.perf_counter() - t0
            self.step += 1
            speeds.append(tokens_per_step / dt)
            if self.guard is not None:
                try:
                    step = self.step
                    if self.guard.after_step(step, loss, result, self._rerun()) != step:
                        self._after_rewind()  # self.step is now the step gone back to
                        if bar is not None:
                            bar.n = self.step
                        continue
                except TrainingUnstable:
                    self._write_summary(self._summary(loss, None, False, start_step, speeds, unstable=True))
                    raise
            matmul = self.policy.matmul_dtype
            if matmul not in peaks:
                peaks[matmul] = peak_flops(self.device, self.policy)
            peak = peaks[matmul]
            record = {
                "step": self.step, "loss": loss, "lr": lr, "grad_norm": result.grad_norm,
                "tokens_per_sec": speeds[-1],
                "mfu": flops_per_token * speeds[-1] / peak if peak else None,
                "peak_memory_bytes": peak_memory_bytes(self.device),
                "precision": result.precision, "skipped": not result.applied, "loss_scale": result.loss_scale,
                **(self.guard.health if self.guard is not None else {}),
            }
            last = self.step == tcfg.steps
            if last or (tcfg.eval_interval and self.step % tcfg.eval_interval == 0):
                val_loss = evaluate(self.model, self.policy, self.val)
                record.update(val_loss=val_loss, val_perplexity=math.exp(val_loss))
                if val_loss < self.best_val:
                    self.best_val, self.bad_evals = val_loss, 0
                else:
                    self.bad_evals += 1
                if tcfg.early_stopping_patience and self.bad_evals >= tcfg.early_stopping_patience:
                    logger.info("early stopping at step %d: validation loss has not improved below %.4f "
                                "for %d evaluations", self.step, self.best_val, self.bad_evals)
                    stopped_early = last = True
            if metrics is not None:
                metrics.log(record)
            report_step(bar, record, self.step % cfg.metrics.log_freq == 0 or last)
            if self.checkpoints and (last or self.step % cfg.checkpoint.interval == 0):
                self._save()
            if stopped_early:
                break
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        if val_loss is None:  # resumed at the end: nothing trained, evaluate what is there
            val_loss = evaluate(self.model, self.policy, self.val)
        return self._write_summary(self._summary(loss, val_loss, stopped_early, start_step, speeds))

    def _write_summary(self, summary: dict) -> dict:
        """summary.json and the plots, from the one process that writes files."""
        if self.rank != 0:
            return summary
        cfg = self.config
        return write_summary(self.folder, summary, cfg.metrics.plot, f"{cfg.model.flavor}, {self.policy.requested}",
                             self.guard.incidents if self.guard is not None else None)

    def _summary(self, loss, val_loss, stopped_early: bool, start_step: int, speeds: list[float],
                 unstable: bool = False) -> dict:
        cfg = self.config
        # Median over steps after warm-up (the first steps pay for allocation and caching).
        warm = speeds[min(len(speeds) - 1, max(1, len(speeds) // 5)):] if speeds else []
        summary = {
            **self.policy.summary(),
            "steps": self.step,
            "steps_this_run": self.step - start_step,
            "final_train_loss": loss,
            "final_val_loss": val_loss,
            "val_perplexity": math.exp(val_loss) if val_loss is not None else None,
            "tokens_per_sec": statistics.median(warm) if warm else None,
            "peak_memory_bytes": peak_memory_bytes(self.device),
            "stopped_early": stopped_early,
            "stopped_unstable": unstable,
            "parameters": self.raw_model.num_params(),
            "param_bytes": sum(p.numel() * p.element_size() for p in self.raw_model.parameters()),
            "optimizer_state_bytes": sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                                         for t in s.values() if torch.is_tensor(t)),
            "model_flavor": cfg.model.flavor,
            "device": str(self.device),
            "world_size": self.dims.world_size,
        }
        if self.guard is not None:
            summary["stability"] = self.guard.summary()
        return summary

    def train_step(self, before_step=None) -> tuple[float, StepResult]:
        """One optimizer step over `accum` micro-batches: (mean loss, what the step did).
        `before_step(micro)`, when given, is called after each micro-batch's backward."""
        accum = self.accum
        loss_sum = torch.zeros((), device=self.device)
        self._batches = []  # this rank's micro-batches, for the locator should this step go non-finite
        for micro in range(accum):
            x, y = self.loader.next_batch()
            x, y = x[self.rows], y[self.rows]
            self._batches.append((x, y))
            with self.policy.autocast():
                # equal tokens per micro-batch and rank: the mean of means is the global mean
                micro_loss = self.model(x, y) / accum
            with self._gradient_sync(last=micro == accum - 1):
                self.policy.backward(micro_loss)
            loss_sum += micro_loss.detach()
            if before_step is not None:
                before_step(micro)
        if self.dims.world_size > 1:
            torch.distributed.all_reduce(loss_sum)
            loss_sum /= self.dims.world_size
        result = self.policy.step(self.optimizer, self.config.training.max_norm)
        if result.applied:
            self.scheduler.step()
        return loss_sum.item(), result

    def _rerun(self) -> list:
        """The last step's micro-batches as (forward, backward) pairs for the locator: the
        same forward and backward as train_step. Gradients are reduced as on a last
        micro-batch (every rank re-runs, so the collectives match; the guard clears them):
        FSDP2 would keep a no-sync pass's gradients apart, where zero_grad does not reach."""
        def pair(x, y):
            def forward():
                with self._gradient_sync(last=True), self.policy.autocast():
                    return self.model(x, y) / self.accum

            def backward(loss):
                with self._gradient_sync(last=True):
                    self.policy.backward(loss)
            return forward, backward

        return [pair(x, y) for x, y in self._batches]

    def _gradient_sync(self, last: bool):
        """Reduce gradients across ranks only on the last micro-batch of a step."""
        if self.dims.fsdp_enabled:
            self.model.set_requires_gradient_sync(last)
        elif self.dims.ddp_enabled and not last:
            return self.model.no_sync()
        return contextlib.nullcontext()
