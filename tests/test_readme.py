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
