"""The README's library example runs as written, and its numeric facts hold."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_library_example_runs():
    code = re.search(r"## The library\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    stats = scope["policy"].summary()
    assert stats["precision"] == "bf16-mixed" and stats["steps"] == 10 and scope["state"]["steps"] == 10


def test_bf16_facts_stated_in_the_readme():
    bf16 = torch.bfloat16
    assert torch.tensor(0.125, dtype=bf16).item() == 0.125  # powers of two are exact
    assert torch.tensor(256.0, dtype=bf16) + 1 == 256  # 8 bits of significand
    assert torch.tensor(1.0, dtype=bf16) + 2**-9 == 1


def test_config_reference_lists_every_key():
    from mixprec.config import TABLES, field_types

    text = README.read_text()
    for table, cls in TABLES.items():
        for key in field_types(cls):
            assert f"`{table}.{key}`" in text or f"`{table}.{key}`," in text, f"{table}.{key}"


def test_stability_example_runs():
    code = re.search(r"From your own loop, one call per step:\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["step"] == 30 and scope["guard"].summary()["incidents"] == 0
    assert scope["guard"]._snapshot[0] == 30  # the last snapshot is the latest multiple of 10


def test_your_own_model_example_runs():
    import pytest

    pytest.importorskip("transformers")
    section = README.read_text().split("## Your own model\n", 1)[1].split("\n## ", 1)[0]
    scope = {}
    for code in re.findall(r"```python\n(.*?)```", section, re.S):  # the audit, then the plan
        exec(compile(code, "README.md", "exec"), scope)
    assert scope["report"]["ok"] and scope["policy"].name == "bf16-mixed"
    assert scope["plan"]["precision"] == "fp16-master" and scope["plan"]["peak_bytes"] > 0
