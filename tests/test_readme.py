"""The README's library example and the docs pages' examples run as written, the config
reference lists every key, every page the README links exists, and its numeric facts hold."""

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


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

    text = (DOCS / "cli.md").read_text()
    for table, cls in TABLES.items():
        for key in field_types(cls):
            assert f"`{table}.{key}`" in text or f"`{table}.{key}`," in text, f"{table}.{key}"


def test_stability_example_runs():
    code = re.search(r"From your own loop, one call per step:\n\n```python\n(.*?)```", (DOCS / "stability.md").read_text(),
                     re.S).group(1)
    scope = {}
    exec(compile(code, "docs/stability.md", "exec"), scope)
    assert scope["step"] == 30 and scope["guard"].summary()["incidents"] == 0
    assert scope["guard"]._snapshot[0] == 30  # the last snapshot is the latest multiple of 10


def test_your_own_model_example_runs():
    import pytest

    pytest.importorskip("transformers")
    section = (DOCS / "your-own-model.md").read_text()
    scope = {}
    for code in re.findall(r"```python\n(.*?)```", section, re.S):  # the audit, then the plan
        exec(compile(code, "docs/your-own-model.md", "exec"), scope)
    assert scope["report"]["ok"] and scope["policy"].name == "bf16-mixed"
    assert scope["plan"]["precision"] == "fp16-master" and scope["plan"]["peak_bytes"] > 0


def test_every_page_the_readme_and_the_docs_link_exists():
    pages = [README, *DOCS.glob("*.md")]
    for page in pages:
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links {target}"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README.read_text()))
    assert linked == {p.name for p in DOCS.glob("*.md")}  # every page reachable from the README
    assert len(README.read_text().splitlines()) < 150  # what a newcomer reads first, not the manual
