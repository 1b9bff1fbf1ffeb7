"""The documentation site (docs/, mkdocs.yml) cannot drift from the code.

- `mkdocs build --strict` passes: no broken link or anchor, every generated page renders;
- every config field has a comment in its dataclass (the comment is its reference entry) and
  appears in the generated configuration reference; every command and flag of the CLI has its
  help, appears in the generated CLI reference, and each command's `--help` names its docs page;
- every metric name the source emits (a string literal or f-string of a metric namespace, a
  timer phase, every loss-kernel metric) is listed on docs/reference/metrics.md, and every name
  listed there is still emitted;
- every public exception class is named on docs/reference/errors.md;
- every code block of the docs runs or loads (tests/doc_blocks.py: python runs, YAML loads as a run
  config, `fastgrpo` commands parse and load their settings, scripts and their flags exist).

The extraction code is docs/reference_data.py, shared with the page generator docs/gen_ref.py.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from doc_blocks import ROOT, check_block, check_command, inline_commands, page_blocks, write_files

DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))
import gen_ref  # noqa: E402
import reference_data as ref  # noqa: E402

PAGES = sorted(DOCS.rglob("*.md"))
BLOCKS = [(page, b) for page in PAGES for b in page_blocks(page)]


def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", DISABLE_MKDOCS_2_WARNING="true")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-8000:]
    site = tmp_path / "site"
    config_html = (site / "reference" / "config" / "index.html").read_text()
    missing = [f.path for f in ref.config_fields() if f.path.replace("<", "&lt;").replace(">", "&gt;") not in config_html]
    assert not missing, f"fields missing from the built configuration reference: {missing}"
    api_html = (site / "reference" / "api" / "index.html").read_text()
    assert all(f'id="{o.identifier}"' in api_html or o.name in api_html for o in ref.api_objects())
    assert "Multi-turn tools and environments" in (site / "guides" / "multi-turn" / "index.html").read_text()


def test_every_config_field_has_documentation():
    fields = ref.config_fields()
    assert len(fields) > 150 and {"rollout.group_size", "model.lora.rank", "rewards.models.<name>.kind",
                                  "logging.wandb.mode", "rewards.process.scorer"} <= {f.path for f in fields}
    undocumented = [f.path for f in fields if not f.comment.strip()]
    assert not undocumented, ("config fields without a comment in their dataclass (the comment is their entry in "
                              f"docs/reference/config.md): {undocumented}")
    page = gen_ref.config_page()
    assert not [f.path for f in fields if f"`{f.path}`" not in page]
    checked = {f.path for f in fields if f.valid}
    assert {"rollout.engine", "algorithm.loss_agg", "algorithm.kl", "data.answer_format", "model.lora.sync",
            "rewards.functions"} <= checked, "the valid values of checked fields are missing from the reference"


def test_every_cli_command_and_flag_has_documentation():
    commands = ref.cli_commands()
    names = {c.name for c in commands}
    assert {"train", "sft", "eval", "bench", "fuse", "env", "export"} <= names
    page = gen_ref.cli_page()
    no_help = [(c.name, o.flags) for c in commands for o in c.options if not o.help.strip()]
    assert not no_help, f"CLI options without help: {no_help}"
    absent = [(c, f) for c, f in ref.cli_flags() if f"`{f}" not in page]
    assert not absent, f"CLI flags missing from the generated reference: {absent}"
    for c in commands:
        m = re.search(r"docs/([\w/.-]+\.md)", c.epilog)
        assert m, f"`fastgrpo {c.name} --help` does not name its docs page (its epilog: {c.epilog!r})"
        assert (DOCS / m.group(1)).is_file(), f"`fastgrpo {c.name} --help` names {m.group(0)}, which does not exist"
        assert (c.name == "" or c.help), f"`fastgrpo {c.name}` has no help line"


def _loss_metric_keys():
    import torch

    from fastgrpo import LossConfig, grpo_loss

    g = torch.Generator().manual_seed(0)
    n, v = 12, 17
    logits = torch.randn(n, v, generator=g)
    cfg = LossConfig(beta=0.1, entropy_coef=0.01, dual_clip_c=3.0, delta=2.0)
    out = grpo_loss(logits, torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g),
                    old_logp=torch.randn(n, generator=g) - 3, ref_logp=torch.randn(n, generator=g) - 3, config=cfg,
                    impl="reference")
    return sorted(out.metrics)


def test_every_metric_is_documented():
    documented = ref.documented_metrics((DOCS / "reference" / "metrics.md").read_text())
    assert len(documented) > 60
    found = ref.metric_literals()
    names = {m.name for m in found}
    assert {"train/loss", "reward/mean", "timing/rollout", "async/staleness_mean", "eval/accuracy"} <= names
    missing = sorted({f"{m.name}  ({m.file}:{m.line})" for m in found if not ref.metric_documented(m.name, documented)})
    loss = [f"loss/{k}" for k in _loss_metric_keys()]
    missing += [f"{k}  (a metric of the loss kernels)" for k in loss if not ref.metric_documented(k, documented)]
    assert not missing, "metrics not documented in docs/reference/metrics.md:\n  " + "\n  ".join(missing)
    # and the page lists nothing the code no longer emits
    emitted = sorted(names | set(loss))
    stale = [d for d in documented if "<" not in d and not ref.metric_documented(d, emitted)
             and not any(d.startswith(e) for e in emitted if e.endswith("_"))]
    assert not stale, f"docs/reference/metrics.md lists metrics the code does not emit: {stale}"


def test_every_exception_class_is_documented():
    page = (DOCS / "reference" / "errors.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)` \|", page, re.M))
    classes = {c.name: c for c in ref.exception_classes()}
    assert {"TrainingStopped", "RunLockError", "CheckpointError"} <= set(classes)
    missing = [f"{c.name} ({c.module})" for c in classes.values() if c.name not in listed]
    assert not missing, f"exception classes not in docs/reference/errors.md: {missing}"
    stale = sorted(listed - set(classes))
    assert not stale, f"docs/reference/errors.md names exception classes the code no longer defines: {stale}"


@pytest.mark.parametrize("page, block", BLOCKS, ids=[b.id for _, b in BLOCKS])
def test_docs_block_runs_or_loads(page, block, tmp_path, monkeypatch):
    if "run" in block.marks:  # a real run: no one-off native builds on a fresh machine
        monkeypatch.setenv("FASTGRPO_FUSED_LAYERS", "0")
        monkeypatch.setenv("FASTGRPO_NATIVE_DECODE", "0")
    files = write_files(page_blocks(page), tmp_path)
    check_block(block, tmp_path, files)


def test_docs_have_blocks_of_every_kind():
    langs = {b.lang for _, b in BLOCKS}
    assert {"python", "yaml", "bash", "json"} <= langs
    assert any("run" in b.marks for _, b in BLOCKS), "no docs block runs fastgrpo for real"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_inline_commands_name_real_scripts_and_flags(page, tmp_path):
    import shlex

    old = os.getcwd()
    os.chdir(ROOT)
    try:
        for command in inline_commands(page.read_text()):
            check_command(shlex.split(command), tmp_path, {}, where=f"{page.relative_to(ROOT)}: `{command}`")
    finally:
        os.chdir(old)


def test_docs_extra_and_run_install_the_tools():
    """The docs extra lists the site's tools (so `./run` installs them: nothing here is skipped)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "docs" in extras, "pyproject.toml has no docs extra"
    for tool in ("mkdocs", "mkdocs-material", "mkdocstrings", "mkdocs-gen-files"):
        assert any(re.match(rf"{tool}[\[<>=~!; ]", req) for req in extras["docs"]), tool
    assert re.search(r'-e "\.\[[\w,]*\bdocs\b[\w,]*\]"', (ROOT / "run").read_text()), "./run does not install the docs extra"
