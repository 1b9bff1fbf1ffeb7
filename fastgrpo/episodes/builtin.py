"""Built-in tools: `calculator` (safe arithmetic) and `python` (the code sandbox).

`calculator` evaluates an arithmetic expression by walking its `ast` (numbers, + - * / // % **,
unary minus / plus, parentheses) instead of `eval`: names, calls, attributes and every other
node are refused, and results are capped at `MAX_BITS` bits (an integer of ~1,200 digits), a
power being refused from its operands' sizes before it is computed (`9**9**9` would otherwise
take minutes and gigabytes). This is the "calculator tool" of the tool-use RL papers (Toolformer,
ToRA's arithmetic), reduced to what a model needs.

`python` runs model-written code in the code reward's sandbox (rewards/sandbox/runner.py
`run_python` on a RewardPool worker): the same rlimits, network namespace, read-only file
systems with private tmpfs (nothing the code writes outlives the run), scrubbed environment
and wall-clock limit as the code verifier, with an empty test file. The code runs wrapped in a
try/except that prints the last line of a traceback, so the model sees `NameError: name 'x' is
not defined` instead of nothing. Departures: no state between calls (each call is a fresh
interpreter, unlike a Jupyter-style REPL tool), and stdout and stderr come back merged.
"""
from __future__ import annotations

import ast
import math
import operator
from typing import Optional

from fastgrpo.rewards.sandbox.runner import SandboxLimits, run_python

MAX_BITS = 4096  # ~1,233 decimal digits: far above any arithmetic a model checks, cheap to print
MAX_EXPRESSION_CHARS = 2000  # longer "expressions" are programs: use the python tool
PYTHON_TIMEOUT_S = 10.0  # wall clock of one python call when called directly (the executor passes its own)
PYTHON_OUTPUT_CHARS = 16_000  # what a direct python call returns at most

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _log2(x) -> float:
    """log2 of |x| (0 for 0), for ints of any size and floats alike."""
    return math.log2(abs(x)) if x else 0.0


def _check(x):
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError("the result is not a finite number")
    if isinstance(x, int) and x.bit_length() > MAX_BITS:
        raise ValueError(f"the result has more than {MAX_BITS} bits; the calculator refuses numbers this large")
    return x


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"only numbers are allowed, not {node.value!r}")
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            # the result has about |b| * log2|a| bits: refuse before computing it
            if _log2(a) > 0 and b * _log2(a) > MAX_BITS:
                raise ValueError(f"the power is too large (over {MAX_BITS} bits)")
            if a == 0 and b < 0:
                raise ValueError("zero cannot be raised to a negative power")
        try:
            out = _BINOPS[type(node.op)](a, b)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
        if isinstance(out, complex):
            raise ValueError("the result is not a real number")
        return _check(out)
    if isinstance(node, ast.Name):
        raise ValueError(f"names are not allowed ('{node.id}'); write the number itself")
    if isinstance(node, ast.Call):
        raise ValueError("function calls are not allowed; use + - * / // % ** and parentheses")
    raise ValueError(f"'{type(node).__name__}' is not allowed; use numbers, + - * / // % ** and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2**10".
    """
    if not isinstance(expression, str):
        raise ValueError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        detail = e.msg if isinstance(e, SyntaxError) else type(e).__name__
        raise ValueError(f"not an arithmetic expression ({detail})") from None
    try:
        value = _eval(tree)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))  # 8/2 → "4", not "4.0"
    return repr(value) if isinstance(value, float) else str(value)


# -- python ------------------------------------------------------------------------------------
# The model's code runs inside exec() so that an exception still prints its last line; globals
# look like a script's (__name__ == "__main__").
_WRAPPER = """import sys as _sys, traceback as _tb
try:
    exec(compile({src!r}, "<python>", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
except SystemExit as _e:
    if _e.code not in (None, 0):
        _sys.stdout.flush()
        print("SystemExit: " + str(_e.code), file=_sys.stderr)
except BaseException as _e:
    _sys.stdout.flush()
    print(_tb.format_exception_only(type(_e), _e)[-1].rstrip(), file=_sys.stderr)
"""


def run_python_tool(code: str, timeout: float = PYTHON_TIMEOUT_S, max_chars: int = PYTHON_OUTPUT_CHARS,
                    limits: Optional[SandboxLimits] = None) -> str:
    """The python tool's body, run on a RewardPool worker (where the sandbox's uid, namespaces and
    tmpfs are set up): what the code printed, then an error line if it raised or was stopped."""
    lim = limits or SandboxLimits()
    # as the code reward does: CPU seconds follow the wall clock
    lim = SandboxLimits(**{**lim.__dict__, "cpu_seconds": max(1, min(lim.cpu_seconds, int(timeout + 1)))})
    res = run_python(_WRAPPER.format(src=code), "", timeout=timeout, limits=lim)
    if res.reason and res.reason.startswith("sandbox_error"):
        raise RuntimeError(f"the python sandbox could not start ({res.reason})")
    out = res.output.decode("utf-8", "replace")
    if res.reason == "timeout":
        out += f"\nError: the program did not finish within {timeout:g} s and was stopped"
    elif res.reason == "output_limit":
        out += f"\nError: the program printed more than {lim.max_output_bytes} bytes and was stopped"
    elif res.reason == "crashed":
        out += "\nError: the program was killed (memory, CPU time or process limit)"
    if len(out) > max_chars:
        out = out[:max_chars] + f"\n...[{len(out) - max_chars} more characters cut]"
    return out if out.strip() else "(no output; print() what you want to see)"


def python(code: str) -> str:
    """Run a Python program in a fresh sandboxed interpreter and return what it prints.

    Args:
        code: a complete Python program; print() the values you want to see.
    """
    from fastgrpo.rewards.sandbox.pool import default_pool

    margin = 2.0  # the sandbox stops the run itself; the pool's kill is only the backstop
    res = default_pool().submit(run_python_tool, (code, PYTHON_TIMEOUT_S), timeout=PYTHON_TIMEOUT_S + margin).result()
    if not res.ok:
        raise RuntimeError(f"the python sandbox failed ({res.reason})")
    return res.value


# The executor runs the python tool on the sandbox's RewardPool (whose workers set up the uid,
# namespaces and tmpfs) instead of forking a tool process: it calls run_python_tool(code, timeout,
# max_chars) there.
python.__fastgrpo_sandboxed__ = run_python_tool
