"""Build: the `fastgrpo` package, `kernels/` installed as `fastgrpo.kernels`, and `csrc/`
compiled by pybind11 into `fastgrpo._C`. The extension is optional at run time: every
function in it has a pure-Python twin (see fastgrpo/native/ext.py), so a failed C++ build
leaves a working, slower install instead of no install."""
import glob
import os

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("FASTGRPO_NO_EXT", "0") != "1":
    from pybind11.setup_helpers import Pybind11Extension, build_ext

    ext_modules = [
        Pybind11Extension(
            "fastgrpo._C",
            sorted(glob.glob("csrc/*.cpp")),
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ]
    cmdclass = {"build_ext": build_ext}

setup(
    packages=["fastgrpo", "fastgrpo.kernels"]
    + [f"fastgrpo.{p}" for p in ("rewards", "rollout", "sync", "integrations", "demo")],
    package_dir={"fastgrpo": "fastgrpo", "fastgrpo.kernels": "kernels"},
    # the native sources, JIT-compiled for the host on first use (fastgrpo/_jit.py)
    package_data={"fastgrpo.rollout": ["lean_step.cpp", "sample_step.cpp"],
                  "fastgrpo": ["train_ops.cpp", "train_attn.cpp", "native_math.h"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
