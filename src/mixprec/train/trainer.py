"""The training loop: a Llama model on real text, under a precision policy.

The loop never looks at a dtype: it calls the policy's hooks (autocast, backward, step).
What it trains with comes from mixprec.train.build; what it saves, resumes and rewinds
to is mixprec.train.state's TrainingState.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass

import torch

from mixprec.config import Config, to_toml
from mixprec.distributed.elastic import attempt, check_restartable, log_restart
from mixprec.errors import TrainingUnstable
from mixprec.models import moe
from mixprec.precision import Policy, StepResult
from mixprec.precision.step import ReadSchedule
from mixprec.reporting import peak_memory_bytes
from mixprec.train.build import build
from mixprec.train.metrics import MetricsLogger, peak_flops, read_metrics
from mixprec.train.report import progress_bar, report_step, write_summary

logger = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(model, policy: Policy, batches, world_size: int = 1) -> float:
    """The mean over the validation batches of each batch's mean loss. Under torchrun each rank
    evaluates its rows of every batch (loader.val_batches): a batch's loss is the mean over
    all ranks' rows, weighted by their counts (reduced over ranks), as one process computes it."""
    model.eval()
    losses = []
    for x, y, rows in batches:
        with policy.autocast():
            loss = model(x, y).float()
        losses.append(loss if world_size == 1 else torch.stack([loss * rows, torch.full_like(loss, rows)]))
    model.train()
    if world_size == 1:
        return sum(torch.stack(losses).tolist()) / len(batches)  # one read; the same sum of the same floats
    sums = torch.stack(losses)
    torch.distributed.all_reduce(sums)  # ranks of one data-parallel row (tensor parallel) count it alike
    return sum((sums[:, 0] / sums[:, 1]).tolist()) / len(batches)


@dataclass
class Pending:
    """A step taken but not read yet: its figures stay on the device until the next read step."""
    step: int
    loss: torch.Tensor  # 0-dim, on the device
    result: StepResult
    lr: float
    batches: list  # its micro-batches (token ids), for the locator
    routing: torch.Tensor | None = None  # an MoE's (max/mean rows per expert, bias min, bias max), on the device


class Trainer:
    """The loop over mixprec.train.build's parts: trainer.policy, .model, .optimizer, .state
    (a TrainingState: trainer.step and what checkpoints hold), .guard, ... are the parts' own."""

    def __init__(self, config: Config, *, accum: int | None = None):
        """Everything that can fail on bad input is checked here, before anything is written.
        accum: micro-batches per step instead of the config's (the audit takes two)."""
        self.config = config
        self.parts = build(config, accum=accum)
        self.metrics, self._batches = None, []
        self._moe_layers = moe.moe_layers(self.raw_model)  # an MoE's blocks, found once (none: a dense model)
        self.policy.reads = ReadSchedule(config.metrics.log_freq, also=self._reads_also)
        t0 = time.perf_counter()
        resumed = self.state.resume(config.checkpoint.load_step)
        if resumed:
            logger.info("checkpoint: restored in %.1f s", time.perf_counter() - t0)
        if self.rank == 0:
            check_restartable(config.checkpoint.enable)
            if attempt()[0]:  # a torchrun restart: what it resumes from, what it trains again
                logged = read_metrics(self.folder / "metrics.jsonl")  # before this attempt truncates it
                log_restart(self.step if resumed else None, max((r.get("step", 0) for r in logged), default=0))

    def __getattr__(self, name: str):
        # policy, model, raw_model, optimizer, scheduler, loader, device, dims, rank, accum, ...
        if name == "parts":
            raise AttributeError(name)
        return getattr(self.parts, name)

    @property
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    def _after_rewind(self) -> None:
        """The steps past the one gone back to leave metrics.jsonl and the checkpoints, and
        the rewound state (with the guard's record of the rewind) is saved at once: a run
        killed now resumes after the rewind, with the same data skipped."""
        if self.metrics is not None:
            self.metrics.truncate(self.step)
        if self.state.checkpoints is not None:
            if self.rank == 0:
                self.state.checkpoints.drop_after(self.step)
            self.state.save()

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
        pending: list[Pending] = []  # steps since the last read step
        since, promoted = time.perf_counter(), set(self.policy.promoted)
        while self.step < tcfg.steps:
            if self.guard is not None:
                self.guard.before_step(self.step + 1)
            lr = self.scheduler.get_last_lr()[0] * (self.guard.lr_factor if self.guard is not None else 1.0)
            with self.replanner.watch(self.step + 1) if self.replanner is not None else contextlib.nullcontext():
                micro_loss, result = self.train_step(step=self.step + 1)
            self.step += 1
            pending.append(Pending(self.step, micro_loss, result, lr, self._batches, self._routing))
            if not self.policy.reads.due(self.step):
                continue  # nothing read: the host queues the next step while the device works
            # ---- the read: the one place the loop waits for the device (the policy has read what
            # the steps did at the end of this one: counts, loss-scale log, fallback) ----
            losses = torch.stack([p.loss for p in pending]).tolist()
            routing = torch.stack([p.routing for p in pending]).tolist() if self._moe_layers else [None] * len(pending)
            now = time.perf_counter()
            speed = tokens_per_step * len(pending) / (now - since)  # over the steps read: each step's own is not seen
            steps, pending, since = pending, [], now
            rewound = False
            for p, loss, routed in zip(steps, losses, routing):
                speeds.append(speed)
                if self.guard is not None:
                    try:
                        if self.guard.after_step(p.step, loss, p.result, self._rerun(p.batches),
                                                 consumed=steps[-1].step) != p.step:
                            self._after_rewind()  # self.step is now the step gone back to
                            rewound = True
                            break
                    except TrainingUnstable:
                        self._write_summary(self._summary(loss, None, False, start_step, speeds, unstable=True))
                        raise
                matmul = self.policy.matmul_dtype
                if matmul not in peaks:
                    peaks[matmul] = peak_flops(self.device, self.policy)
                peak = peaks[matmul]
                r = p.result
                record = {
                    "step": p.step, "loss": loss, "lr": p.lr, "grad_norm": r.grad_norm, "tokens_per_sec": speed,
                    "mfu": flops_per_token * speed / peak if peak else None,
                    "peak_memory_bytes": peak_memory_bytes(self.device),
                    "precision": r.precision, "skipped": not r.applied, "loss_scale": r.loss_scale,
                    **(self.guard.health if self.guard is not None else {}),
                }
                if routed is not None:  # the routers' load (1.0: even) and the balancing biases' range
                    record.update(router_load=routed[0], expert_bias_min=routed[1], expert_bias_max=routed[2])
                if p is steps[-1]:  # the read step
                    if set(self.policy.promoted) - promoted:  # taken out of FP8 since the last read
                        record["promoted"] = sorted(set(self.policy.promoted) - promoted)
                    stopped_early, val_loss = self._evaluate_if_due(record, val_loss)
                if metrics is not None:
                    metrics.log(record)
                last = p.step == tcfg.steps or stopped_early
                report_step(bar, record, p.step % cfg.metrics.log_freq == 0 or last)
            promoted = set(self.policy.promoted)
            if rewound:
                if bar is not None:
                    bar.n = self.step
                since = time.perf_counter()
                continue
            if self.state.checkpoints and (self.step == tcfg.steps or stopped_early
                                           or self.step % cfg.checkpoint.interval == 0):
                self.state.save()
            if stopped_early:
                break
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        if val_loss is None:  # resumed at the end: nothing trained, evaluate what is there
            val_loss = evaluate(self.model, self.policy, self.val, self.dims.world_size)
        return self._write_summary(self._summary(loss, val_loss, stopped_early, start_step, speeds))

    def _reads_also(self, step: int) -> bool:
        """The read steps besides a log line's (metrics.log_freq, the policy's ReadSchedule):
        the last step, an evaluation, a checkpoint, a stability-guard snapshot or drill, a
        re-planning. Between read steps the host reads nothing: each step's loss and figures
        wait on the device, and are read, logged and acted on (the guard, the fallback)
        together at the next read step."""
        cfg, tcfg = self.config, self.config.training
        return (step >= tcfg.steps
                or bool(tcfg.eval_interval and step % tcfg.eval_interval == 0)
                or bool(self.state.checkpoints and step % cfg.checkpoint.interval == 0)
                or (self.guard is not None and self.guard.reads_at(step))
                or (self.replanner is not None and self.replanner.due(step)))

    def _evaluate_if_due(self, record: dict, val_loss):
        """Validation on an evaluation step and the last one, into `record`; (stop early, validation loss)."""
        tcfg, state = self.config.training, self.state
        if not (self.step == tcfg.steps or (tcfg.eval_interval and self.step % tcfg.eval_interval == 0)):
            return False, val_loss
        val_loss = evaluate(self.model, self.policy, self.val, self.dims.world_size)
        record.update(val_loss=val_loss, val_perplexity=math.exp(val_loss))
        if val_loss < state.best_val:
            state.best_val, state.bad_evals = val_loss, 0
        else:
            state.bad_evals += 1
        if tcfg.early_stopping_patience and state.bad_evals >= tcfg.early_stopping_patience:
            logger.info("early stopping at step %d: validation loss has not improved below %.4f "
                        "for %d evaluations", self.step, state.best_val, state.bad_evals)
            return True, val_loss
        return False, val_loss

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
        if self.replanner is not None:
            summary["replanning"] = self.replanner.summary()
        return summary

    def train_step(self, before_step=None, *, step: int | None = None) -> tuple[torch.Tensor, StepResult]:
        """One optimizer step over `accum` micro-batches: (mean loss, what the step did),
        both on the device; the policy reads what it did when its ReadSchedule is due at
        `step` (the loop's number for it; default: the policy's own count, for callers outside
        the loop such as the planner and the audit). `before_step(micro)`, when given, is
        called after each micro-batch's backward."""
        accum = self.accum
        loss_sum = torch.zeros((), device=self.device)
        moe.clear_counts(self._moe_layers)  # an MoE's routers count this step's training passes only
        self._batches = []  # this rank's micro-batches, for the locator should this step go non-finite
        for micro in range(accum):
            x, y = self.loader.next_batch()  # this rank's rows
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
        result = self.policy.step(self.optimizer, self.config.training.max_norm, step=step)
        self._routing = moe.update_balance(self._moe_layers)  # outside the gradient, every rank's tokens counted
        # torch.amp's convention: the schedule advances every iteration, a skipped step's too
        # (deciding otherwise would read the skip on the host)
        self.scheduler.step()
        return loss_sum, result

    def _rerun(self, batches: list | None = None) -> list:
        """A step's micro-batches (default: the last step's) as (forward, backward) pairs for the locator: the
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

        return [pair(x, y) for x, y in (self._batches if batches is None else batches)]

    def _gradient_sync(self, last: bool):
        """Reduce gradients across ranks only on the last micro-batch of a step."""
        if self.dims.fsdp_enabled:
            self.model.set_requires_gradient_sync(last)
        elif self.dims.ddp_enabled and not last:
            return self.model.no_sync()
        return contextlib.nullcontext()
