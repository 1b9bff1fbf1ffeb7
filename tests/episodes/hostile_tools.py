"""Tools that misbehave on purpose (the executor must contain each to its own call), and a few
well-behaved ones. Sleeps live only here, inside the tools themselves."""
import os
import signal
import sys
import time


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: what to return.
    """
    return text


def shout(text: str) -> None:
    """Print the text instead of returning it.

    Args:
        text: what to print.
    """
    print(text.upper())


def nap(seconds: float) -> str:
    """Sleep, then report it.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def sleep_forever() -> str:
    """Never return."""
    while True:
        time.sleep(60)


def fork_sleeper(path: str) -> str:
    """Fork a grandchild that writes its pid to a file and sleeps forever; return at once.

    Args:
        path: where the grandchild writes its pid.
    """
    pid = os.fork()
    if pid == 0:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(60)
    for _ in range(500):  # wait until the grandchild has written its pid
        if os.path.exists(path) and open(path).read():
            break
        time.sleep(0.01)
    return "forked"


def fork_escape(path: str) -> str:
    """Fork a grandchild that leaves the process group (setsid), records its pid and sleeps.

    Args:
        path: where the grandchild writes its pid.
    """
    pid = os.fork()
    if pid == 0:
        os.setsid()
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(60)
    for _ in range(500):
        if os.path.exists(path) and open(path).read():
            break
        time.sleep(0.01)
    return "escaped"


def flood() -> str:
    """Print 100 MB to stdout."""
    chunk = "x" * (1 << 20)
    for _ in range(100):
        sys.stdout.write(chunk)
    return "flooded"


def big_result() -> str:
    """Return a long text."""
    return "y" * 100_000


def boom(message: str) -> str:
    """Raise an error.

    Args:
        message: the error's text.
    """
    raise ValueError(message)


def hard_exit() -> str:
    """Leave the interpreter at once with status 3."""
    os._exit(3)


def kill_parent() -> str:
    """SIGKILL the process that started this one."""
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(30)
    return "still here"


def my_pgid() -> str:
    """Report the process group and session of the call."""
    return f"{os.getpid()} {os.getpgid(0)} {os.getsid(0)}"
