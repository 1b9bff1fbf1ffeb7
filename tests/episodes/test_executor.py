"""The tool executor against hostile tools: each misbehaviour costs its own call only, the result
is an error or timeout text, and no process of a call outlives it."""
import os
import time

import pytest
from conftest import alive, wait_until

from fastgrpo.episodes.calls import ToolCall
from fastgrpo.episodes.executor import ToolExecutor
from fastgrpo.episodes.tools import load_tools

TIMEOUT = 1.0
SLACK = 2.5  # generous: a loaded 2-core box


@pytest.fixture(scope="module")
def ex(here):
    names = ["add", "echo", "shout", "nap", "sleep_forever", "fork_sleeper", "fork_escape", "flood", "big_result",
             "boom", "hard_exit", "kill_parent", "my_pgid"]
    tools = load_tools([f"hostile_tools:{n}" for n in names] + ["calculator"], base_dir=here)
    executor = ToolExecutor(tools, timeout=TIMEOUT, max_output_chars=300, max_parallel=2, per_episode=2)
    yield executor
    executor.close()
    assert executor.leaked() == 0


def call(ex, name, **args):
    t0 = time.monotonic()
    res = ex.run("ep", [ToolCall(name, args)])[0]
    return res, time.monotonic() - t0


def test_plain_calls(ex):
    assert call(ex, "add", a=2)[0].output == "4"
    assert call(ex, "echo", text="héllo")[0].output == "héllo"
    assert call(ex, "shout", text="hi")[0].output == "HI"  # returned None: its print is the result
    assert call(ex, "calculator", expression="2**10")[0].output == "1024"
    res = call(ex, "big_result")[0]
    assert res.status == "ok" and res.output.startswith("y" * 300) and "99700 more characters cut" in res.output
    pid, pgid, sid = map(int, call(ex, "my_pgid")[0].output.split())
    assert pid == pgid == sid and pid != os.getpid()  # its own session and process group


def test_sleep_forever_times_out(ex):
    res, secs = call(ex, "sleep_forever")
    assert res.status == "timeout" and "did not finish within 1 s" in res.output
    assert TIMEOUT <= secs < TIMEOUT + SLACK
    assert ex.leaked() == 0


@pytest.mark.parametrize("name", ["fork_sleeper", "fork_escape"])
def test_forked_grandchild_is_killed(ex, tmp_path, name):
    path = str(tmp_path / "pid")
    res, _ = call(ex, name, path=path)
    assert res.status == "ok", res
    grandchild = int(open(path).read())
    assert not alive(grandchild)  # in the group (killpg) or escaped with setsid (the worker's sweep)
    assert ex.leaked() == 0


def test_flood_is_read_bounded(ex):
    res, secs = call(ex, "flood")
    assert res.status == "error" and "printed more than" in res.output
    assert secs < TIMEOUT + SLACK and ex.leaked() == 0


def test_raise_exit_and_kill_parent(ex):
    res = call(ex, "boom", message="bad move")[0]
    assert (res.status, res.output) == ("error", "Error: ValueError: bad move")
    res = call(ex, "hard_exit")[0]
    assert res.status == "error" and "exited with status 3" in res.output
    deaths = ex.stats["worker_deaths"]
    res, secs = call(ex, "kill_parent")
    assert res.status == "error" and "killed the process that supervised it" in res.output
    assert secs < TIMEOUT + SLACK and ex.stats["worker_deaths"] == deaths + 1
    assert ex.leaked() == 0
    assert call(ex, "add", a=1, b=1)[0].output == "2"  # a fresh worker took over


def test_bad_calls_need_no_process(ex):
    unknown, missing, extra, typed, parse = ex.run("ep", [
        ToolCall("nope", {}), ToolCall("add", {}), ToolCall("add", {"a": 1, "c": 2}), ToolCall("add", {"a": "1"}),
        "tool call 5: invalid JSON"])
    assert unknown.status == "error" and "unknown tool 'nope'" in unknown.output and "add" in unknown.output
    assert "missing argument 'a' (integer)" in missing.output
    assert "unexpected argument 'c'" in extra.output
    assert "argument 'a' must be integer" in typed.output
    assert parse.status == "parse_error" and "invalid JSON" in parse.output
    assert all(r.seconds == 0.0 for r in (unknown, missing, extra, typed, parse))


def test_turn_results_keep_order_and_one_bad_call_costs_only_itself(ex):
    results = ex.run("ep", [ToolCall("add", {"a": 1}), ToolCall("boom", {"message": "x"}), ToolCall("hard_exit", {}),
                            ToolCall("echo", {"text": "last"})])
    assert [r.status for r in results] == ["ok", "error", "error", "ok"]
    assert results[0].output == "3" and results[3].output == "last"


def test_parallel_calls_overlap(ex):
    call(ex, "add", a=0)  # both workers warm
    ex.run("warm", [ToolCall("add", {"a": 0}), ToolCall("add", {"a": 0})])
    t0 = time.monotonic()
    results = ex.run("ep", [ToolCall("nap", {"seconds": 0.5}), ToolCall("nap", {"seconds": 0.5})])
    wall = time.monotonic() - t0
    assert [r.status for r in results] == ["ok", "ok"]
    assert wall < 0.9 * sum(r.seconds for r in results), (wall, results)  # overlapped, not one after the other


def test_per_episode_limit(here):
    tools = load_tools(["hostile_tools:nap"], base_dir=here)
    with ToolExecutor(tools, timeout=5.0, max_output_chars=100, max_parallel=2, per_episode=1) as ex1:
        ex1.run("a", [ToolCall("nap", {"seconds": 0.0})] * 2)  # start both workers
        t0 = time.monotonic()
        one = ex1.submit("a", [ToolCall("nap", {"seconds": 0.4})] * 2)  # per_episode=1: one after the other
        other = ex1.submit("b", [ToolCall("nap", {"seconds": 0.4})])  # another episode runs beside them
        other.result()
        t_other = time.monotonic() - t0
        one.result()
        t_one = time.monotonic() - t0
        assert t_one >= 0.8 and t_other < t_one
        assert ex1.leaked() == 0


def test_close_fails_waiting_calls_and_kills_running_ones(here):
    tools = load_tools(["hostile_tools:sleep_forever", "hostile_tools:add"], base_dir=here)
    ex2 = ToolExecutor(tools, timeout=30.0, max_output_chars=100, max_parallel=1, per_episode=1)
    running = ex2.submit("a", [ToolCall("sleep_forever", {})])
    waiting = ex2.submit("b", [ToolCall("add", {"a": 1})])
    assert wait_until(lambda: any(w.call_pid for w in ex2._workers))  # the first call is running
    workers = [w.proc.pid for w in ex2._workers]
    ex2.close()
    assert running.result(timeout=10)[0].status == "error"
    assert waiting.result(timeout=10)[0].status == "error" and "closed" in waiting.result()[0].output
    assert ex2.leaked() == 0 and not any(alive(p) for p in workers)
    with pytest.raises(RuntimeError, match="closed"):
        ex2.submit("c", [ToolCall("add", {"a": 1})])


def test_constructor_checks(here):
    tools = load_tools(["hostile_tools:add"], base_dir=here)
    for kw, word in (({"timeout": 0}, "timeout"), ({"max_parallel": 0}, "max_parallel"),
                     ({"per_episode": 1.5}, "per_episode"), ({"context": "fork"}, "context")):
        with pytest.raises(ValueError, match=word):
            ToolExecutor(tools, **kw)
    with pytest.raises(ValueError, match="Tool"):
        ToolExecutor({"add": print})
