"""Build: the `fastgrpo` package, `kernels/` installed as `fastgrpo.kernels`, and `csrc/`
compiled by pybind11 into `fastgrpo._C`. The extension is optional at run time: every
function in it has a pure-Python twin (see fastgrpo/native/ext.py), so a failed C++ build
leaves a working, slower install instead of no install."""
import glob
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

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

def _packages():
    """Every package under fastgrpo/ and kernels/ (installed as fastgrpo.kernels)."""
    found = ["fastgrpo." + p for p in find_packages("fastgrpo")]
    return ["fastgrpo", "fastgrpo.kernels"] + found + ["fastgrpo.kernels." + p for p in find_packages("kernels")]


class build_py_with_jit(build_py):
    """Also installs csrc/jit/ (the JIT-built host kernels) as fastgrpo/native/csrc/, where
    fastgrpo/native/jit.py looks for it outside a source checkout."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "fastgrpo", "native", "csrc")
        self.mkpath(dst)
        for src in sorted(glob.glob(os.path.join("csrc", "jit", "*"))):
            self.copy_file(src, os.path.join(dst, os.path.basename(src)))


cmdclass["build_py"] = build_py_with_jit
setup(
    packages=_packages(),
    package_dir={"fastgrpo": "fastgrpo", "fastgrpo.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
