"""The README's API example runs as written (so the front page never drifts from the API)."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_api_example_runs(capsys):
    text = README.read_text()
    section = text.split("## The loss as a library", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 12
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    out = ns["out"]
    assert out.logp.shape == (50,)
    assert ns["logits"].grad is not None and bool(ns["logits"].grad.abs().sum() > 0)
    adv = ns["adv_seq"]
    assert abs(float(adv[0]) - 0.7746) < 2e-3 and abs(float(adv[2]) + 1.291) < 2e-3


def test_readme_names_exactly_the_two_commands():
    text = README.read_text()
    block = text.split("## On a fresh machine: two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["./run train", "./run test"]


def test_readme_samples_section_matches_the_code(tmp_path):
    """The "Samples and dashboards" YAML loads as a run config, and its example row has exactly
    the keys of a row that fastgrpo.logs.samples writes."""
    import json
    from types import SimpleNamespace

    import numpy as np

    from fastgrpo.config import load_config
    from fastgrpo.logs.samples import select_samples

    section = README.read_text().split("## Samples and dashboards", 1)[1].split("\n## ", 1)[0]
    path = tmp_path / "samples.yaml"
    path.write_text(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    cfg = load_config(str(path))
    assert cfg.logging.samples_every == 10 and cfg.logging.samples_max == 8 and cfg.logging.wandb.mode == "offline"
    example = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    problem = SimpleNamespace(id=41, prompt="4+1=", key="")
    comps = [SimpleNamespace(text=t, token_ids=[1, 2], finish_reason="stop") for t in ("a", "b")]
    scores = np.array([[1.0, 0.0]])
    (row,) = select_samples(20, [problem], [comps], {"accuracy": scores}, scores, scores - 0.5, np.array([False]), 1)
    assert set(example) == set(row)


def test_readme_lora_section_config_loads(tmp_path):
    """The "LoRA policies" YAML loads as a run config with its LoRA settings."""
    from fastgrpo.config import load_config

    section = README.read_text().split("## LoRA policies", 1)[1].split("\n## ", 1)[0]
    path = tmp_path / "lora.yaml"
    path.write_text(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    cfg = load_config(str(path))
    assert cfg.model.lora.rank == 16 and cfg.model.lora.sync == "adapter" and cfg.model.lora.target_modules == []
    assert "fastgrpo export --merge" in section
