"""The installed package: every public name resolves, the C++ extension is built and loaded,
and `kernels/` is importable as `fastgrpo.kernels`."""
import subprocess
import sys

import fastgrpo


def test_every_public_name_resolves():
    missing = [n for n in fastgrpo.__all__ if getattr(fastgrpo, n, None) is None]
    assert missing == []


def test_unknown_name_raises_attribute_error():
    try:
        fastgrpo.not_a_name  # noqa: B018
    except AttributeError as e:
        assert "not_a_name" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_extension_is_built_and_loaded():
    from fastgrpo.native import ext as _cext

    assert _cext.available(), "fastgrpo._C was not built: check the pybind11 build in setup.py"
    for name in ("pack_ffd", "balance_kk", "cu_seqlens", "position_ids"):
        assert hasattr(_cext.C, name), name


def test_disable_ext_knob_falls_back_to_python():
    code = "import fastgrpo.native.ext as c; print(c.available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"FASTGRPO_DISABLE_EXT": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_kernels_installed_as_subpackage():
    import fastgrpo.kernels.reference as ref

    assert ref.__name__ == "fastgrpo.kernels.reference"


def test_import_is_cheap():
    """`import fastgrpo` must not pull transformers, vLLM or Triton (lazy exports)."""
    code = "import sys, fastgrpo; print(any(m in sys.modules for m in ('transformers', 'vllm', 'triton')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_built_wheel_holds_every_module_and_the_jit_sources(tmp_path):
    """A non-editable install (`pip install .`, a wheel) ships every package of fastgrpo/ and
    kernels/ and the JIT-built C++ sources (csrc/jit/ → fastgrpo/native/csrc/, where
    fastgrpo/native/jit.py looks outside a checkout). setup.py once listed six packages by hand:
    a wheel lacked fastgrpo.trainer, .models, .tasks, .packing, .native and kernels/triton."""
    import os
    import pathlib
    import zipfile

    import shutil

    root = pathlib.Path(__file__).resolve().parents[1]
    src = tmp_path / "src"  # a copy: setuptools writes build/ and *.egg-info next to setup.py
    for name in ("fastgrpo", "kernels", "csrc"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(root / name, src / name)
    env = dict(os.environ, FASTGRPO_NO_EXT="1")  # pure Python: the C++ extension has its own test
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("fastgrpo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {"fastgrpo/" + p.relative_to(root / "fastgrpo").as_posix() for p in (root / "fastgrpo").rglob("*.py")}
    want |= {"fastgrpo/kernels/" + p.relative_to(root / "kernels").as_posix() for p in (root / "kernels").rglob("*.py")}
    want |= {"fastgrpo/native/csrc/" + p.name for p in (root / "csrc" / "jit").iterdir()}
    assert sorted(want - names) == []
