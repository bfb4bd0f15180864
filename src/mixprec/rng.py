"""The random streams a run draws from, saved and restored together (by checkpoints and
by the stability guard's snapshots)."""

from __future__ import annotations

import random

import torch


def seed_all(seed: int) -> None:
    """Seed every stream rng_state saves (as Lightning's seed_everything): torch's generators
    and Python's random, which otherwise starts each process from the OS's entropy, so that a
    run resumed in a new process holds the same state at each step as the run never stopped."""
    torch.manual_seed(seed)
    random.seed(seed)


def rng_state(device: torch.device) -> dict:
    """Every random stream a run may draw from: torch's CPU generator, this device's CUDA
    generator, Python's random. (The data order has its own state: TrainLoader's.)"""
    state = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device: torch.device) -> None:
    if torch.is_tensor(state):  # checkpoints before the dict: the CPU generator only
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if "python" in state:
        random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
