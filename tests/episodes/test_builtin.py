"""The built-in tools: calculator (exact, refuses anything but arithmetic) and python (the code
sandbox: prints come back, errors come back as text, nothing written persists, timeouts)."""
import os

import pytest

from fastgrpo.episodes.builtin import MAX_BITS, calculator
from fastgrpo.episodes.calls import ToolCall
from fastgrpo.episodes.executor import ToolExecutor
from fastgrpo.episodes.tools import load_tools


@pytest.mark.parametrize("expr, want", [
    ("1 + 2", "3"), ("8 / 2", "4"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 % 3", "2"), ("2 ** 10", "1024"),
    ("-(3 - 5) * 4", "8"), ("+2.5 * 2", "5"), ("0.1 + 0.2", "0.30000000000000004"), ("2 ** -1", "0.5"),
    ("10 ** 30", "1" + "0" * 30), ("(1 + 2) * (3 + 4)", "21"), ("1e3", "1000"), ("2 ** 4000 // 2 ** 3999", "2"),
])
def test_calculator_values(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize("expr, word", [
    ("x + 1", "names are not allowed"), ("abs(-1)", "function calls"), ("__import__('os')", "function calls"),
    ("(1).real", "Attribute"), ("9 ** 9 ** 9", "too large"), ("2 ** 5000", "too large"), ("1 / 0", "division by zero"),
    ("10.0 ** 400", "too large"), ("'a' * 3", "only numbers"), ("True + 1", "only numbers"), ("1 +", "not an arithmetic"),
    ("[1, 2]", "not allowed"), ("(-8) ** 0.5", "not a real number"), ("1" * 3000, "longer than"),
    ("(" * 500 + "1" + ")" * 500, "nested"), ("-" * 5000 + "1", ""), ("(2**4000) * (2**4000)", f"more than {MAX_BITS} bits"),
])
def test_calculator_refuses(expr, word):
    with pytest.raises(ValueError) as e:
        calculator(expr)
    assert word in str(e.value), str(e.value)


@pytest.fixture(scope="module")
def sandbox_pool():
    from fastgrpo.rewards.sandbox.pool import RewardPool

    pool = RewardPool(num_workers=2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def py_exec(sandbox_pool):
    ex = ToolExecutor(load_tools(["python", "calculator"]), timeout=2.0, max_output_chars=500, max_parallel=2,
                      per_episode=2, sandbox_pool=sandbox_pool)
    yield ex
    ex.close()


def test_python_prints_and_errors(py_exec):
    ok, err, syntax, calc = py_exec.run("e", [
        ToolCall("python", {"code": "print(sum(range(10)))\nprint('hi')"}),
        ToolCall("python", {"code": "print('before')\n1 / 0"}),
        ToolCall("python", {"code": "def f(:\n  pass"}),
        ToolCall("calculator", {"expression": "6 * 7"})])
    assert (ok.status, ok.output) == ("ok", "45\nhi\n")
    assert err.status == "ok" and err.output.startswith("before\n") and "ZeroDivisionError: division by zero" in err.output
    assert "SyntaxError" in syntax.output
    assert (calc.status, calc.output) == ("ok", "42")


def test_python_writes_do_not_persist(py_exec, tmp_path):
    target = tmp_path / "sub" / "out.txt"
    code = (f"import os\nos.makedirs({str(target.parent)!r}, exist_ok=True)\n"
            f"open({str(target)!r}, 'w').write('x')\nprint(open({str(target)!r}).read())")
    res = py_exec.run("e", [ToolCall("python", {"code": code})])[0]
    assert res.status == "ok"
    if os.geteuid() == 0:  # as root the sandbox has private tmpfs mounts: the write happened, in there
        assert res.output.strip() == "x"
    assert not target.exists() and not target.parent.exists()


def test_python_called_directly():
    from fastgrpo.episodes.builtin import python

    assert python("print(6 * 7)") == "42\n"  # on the shared reward pool (default_pool)


def test_python_timeout_and_output_cap(py_exec):
    slow, loud = py_exec.run("e", [ToolCall("python", {"code": "while True: pass"}),
                                   ToolCall("python", {"code": "print('z' * 10000)"})])
    assert slow.status == "ok" and "did not finish within 2 s" in slow.output
    assert slow.seconds < 2.0 + 3.0
    assert len(loud.output) < 600 and "more characters cut" in loud.output
