"""A trainer run under host_reads.HostReads (tests/train/host_reads.py): every read of a device value
labelled by where the loop was. Imported by tests/train/test_host_reads.py, and run as a
script under torchrun by it (one JSON file of reads per rank).

    python -m torch.distributed.run --nproc-per-node 2 tests/train/host_reads_run.py OUT KEY=VALUE ...
    (precision.preset=a,b,c trains each in turn in the same process group)
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from host_reads import HostReads, PythonReads
from mixprec.config import load_config
from mixprec.train.trainer import Trainer

NAN_STEP = 3  # a step that is not a read step: its non-finite gradients are skipped on the device


def nan_at(trainer: Trainer, step: int, fqn: str = "layers.1.feed_forward.w2"):
    """A NaN in `fqn`'s output in training step `step` only (not in the guard's re-run of it)."""
    def poison(module, args, output):
        if trainer.step + 1 == step and not reading[0] and not done:
            done.append(step)  # once: a rewound run that passes this step again stays clean
            return output.masked_fill(torch.ones_like(output, dtype=torch.bool), float("nan"))
        return output

    reading, done = [False], []
    trainer.raw_model.get_submodule(fqn).register_forward_hook(poison)
    return reading


def counted_run(overrides: dict[str, str], nan_step: int | None = NAN_STEP,
                python: bool = False, sync_errors: bool = False) -> tuple[Trainer, HostReads]:
    """Train under the counter (python: PythonReads, which lets torch.compile compile). Labels:
    ("in", s) during training step s, ("after", s) after it (the loop's read of step s, where
    s is a read step). sync_errors (CUDA): every step after the first (which creates the
    optimizer's state from host values) runs under torch.cuda.set_sync_debug_mode("error"),
    so that any call that makes the host wait for the GPU raises, the loader's copy
    included, which the counter does not see (a copy to the GPU reads nothing)."""
    trainer = Trainer(load_config(None, overrides))
    reads, inner = PythonReads() if python else HostReads(), trainer.train_step
    reading = nan_at(trainer, nan_step) if nan_step else [False]

    def step(*args, **kwargs):
        reads.label = ("in", trainer.step + 1)
        reading[0] = False
        if sync_errors and trainer.step > 0:
            torch.cuda.set_sync_debug_mode("error")
        try:
            return inner(*args, **kwargs)
        finally:
            if sync_errors:
                torch.cuda.set_sync_debug_mode("default")
            reads.label = ("after", trainer.step + 1)
            reading[0] = True  # what runs until the next step is the read (the guard's re-run included)

    trainer.train_step = step
    with reads:
        trainer.train()
    return trainer, reads


def check(trainer: Trainer, reads: HostReads, at_most: int) -> dict:
    """{label: count} of the reads; asserts none inside a step but the policy's one read at the
    end of a read step, none after a step that is not a read step, and at most `at_most`
    after a read step without an incident."""
    counts = reads.by_label()
    # the one read a step makes: the policy's, of what the steps since the last read did, as the
    # last thing its step does at a read step (its ReadSchedule's)
    inside = [e for e in reads.events if e[0] and e[0][0] == "in"
              and not (trainer.policy.reads.due(e[0][1]) and e[2].endswith(" settle"))]
    assert not inside, f"reads inside a step: {inside[:5]}"
    settles = [e for e in reads.events if e[0] and e[0][0] == "in" and e not in inside]
    assert len(settles) == len({e[0] for e in settles}), f"more than one read in a step: {settles[:5]}"
    stray = [e for e in reads.events if e[0] and not trainer.policy.reads.due(e[0][1])]
    assert not stray, f"reads after a step that is not a read step: {stray[:5]}"
    steps = trainer.config.training.steps
    incidents = [i["step"] for i in trainer.guard.incidents] if trainer.guard is not None else []
    # the read that handled an incident also re-ran its step (the locator): more reads there
    busy = {min(r for r in range(s, steps + 1) if trainer.policy.reads.due(r)) for s in incidents}
    for label, n in counts.items():
        if label is not None and label[1] not in busy:
            assert n <= at_most, f"{n} reads after step {label[1]}: {[e for e in reads.events if e[0] == label]}"
    return counts


if __name__ == "__main__":  # under torchrun: OUT KEY=VALUE ... (precision.preset may list several: a,b,c)
    logging.disable(logging.WARNING)
    out, pairs = Path(sys.argv[1]), dict(a.split("=", 1) for a in sys.argv[2:])
    for preset in pairs["precision.preset"].split(","):  # one process group for them all
        run = {**pairs, "precision.preset": preset, "job.dump_folder": str(Path(pairs["job.dump_folder"]) / preset)}
        trainer, reads = counted_run(run)
        rank = trainer.rank
        (out / f"{preset}-rank{rank}.json").write_text(json.dumps({
            "events": [[list(label) if label else None, op, where] for label, op, where in reads.events],
            "read_steps": [s for s in range(1, trainer.config.training.steps + 1) if trainer.policy.reads.due(s)],
            "incidents": [i["step"] for i in trainer.guard.incidents] if trainer.guard is not None else [],
            "skipped": [r["step"] for r in (json.loads(x) for x in (Path(run["job.dump_folder"]) / "metrics.jsonl")
                                            .read_text().splitlines()) if r["skipped"]] if rank == 0 else None,
        }))
    if torch.distributed.is_initialized():  # as the CLI leaves: no interpreter finalization beside gloo's threads
        from mixprec.distributed.parallel import exit_process_group

        exit_process_group(0)
