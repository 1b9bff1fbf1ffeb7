"""The JIT build cache (fastgrpo.native.jit): a build announces itself on stderr before it starts
(~30 s once, instead of a silent slow first step), and two installs of fastgrpo on one machine
(the same sources at two paths) share one build instead of rebuilding it for each other: torch
writes the source paths into build.ninja, and ninja rebuilds when a command line changes, so the
sources are compiled from a copy inside the build folder. A tiny Python-only module stands in for
the decode step (compiles in about a second)."""
import os
import subprocess
import sys

from fastgrpo.native import jit

PROBE = r"""#include <Python.h>
#define FG_CAT2(a, b) a##b
#define FG_CAT(a, b) FG_CAT2(a, b)
#define FG_STR2(a) #a
#define FG_STR(a) FG_STR2(a)
static struct PyModuleDef fg_def = {PyModuleDef_HEAD_INIT, FG_STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC FG_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&fg_def); }
"""

BUILD = ("import sys; from fastgrpo.native import jit; "
         "m = jit.build('probe', [sys.argv[1]], 'the probe', 'nothing', 60); print(m is not None)")


def _install(root, name):
    d = root / name
    d.mkdir()
    (d / "probe.cpp").write_text(PROBE)
    return str(d / "probe.cpp")


def test_a_build_announces_itself_and_two_installs_share_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTGRPO_EXT_DIR", str(tmp_path / "ext"))
    first, second = _install(tmp_path, "checkout-a"), _install(tmp_path, "checkout-b")
    assert jit.build_dir("probe", first) == jit.build_dir("probe", second)  # keyed by content, not path
    assert not jit.is_built("probe", first)
    assert jit.build("probe", [first], "the probe", "nothing", 60) is not None
    err = capsys.readouterr().err
    assert "compiling the probe for this CPU once" in err and "the probe built in" in err, err
    assert jit.is_built("probe", second)
    folder = jit.build_dir("probe", first)
    objs = {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in os.listdir(folder) if n.endswith((".o", ".so"))}
    assert objs, os.listdir(folder)
    with open(os.path.join(folder, "build.ninja")) as f:
        ninja = f.read()
    assert "checkout-a" not in ninja and os.path.join(folder, "src", "probe.cpp") in ninja
    # the other checkout, in a new process (as a second install's run): no compile, no announcement
    env = dict(os.environ, FASTGRPO_EXT_DIR=str(tmp_path / "ext"))
    done = subprocess.run([sys.executable, "-c", BUILD, second], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert "compiling" not in done.stderr, done.stderr
    after = {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in objs}
    assert after == objs, "the second install rebuilt the first one's extension"


def test_different_sources_get_their_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTGRPO_EXT_DIR", str(tmp_path / "ext"))
    a = _install(tmp_path, "a")
    b = _install(tmp_path, "b")
    with open(b, "a") as f:
        f.write("// changed\n")
    assert jit.build_dir("probe", a) != jit.build_dir("probe", b)
    assert jit.build_dir("probe", a) != jit.build_dir("probe", a, openmp=True)  # flags are part of the key


def test_a_build_announces_this_machines_last_build_time(tmp_path, monkeypatch, capsys):
    """issue 34: "~30 s" said, 92 s taken: the announcement quotes the last build of the same
    module on this machine (a range before the first), on a line of its own beside a bar."""
    monkeypatch.setenv("FASTGRPO_EXT_DIR", str(tmp_path / "ext"))
    os.makedirs(tmp_path / "ext")
    assert jit._last_took("probe") is None
    jit._record_took("probe", 92.3)
    assert jit._last_took("probe") == 92.3
    from tqdm import tqdm

    with tqdm(total=3, file=sys.stderr) as bar:
        bar.update(1)
        jit.say("compiling x")
    assert "\rfastgrpo: compiling x\n" in capsys.readouterr().err  # the bar cleared first, redrawn below
