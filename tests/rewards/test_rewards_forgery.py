"""Score forgery: a wrong solution that attacks the harness instead of solving the task must score
0 (issue 14, item 6), and the two-process judge (sandbox/judge.py) must keep the semantics
ordinary solutions rely on (methods, in-place mutation, callbacks, exceptions, plain values)."""
import pytest

from fastgrpo.rewards import SandboxLimits, code_reward

TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 4"
WRONG = "\ndef add(a, b):\n    return a - b\n"
LIMITS = SandboxLimits(memory_mb=256, nproc=16)

# Each forgery comes with a wrong `add` (its own, or WRONG appended): only the attack could make it pass.
FORGERIES = {
    "patch builtins.exec": "import builtins\nbuiltins.exec = lambda *a, **k: None\n",
    "patch builtins.compile and AssertionError": (
        "import builtins\nbuiltins.compile = lambda *a, **k: compile('pass', 'x', 'exec')\n"
        "builtins.AssertionError = type('N', (BaseException,), {})\n"),
    "eq always true": "class E:\n    def __eq__(self, o):\n        return True\n    __ne__ = lambda s, o: False\n"
                      "    __hash__ = object.__hash__\n"
                      "def add(a, b):\n    return E()\n",
    "int subclass eq always true": "class I(int):\n    def __eq__(self, o):\n        return True\n"
                                   "    __hash__ = int.__hash__\n"
                                   "def add(a, b):\n    return I(0)\n",
    "bool always true": "class T:\n    def __bool__(self):\n        return True\n"
                        "def add(a, b):\n    return T()\n",
    "frames and gc: find the nonce, write fake verdicts on every fd": (
        "import gc, os, re, sys\n"
        "seen = set()\n"
        "f = sys._getframe()\n"
        "while f is not None:\n"
        "    seen.update(str(v) for v in f.f_locals.values() if isinstance(v, str))\n"
        "    seen.update(str(v) for v in f.f_globals.values() if isinstance(v, str))\n"
        "    f = f.f_back\n"
        "for o in gc.get_objects():\n"
        "    if isinstance(o, dict):\n"
        "        seen.update(v for v in o.values() if isinstance(v, str))\n"
        "nonces = [s for s in seen if re.fullmatch('[0-9a-f]{32}', s)]\n"
        "for fd in range(64):\n"
        "    for n in nonces + ['x']:\n"
        "        for i in range(3):\n"
        "            try:\n"
        "                os.write(fd, ('%s T %d 1\\n' % (n, i)).encode())\n"
        "            except OSError:\n"
        "                pass\n"
        "        try:\n"
        "            os.write(fd, ('%s DONE 3 3 0\\n' % n).encode())\n"
        "        except OSError:\n"
        "            pass\n"
        "os._exit(0)\n"),
    "print fake PASS lines": "print('PASSED 3/3')\nprint('DONE 3 3 0')\nimport sys\nsys.stdout.flush()\n",
    "settrace jumps over the asserts": (
        "import sys\n"
        "def tr(frame, event, arg):\n"
        "    if frame.f_code.co_filename == 'tests.py' and event == 'line':\n"
        "        try:\n"
        "            frame.f_lineno = frame.f_lineno + 1\n"
        "        except Exception:\n"
        "            pass\n"
        "    return tr\n"
        "sys.settrace(tr)\n"),
    "rewrite the harness module globals": (
        "import sys\n"
        "for m in list(sys.modules.values()):\n"
        "    d = getattr(m, '__dict__', {})\n"
        "    for k in ('passed', 'total', 'errors', 'ok'):\n"
        "        if k in d:\n"
        "            d[k] = 3\n"
        "main = sys.modules['__main__'].__dict__\n"
        "for k, v in list(main.items()):\n"
        "    if callable(v) and k in ('emit', 'main'):\n"
        "        main[k] = lambda *a, **kw: None\n"),
    "exit before the tests": "import os\nos._exit(0)\n",
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forgery_scores_zero(pool, name):
    code = FORGERIES[name] if "def add" in FORGERIES[name] else FORGERIES[name] + WRONG
    for mode in ("all", "fraction"):
        scores, why = code_reward([code], [TESTS], pool=pool, mode=mode, limits=LIMITS, timeout=3.0,
                                  return_reasons=True)
        # add(-1, 1) == 0 does not hold for a - b (-2): a wrong add passes at most 1 of 3 honestly
        assert scores[0] <= (1 / 3 if mode == "fraction" else 0.0), (name, mode, scores, why)


def test_forged_eq_on_a_method_result_fails(pool):
    code = ("class E:\n    def __eq__(self, o):\n        return True\n"
            "class S:\n    def solve(self, x):\n        return E()\n")
    assert code_reward([code], ["assert S().solve(1) == 2"], pool=pool) == [0.0]


def test_judge_memory_is_not_readable(pool):
    code = ("import os\nLEAKS = []\nfor name in ('mem', 'environ', 'maps'):\n    try:\n"
            "        open('/proc/%d/%s' % (os.getppid(), name), 'rb').read(16)\n        LEAKS.append(name)\n"
            "    except OSError:\n        pass\n")
    assert code_reward([code], ["assert LEAKS == []"], pool=pool) == [1.0]


SEMANTICS = [
    ("class Stack:\n    def __init__(self):\n        self.items = []\n"
     "    def push(self, x):\n        self.items.append(x)\n"
     "    def pop(self):\n        return self.items.pop()\n    def __len__(self):\n        return len(self.items)\n",
     "s = Stack()\ns.push(1)\ns.push(2)\nassert len(s) == 2\nassert s.pop() == 2\nassert s.items == [1]"),
    ("def sort_in_place(xs):\n    xs.sort()\n", "x = [3, 1, 2]\nsort_in_place(x)\nassert x == [1, 2, 3]"),
    ("def apply(f, x):\n    return f(x) + 1\n", "assert apply(lambda v: v * 2, 3) == 7"),
    ("def f(x):\n    raise ValueError('bad')\n",
     "try:\n    f(1)\n    ok = False\nexcept ValueError as e:\n    ok = 'bad' in str(e)\nassert ok"),
    ("def g():\n    return (1.5, {'a': [1, 2]}, {3}, b'x', 10 ** 30, 1 + 2j, None, True, frozenset([1]), -0.0)\n",
     "assert g() == (1.5, {'a': [1, 2]}, {3}, b'x', 10 ** 30, 1 + 2j, None, True, frozenset([1]), -0.0)\n"
     "assert type(g()[4]) is int and type(g()[7]) is bool"),
    ("class MyError(ValueError):\n    pass\ndef f(x):\n    raise MyError('neg')\n",
     "try:\n    f(-1)\n    ok = False\nexcept MyError as e:\n    ok = str(e) == 'neg'\nassert ok\n"
     "assert issubclass(MyError, ValueError)"),
    ("import math\ndef f(x):\n    return math.sqrt(x)\n", "assert math.isclose(f(4), 2.0)"),
    ("N = 5\nNAMES = ['a', 'b']\n", "assert N == 5\nassert NAMES[1] == 'b'"),
    ("def gen(n):\n    yield from range(n)\n", "assert list(gen(3)) == [0, 1, 2]\nassert sum(gen(4)) == 6"),
    ("from collections import namedtuple, Counter\nP = namedtuple('P', 'x y')\n"
     "def f():\n    return P(1, 2)\ndef c(s):\n    return Counter(s)\n",
     "assert f() == (1, 2)\nassert c('aab') == {'a': 2, 'b': 1}"),
    ("class A:\n    def __str__(self):\n        return 'A!'\n", "assert str(A()) == 'A!'"),
    ("def f():\n    xs = []\n    xs.append(xs)\n    return xs\n", "assert f() is not None"),
    ("def f(d, key=None):\n    return sorted(d, key=key)\n", "assert f([3, 1, 2], key=lambda v: -v) == [3, 2, 1]"),
    ("def check(candidate):\n    return candidate(2)\n", "assert check(lambda v: v + 1) == 3"),
]


@pytest.mark.parametrize("code,tests", SEMANTICS)
def test_ordinary_solutions_keep_passing(pool, code, tests):
    scores, why = code_reward([code], [tests], pool=pool, return_reasons=True)
    assert scores == [1.0], why


def test_judge_refuses_private_attributes_and_exec_from_the_solution(pool):
    # a test hands the solution a function; the solution may call it, not reach its globals
    # (through the host's own channel object, as a hostile solution would, not the proxy's checks)
    code = ("import gc\ndef probe(fn):\n    peer = [o for o in gc.get_objects() if type(o).__name__ == 'Peer'][0]\n"
            "    try:\n        peer.request('getattr', fn._id, '__globals__')\n        return 'leaked'\n"
            "    except AttributeError:\n        return fn(1)\n")
    assert code_reward([code], ["assert probe(lambda v: v + 1) == 2"], pool=pool) == [1.0]
    code = "def run(ex):\n    ex('passed = 99')\n    return 1\n"
    scores = code_reward([code], ["try:\n    r = run(exec)\nexcept Exception:\n    r = 0\nassert r == 0"], pool=pool)
    assert scores == [1.0]
