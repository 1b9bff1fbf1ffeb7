"""`fastgrpo env` and `fastgrpo --version`: the bug-report block has a line for every library,
device and native build (a missing library says "not installed"), `--quick` builds and compiles
nothing, a native build that fails is reported with its reason, and the Triton kernels compile
for sm_90 with the bundled ptxas where it is installed."""
import os
import re
import time

import pytest

from fastgrpo import cli
from fastgrpo.native import envinfo


def _lines(block: str) -> dict:
    assert block.startswith("```\n") and block.endswith("\n```"), block
    out = {}
    for line in block.splitlines()[1:-1]:
        key, sep, value = line.partition(": ")
        assert sep, f"not a `name: value` line: {line!r}"
        out[key.strip()] = value.strip()
    return out


def test_version(capsys):
    import fastgrpo

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fastgrpo {fastgrpo.__version__}"


def test_env_quick_has_every_line(capsys, monkeypatch):
    monkeypatch.setenv("FASTGRPO_EXT_DIR", "/nonexistent/fastgrpo-ext")  # nothing built there: nothing may build
    t0 = time.monotonic()
    assert cli.main(["env", "--quick"]) == 0
    out = capsys.readouterr()
    got = _lines(out.out.strip())
    want = {"fastgrpo", "python", "platform", "torch build", "cpu", "cpu isa", "native fastgrpo._C",
            "native decode step", "native training ops", "triton compile"} | set(envinfo.PACKAGES)
    assert want <= set(got), sorted(want - set(got))
    assert any(k == "gpu" or k.startswith("gpu ") for k in got)
    assert got["native decode step"].startswith(("not built yet", "off"))
    assert got["triton compile"].startswith("not checked")
    assert "compiling" not in out.err
    assert not os.path.exists("/nonexistent/fastgrpo-ext")
    assert re.match(r"\d+\.\d+", got["torch"]) and re.match(r"\d+\.\d+\.\d+", got["python"])
    assert time.monotonic() - t0 < 60  # generous: a build would take ~30 s a module on top


def test_a_missing_package_says_not_installed(monkeypatch):
    from importlib import metadata

    real = metadata.version

    def version(dist):
        if dist in ("ray", "flash-attn"):
            raise metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(metadata, "version", version)
    got = dict(envinfo.versions())
    assert got["ray"] == "not installed" and got["flash-attn"] == "not installed"
    assert got["torch"] != "not installed"


def test_a_failed_native_build_is_reported_with_its_reason(monkeypatch):
    import warnings

    from fastgrpo.native import decode_step

    def broken():
        warnings.warn("fastgrpo: the native decode step could not be built (OSError: no compiler)", RuntimeWarning)
        return None

    monkeypatch.setattr(decode_step, "_load", broken)
    monkeypatch.setenv("FASTGRPO_FUSED_LAYERS", "0")
    got = dict(envinfo.native(quick=False))
    assert got["native decode step"].startswith("FAILS") and "no compiler" in got["native decode step"]
    assert got["native training ops"] == "off (FASTGRPO_FUSED_LAYERS=0)"


def test_bad_option_exits_2(capsys):
    assert cli.main(["env", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.skipif(envinfo._ptxas() is None, reason="Triton's NVIDIA backend (bundled ptxas) is not installed")
def test_the_triton_kernel_compiles_for_sm90():
    (name, value), = envinfo.triton_check(arch=90)
    assert name == "triton compile" and value.startswith("sm_90: compiles"), value


def test_a_triton_compile_that_fails_names_the_error(monkeypatch):
    if envinfo._ptxas() is None:
        pytest.skip("Triton's NVIDIA backend (bundled ptxas) is not installed")
    (_, value), = envinfo.triton_check(arch=7)  # sm_07: no such target
    assert value.startswith("sm_7: FAILS"), value
