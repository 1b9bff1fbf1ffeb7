"""The README's examples run as written (so the front page never drifts from the API): every code
block of README.md runs or loads (tests/doc_blocks.py, the machinery tests/test_docs.py uses for
docs/), the loss example gives the advertised numbers, the TRL drop-in trains, the two commands
are exactly the two commands. The samples / W&B and LoRA examples that the README used to carry
live in the docs now (docs/guides/runs.md, docs/guides/lora.md); what they must show is checked
here as before."""
import re

import pytest

from doc_blocks import ROOT, check_block, first_block, page_blocks, section

README = ROOT / "README.md"
DOCS = ROOT / "docs"
BLOCKS = page_blocks(README)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block_runs_or_loads(block, tmp_path):
    check_block(block, tmp_path)


def test_readme_is_short_and_links_into_the_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= 260
    for heading in ("## On a fresh machine: two commands", "## On a GPU machine", "## The loss as a library",
                    "## TRL drop-in", "## My model, my data, my reward", "## Headline figures", "## Layout",
                    "## Multi-turn tools"):
        assert heading in text, heading
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", text)
    assert links and all((ROOT / link).is_file() for link in links), [x for x in links if not (ROOT / x).is_file()]


def test_readme_api_example_runs(capsys, tmp_path):
    (block,) = [b for b in BLOCKS if b.lang == "python" and b.heading.startswith("The loss as a library")]
    assert len(block.code.strip().splitlines()) <= 12
    ns = check_block(block, tmp_path)
    out = ns["out"]
    assert out.logp.shape == (50,)
    assert ns["logits"].grad is not None and bool(ns["logits"].grad.abs().sum() > 0)
    adv = ns["adv_seq"]
    assert abs(float(adv[0]) - 0.7746) < 2e-3 and abs(float(adv[2]) + 1.291) < 2e-3


def test_readme_trl_drop_in_trains(tmp_path):
    """The drop-in script (~15 lines) trains two steps with fastgrpo's loss on every micro-batch."""
    (block,) = [b for b in BLOCKS if b.lang == "python" and b.heading.startswith("TRL drop-in")]
    assert len(block.code.strip().splitlines()) <= 18
    ns = check_block(block, tmp_path)
    trainer = ns["trainer"]
    assert trainer.state.global_step == 2
    stats = trainer.fastgrpo_stats
    assert stats.computed >= 2 and not stats.fallback


def test_readme_names_exactly_the_two_commands():
    block = first_block(section(README.read_text(), "On a fresh machine: two commands"), "bash")
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["./run train", "./run test"]


def test_readme_samples_section_matches_the_code(tmp_path):
    """The samples / W&B YAML (docs/guides/runs.md, once README's "Samples and dashboards") loads
    as a run config, and its example row has exactly the keys of a row that fastgrpo.logs.samples
    writes."""
    import json
    from types import SimpleNamespace

    import numpy as np

    from fastgrpo.config import load_config
    from fastgrpo.logs.samples import select_samples

    text = (DOCS / "guides" / "runs.md").read_text()
    path = tmp_path / "samples.yaml"
    path.write_text(first_block(section(text, "Weights & Biases"), "yaml"))
    cfg = load_config(str(path))
    assert cfg.logging.samples_every == 10 and cfg.logging.samples_max == 8 and cfg.logging.wandb.mode == "offline"
    example = json.loads(first_block(section(text, "Samples"), "json"))
    problem = SimpleNamespace(id=41, prompt="4+1=", key="")
    comps = [SimpleNamespace(text=t, token_ids=[1, 2], finish_reason="stop") for t in ("a", "b")]
    scores = np.array([[1.0, 0.0]])
    (row,) = select_samples(20, [problem], [comps], {"accuracy": scores}, scores, scores - 0.5, np.array([False]), 1)
    assert set(example) == set(row)


def test_readme_lora_section_config_loads(tmp_path):
    """The LoRA YAML (docs/guides/lora.md, once README's "LoRA policies") loads as a run config with
    its LoRA settings, and the page says how to merge."""
    from fastgrpo.config import load_config

    text = (DOCS / "guides" / "lora.md").read_text()
    path = tmp_path / "lora.yaml"
    path.write_text(first_block(text, "yaml"))
    cfg = load_config(str(path))
    assert cfg.model.lora.rank == 16 and cfg.model.lora.sync == "adapter" and cfg.model.lora.target_modules == []
    assert "fastgrpo export --merge" in text
