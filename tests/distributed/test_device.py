"""training.device under torchrun: a GPU per rank, checked before any work."""

import pytest
import torch

from mixprec.distributed.parallel import resolve_device
from mixprec.errors import UserError


@pytest.fixture
def two_ranks_one_gpu(monkeypatch):
    """A node with one CUDA device on which torchrun started two processes (rank 1)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")


@pytest.mark.parametrize("name", ["cuda", "auto"])
def test_more_ranks_than_gpus_is_one_clear_error(two_ranks_one_gpu, name):
    with pytest.raises(UserError, match="torchrun started 2 processes on this node, which has 1 CUDA device"):
        resolve_device(name)


def test_cpu_under_torchrun_needs_no_gpu(two_ranks_one_gpu):
    assert resolve_device("cpu") == torch.device("cpu")


def test_each_rank_takes_its_local_rank(two_ranks_one_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    with pytest.raises(UserError, match="each rank takes cuda:LOCAL_RANK"):
        resolve_device("cuda:0")


def test_no_cuda_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UserError, match="no CUDA device here"):
        resolve_device("cuda")
