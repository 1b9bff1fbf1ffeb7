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
