"""The code verifier's judge: hidden unit tests and model-written code in two processes.

`runner.py` runs this file's source as `python -I -c <source>` inside the sandbox. The process
(the judge) makes itself non-dumpable, forks the solution host, and only then reads its job
(the solution, the tests, the verdict pipe and a per-run nonce) from stdin, so the host never
holds the tests, the nonce or the verdict pipe. The judge sends the solution to the host, which
executes it and replies with its global names; the judge then executes every top-level test
statement itself, in a namespace with its own untouched builtins, where each name the solution
defined is either a plain value (None, bool, int, float, complex, str, bytes, list, tuple,
dict, set, frozenset, decoded from JSON) or a `Proxy`. Calling a proxy (or reading its
attribute or item, its length, iterating it, asking for its str / repr) is a round trip over a
pair of pipes: arguments and results cross as JSON with type tags, plain data by value,
everything else as a handle to an object that stays in its own process. So every comparison
of a test (`==`, `<`, `in`, truthiness of a plain value) runs in the judge on plain values it
decoded itself; a proxy never forwards `__eq__`, ordering, `__hash__` or `__bool__` (an
object the solution returns is equal only to itself). The design is that of the RPC judges
(e.g. Codeforces' interactors, the "two process" harness of competitive-programming graders)
reduced to Python calls; it departs from a shared-interpreter harness (OpenAI human-eval's
`exec` of solution and tests together) in that nothing the solution does to its interpreter
(patching builtins, forging `__eq__`, reading frames or gc, printing fake verdicts, `os._exit`)
reaches the process that decides the score.

Semantics kept: a plain list / dict / set / bytearray argument that the callee mutates is
written back into the caller's object after the call (in-place sort, append); exceptions cross
with their type (a builtin one as itself, the solution's own classes as stand-ins of the same
name and builtin base, so a test's `except MyError` works); modules cross by name (the judge
imports standard-library or already-loaded modules only, never a file the solution wrote);
callbacks work both ways (a test's lambda passed to the solution runs in the judge). Lost: object identity across the boundary for plain values (copies),
`isinstance` against the solution's other classes, operators on non-plain results
(`obj + 1`), subclass types of plain values (a namedtuple arrives as a tuple, a Counter as a
dict, numpy scalars as Python numbers), and the solution's prints as seen by a test
(`redirect_stdout` in a test captures nothing; it is still the run's captured output). Cost:
~10 ms a run (the fork, the extra process, a round trip per call) and JSON encoding of large
arguments (a 200k-element list crosses in ~0.1 s).
The solution may read, set and call non-underscore attributes of objects the tests hand it, and
nothing else of the judge. Standard library only: the sandbox may run the system python3.
"""
import ast
import builtins
import importlib
import json
import os
import sys

_MUTABLE = (list, dict, set, bytearray)
_INT_JSON = 1 << 63  # larger ints cross as hex: json's int parsing has a 4300-digit cap (3.11+)
_MAX_DEPTH = 64  # deeper plain data crosses as a handle (bounded recursion on both sides)
_MAX_LINE = 64 << 20  # a message longer than this ends the run (the host cannot exhaust us)
# builtins a test may hand to the solution as a value, but that the solution may never call
# through the judge: they would run its code or reach the judge's namespace
_DENY = frozenset(id(getattr(builtins, n)) for n in ("exec", "eval", "compile", "__import__", "open", "getattr",
                                                     "setattr", "delattr", "globals", "locals", "vars",
                                                     "breakpoint", "input", "help") if hasattr(builtins, n))


class RemoteError(Exception):
    """An exception of a type that is not a builtin, raised in the other process."""


class Gone(Exception):
    """The other process closed the channel or broke the protocol."""


class Proxy:
    """An object living in the other process, forwarding only side-effect-free structural
    operations (never equality, ordering, hashing or truth: those stay identity-based here)."""

    __slots__ = ("_peer", "_id")

    def __init__(self, peer, hid):
        object.__setattr__(self, "_peer", peer)
        object.__setattr__(self, "_id", hid)

    def __call__(self, *args, **kwargs):
        return self._peer.request("call", self._id, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):  # copy / pickle / inspect probe dunders: never forwarded
            raise AttributeError(name)
        return self._peer.request("getattr", self._id, name)

    def __setattr__(self, name, value):
        self._peer.request("setattr", self._id, name, value)

    def __getitem__(self, key):
        return self._peer.request("getitem", self._id, key)

    def __setitem__(self, key, value):
        self._peer.request("setitem", self._id, key, value)

    def __len__(self):
        return self._peer.request("len", self._id)

    def __iter__(self):
        return iter(self._peer.request("iter", self._id))

    def __repr__(self):
        return self._peer.request("repr", self._id)

    def __str__(self):
        return self._peer.request("str", self._id)


class Peer:
    """One end of the channel: JSON lines over a pipe pair; exports its non-plain objects as
    handles and serves the other end's requests while it waits for its own replies."""

    def __init__(self, rfd, wfd, trusted_peer):
        self.rfd, self.wfd = rfd, wfd
        self.buf = bytearray()
        self.objs = {}  # handle → object exported to the other side (kept alive for the run)
        self.handles = {}  # id(object) → handle
        self.exc_classes = {}  # handle → stand-in class of the other side's exception class
        # the judge serves the host (untrusted): no underscore names, no dangerous builtins
        self.trusted_peer = trusted_peer

    # -- wire -------------------------------------------------------------------------------
    def send(self, msg):
        data = memoryview((json.dumps(msg, separators=(",", ":")) + "\n").encode("utf-8", "surrogatepass"))
        while data:
            data = data[os.write(self.wfd, data):]

    def recv(self):
        scanned = 0  # bytes of buf already known to hold no newline (linear in the message size)
        while True:
            cut = self.buf.find(b"\n", scanned)
            if cut >= 0:
                line = bytes(self.buf[:cut])
                del self.buf[:cut + 1]
                msg = json.loads(line.decode("utf-8", "surrogatepass"))
                if type(msg) is not list or not msg or type(msg[0]) is not str:
                    raise Gone("malformed message")
                return msg
            scanned = len(self.buf)
            if scanned > _MAX_LINE:
                raise Gone("message too long")
            chunk = os.read(self.rfd, 1 << 20)
            if not chunk:
                raise Gone("the other process closed the channel")
            self.buf += chunk

    # -- values -----------------------------------------------------------------------------
    def enc(self, v, depth=0):
        t = type(v)
        if v is None or t is bool or t is str:
            return v
        if t is int:
            return v if -_INT_JSON < v < _INT_JSON else ["I", format(v, "x")]
        if t is float:
            return v  # json writes repr (exact round trip) and NaN / Infinity
        if t is complex:
            return ["c", v.real, v.imag]
        if t is bytes or t is bytearray:
            return ["b" if t is bytes else "B", v.hex()]
        if t is Proxy and v._peer is self:
            return ["p", v._id]
        if depth < _MAX_DEPTH:
            if t is list or t is tuple or t is set or t is frozenset:
                tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[t]
                return [tag, [self.enc(x, depth + 1) for x in v]]
            if t is dict:
                return ["d", [[self.enc(k, depth + 1), self.enc(x, depth + 1)] for k, x in v.items()]]
        if t is type(sys):
            return ["m", v.__name__]
        if isinstance(v, type) and issubclass(v, BaseException) and getattr(builtins, v.__name__, None) is not v:
            # the other side gets a stand-in class of the same name and builtin base, so
            # `except MyError` and `issubclass(MyError, ValueError)` work there
            base = next((b.__name__ for b in v.__mro__ if getattr(builtins, b.__name__, None) is b), "Exception")
            return ["X", self._export(v), str(v.__name__), base]
        # subclasses of plain types and numpy scalars cross as their plain value (the judge
        # only ever decodes plain data, whatever the host sends)
        for base in (int, float, complex, str, bytes, tuple, list, dict, set, frozenset):
            if isinstance(v, base) and depth < _MAX_DEPTH:
                return self.enc(base(v), depth)
        if type(v).__module__ == "numpy" and getattr(v, "shape", None) == () and hasattr(v, "item"):
            return self.enc(v.item(), depth)
        return ["h", self._export(v)]

    def _export(self, v):
        key = id(v)
        if key not in self.handles:
            self.handles[key] = len(self.objs)
            self.objs[len(self.objs)] = v
        return self.handles[key]

    def dec(self, x):
        t = type(x)
        if t is not list:
            if x is None or t in (bool, int, float, str):
                return x
            raise Gone("malformed value")
        tag, arg = x[0], x[1] if len(x) > 1 else None
        if tag == "l":
            return [self.dec(e) for e in arg]
        if tag == "t":
            return tuple(self.dec(e) for e in arg)
        if tag == "d":
            return {self.dec(k): self.dec(e) for k, e in arg}
        if tag == "s":
            return {self.dec(e) for e in arg}
        if tag == "f":
            return frozenset(self.dec(e) for e in arg)
        if tag == "I":
            return int(str(arg), 16)
        if tag == "c":
            return complex(float(arg), float(x[2]))
        if tag == "b":
            return bytes.fromhex(str(arg))
        if tag == "B":
            return bytearray.fromhex(str(arg))
        if tag == "h":
            return Proxy(self, int(arg))
        if tag == "p":
            return self.objs[int(arg)]
        if tag == "m":
            return self._module(str(arg))
        if tag == "X":
            return self._exc_class(int(arg), str(x[2]), str(x[3]))
        raise Gone("unknown tag")

    def _exc_class(self, hid, name, base_name):
        if hid not in self.exc_classes:
            base = getattr(builtins, base_name, None)
            if not (isinstance(base, type) and issubclass(base, Exception)):
                base = Exception  # never a stand-in for SystemExit / KeyboardInterrupt
            self.exc_classes[hid] = type(name, (base,), {"__module__": "solution"})
        return self.exc_classes[hid]

    def _module(self, name):
        if name not in sys.modules and not self.trusted_peer and name.split(".")[0] not in getattr(
                sys, "stdlib_module_names", ()):
            raise ImportError(f"module {name!r} is not in the standard library")
        return importlib.import_module(name)

    def exc(self, name, msg, cls_enc=None):
        cls = getattr(builtins, str(name), None)
        if cls_enc is not None:
            try:
                cls = self.dec(cls_enc)
            except Exception:
                cls = None
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls(str(msg))
        return RemoteError(f"{name}: {msg}")

    # -- calls ------------------------------------------------------------------------------
    def request(self, op, hid, *args):
        if op == "call":
            pos, kw = args
            self.send(["q", op, hid, [self.enc(a) for a in pos], {str(k): self.enc(v) for k, v in kw.items()}])
        else:
            self.send(["q", op, hid] + [self.enc(a) for a in args])
        while True:
            msg = self.recv()
            if msg[0] == "q":
                self.serve(msg)
            elif msg[0] == "r" and len(msg) == 3:
                if op == "call":
                    self._write_back(pos, msg[2])
                return self.dec(msg[1])
            elif msg[0] == "e" and len(msg) in (3, 4):
                raise self.exc(*msg[1:])
            else:
                raise Gone("unexpected message")

    def _write_back(self, pos, back):
        for i, new in back:
            a = pos[int(i)]
            if type(a) not in _MUTABLE:
                continue
            new = self.dec(new)
            if type(new) is not type(a):
                continue
            if type(a) in (list, bytearray):
                a[:] = new
            else:
                a.clear()
                a.update(new)

    def serve(self, msg):
        try:
            op, obj = msg[1], self.objs[int(msg[2])]
            name = msg[3] if len(msg) > 3 else None
            if op in ("getattr", "setattr") and (type(name) is not str or
                                                 (not self.trusted_peer and name.startswith("_"))):
                raise AttributeError(f"attribute {name!r} is not reachable from the solution")
            back = []
            if op == "call":
                if not self.trusted_peer and id(obj) in _DENY:
                    raise PermissionError(f"{obj!r} cannot be called from the solution")
                pos = [self.dec(a) for a in msg[3]]
                kw = {str(k): self.dec(v) for k, v in msg[4].items()}
                out = obj(*pos, **kw)
                back = [[i, self.enc(a)] for i, a in enumerate(pos) if type(a) in _MUTABLE]
            elif op == "getattr":
                out = getattr(obj, name)
            elif op == "setattr":
                out = setattr(obj, name, self.dec(msg[4]))
            elif op == "getitem":
                out = obj[self.dec(msg[3])]
            elif op == "setitem":
                obj[self.dec(msg[3])] = self.dec(msg[4])
                out = None
            elif op == "len":
                out = len(obj)
            elif op == "iter":
                out = list(obj)
            elif op == "repr":
                out = repr(obj)
            elif op == "str":
                out = str(obj)
            else:
                raise Gone("unknown request")
            reply = ["r", self.enc(out), back]
        except Gone:
            raise
        except BaseException as e:  # the caller raises it; this side keeps serving
            try:
                reply = ["e", type(e).__name__, str(e)[:2000]]
                if getattr(builtins, type(e).__name__, None) is not type(e):
                    reply.append(self.enc(type(e)))
            except BaseException:
                reply = ["e", "RemoteError", "unprintable exception"]
        self.send(reply)


def _close_fds_except(keep):
    top = max(keep) + 1
    prev = 0
    for fd in sorted(keep):
        os.closerange(prev, fd)
        prev = fd + 1
    os.closerange(top, 1 << 16)


def _host(rfd, wfd):
    """The solution's process: no stdin, no verdict pipe, no nonce, no tests; never returns."""
    _close_fds_except({1, 2, rfd, wfd})
    sys.stdin = None
    peer = Peer(rfd, wfd, trusted_peer=True)
    try:
        msg = peer.recv()
        ns = {"__name__": "__main__", "__builtins__": builtins}
        exec(compile(msg[1], "solution.py", "exec"), ns)
        names = []
        for k, v in list(ns.items()):
            if not k.startswith("__"):
                try:
                    names.append([k, peer.enc(v)])
                except BaseException:
                    continue
        peer.send(["ready", names])
        while True:
            peer.serve(peer.recv())
    except BaseException:
        pass
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    os._exit(0)


def main():
    try:  # non-dumpable: the forked host (same uid) can neither ptrace us nor read /proc/<us>/mem
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except Exception:
        pass
    to_host_r, to_host_w = os.pipe()
    to_judge_r, to_judge_w = os.pipe()
    host = os.fork()
    if host == 0:
        os.close(to_host_w)
        os.close(to_judge_r)
        _host(to_host_r, to_judge_w)
    os.close(to_host_r)
    os.close(to_judge_w)
    job = json.loads(sys.stdin.read())
    sys.stdin.close()
    nonce, out = job.pop("nonce"), os.fdopen(job.pop("fd"), "w", buffering=1)

    def emit(line):
        out.write(nonce + " " + line + "\n")
        out.flush()

    peer = Peer(to_judge_r, to_host_w, trusted_peer=False)
    try:
        peer.send(["code", job["code"]])
        ready = peer.recv()
        if ready[0] != "ready":
            raise Gone("no ready")
        tns = {"__name__": "__main__", "__builtins__": builtins}
        for item in ready[1]:
            try:
                tns[str(item[0])] = peer.dec(item[1])
            except Exception:
                continue
    except Exception:
        os._exit(1)  # the solution raised, exited or broke the protocol before the tests
    stmts = ast.parse(job["tests"], "tests.py").body
    total = sum(isinstance(s, ast.Assert) for s in stmts)
    passed = i = errors = 0
    for s in stmts:
        try:
            exec(compile(ast.Module(body=[s], type_ignores=[]), "tests.py", "exec"), tns)
            ok = True
        except BaseException:
            ok = False
        if isinstance(s, ast.Assert):
            passed += ok
            emit("T %d %d" % (i, ok))
            i += 1
        elif not ok:
            errors += 1
            if job["stop_on_setup_error"]:
                break
    emit("DONE %d %d %d" % (passed, total, errors))
    # the host exits at the end of its channel; waiting for it saves the runner a second sweep
    # for live processes of the sandbox uid (a host that does not exit is killed at the timeout)
    os.close(to_host_w)
    os.waitpid(host, 0)
    os._exit(0)


if __name__ == "__main__":
    main()
