"""User environments out of process: the toy protocol, hangs and crashes contained, bad classes
refused at load, TRL's environment_factory shape and verifiers' MultiTurnEnv adapted."""
import asyncio

import pytest
from conftest import alive

from fastgrpo.episodes.calls import ToolCall, format_tool_call
from fastgrpo.episodes.env import EnvFailure, EnvProcess, load_env
from fastgrpo.episodes.env_adapters import VerifiersEnvAdapter


def test_toy_env_counts_steps(here):
    with EnvProcess("toy_envs:CountEnv", base_dir=here, timeout=5.0) as env:
        assert env.kind == "native" and env.tools == []
        assert env.reset({"q": "2+2?"}) == "question: 2+2?"
        assert env.step("four") == ("turn 1 seen: four", None, False)
        assert env.step("done") == ("bye", 1.0, True)
        assert env.reset({"q": "again"}) == "question: again"  # reset starts over
        pid = env.pid
    assert not alive(pid)


def test_hanging_step_times_out_and_is_killed(here):
    env = EnvProcess("toy_envs:HangEnv", base_dir=here, timeout=1.0)
    env.reset({"q": "x"})
    with pytest.raises(EnvFailure) as e:
        env.step("move")
    assert e.value.status == "timeout" and "rollout.env" in e.value.message and "step()" in e.value.message
    assert not alive(env.pid) and not env.alive
    with pytest.raises(EnvFailure, match="closed"):
        env.step("again")


def test_crashing_step(here):
    env = EnvProcess("toy_envs:CrashEnv", base_dir=here, timeout=5.0)
    env.reset({"q": "x"})
    with pytest.raises(EnvFailure) as e:
        env.step("move")
    assert e.value.status == "error" and "died (exit status 1)" in e.value.message
    assert not alive(env.pid)


def test_raising_step_keeps_the_instance(here):
    with EnvProcess("toy_envs:RaiseEnv", base_dir=here, timeout=5.0) as env:
        env.reset({"q": "x"})
        with pytest.raises(EnvFailure) as e:
            env.step("raise")
        assert e.value.status == "error" and "KeyError" in e.value.message and "no such move" in e.value.message
        assert env.step("fine") == ("turn 1 seen: fine", None, False)
        with pytest.raises(EnvFailure, match="reset\\(\\) raised KeyError"):
            env.reset({})  # the row has no 'q'


def test_bad_return_shapes_and_init_errors(here):
    with EnvProcess("toy_envs:BadReturnEnv", base_dir=here, timeout=5.0) as env:
        env.reset({"q": "x"})
        with pytest.raises(EnvFailure, match="expected a tuple \\(observation: str"):
            env.step("move")
    with pytest.raises(EnvFailure, match="constructing the environment raised RuntimeError: cannot open the game"):
        EnvProcess("toy_envs:BrokenInitEnv", base_dir=here)


def test_close_kills_what_the_env_forked(here):
    env = EnvProcess("toy_envs:ForkingEnv", base_dir=here, timeout=5.0)
    helper = int(env.reset({"q": "x"}))
    assert alive(helper)
    env.close()
    assert not alive(helper) and not alive(env.pid)


@pytest.mark.parametrize("spec, words", [
    ("toy_envs:NeedsArgs", ["needs arguments (size)"]),
    ("toy_envs:NoStep", ["no step(self, text)", "TRL"]),
    ("toy_envs:NoReset", ["no callable reset(self, row)"]),
    ("toy_envs:NOT_A_CLASS", ["is a int, not a class"]),
    ("toy_envs:Missing", ["no such class 'Missing'"]),
    ("no_such_env_module:Env", ["does not import"]),
    ("toy_envs:LooksLikeVerifiers", ["verifiers is not installed", "pip install verifiers"]),
    ("toy_envs:UntypedTool", ["tool method act()", "parameter 'move' has no type hint"]),
    ("toy_envs", ["expected 'module:class'"]),
])
def test_bad_envs_refused_at_load(here, spec, words):
    pytest.importorskip("psutil")
    if "verifiers" in words[0]:
        try:
            import verifiers  # noqa: F401
            pytest.skip("verifiers is installed here")
        except ImportError:
            pass
    with pytest.raises(ValueError) as e:
        load_env(spec, base_dir=here)
    msg = str(e.value)
    assert msg.startswith(f"config rollout.env: {spec!r}: ") and "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("spec", ["toy_envs:WordGame", "toy_envs:make_word_game"])
def test_trl_environment_factory_shape(here, spec):
    loaded = load_env(spec, base_dir=here)
    assert loaded.kind == ("trl" if spec.endswith("WordGame") else "factory")
    with EnvProcess(loaded, timeout=5.0) as env:
        assert env.kind == "trl"
        assert [t["function"]["name"] for t in env.tools] == ["guess", "hint"]
        assert env.tools[0]["function"]["parameters"]["required"] == ["word"]
        assert env.reset({"secret": "cat", "prompt": "p"}) == "Guess the word."
        assert env.call_tool("hint", {"position": 1}) == ("ok", "a")
        assert env.call_tool("hint", {"position": "one"})[0] == "error"
        obs, reward, done = env.step("Try: " + format_tool_call(ToolCall("guess", {"word": "dog"}))
                                     + format_tool_call(ToolCall("teleport", {})))
        assert not done and reward is None
        assert obs.count("<tool_response>") == 2 and "wrong" in obs and "unknown tool 'teleport'" in obs
        assert env.step(format_tool_call(ToolCall("guess", {"word": "cat"}))) == (
            "<tool_response>\ncorrect\n</tool_response>", None, False)
        assert env.step("I solved it.") == ("", 1.0, True)  # no call: the episode ends, get_reward scores it


class FakeMultiTurnEnv:
    """verifiers' MultiTurnEnv duck type (async hooks, is_completed(messages, state))."""

    async def setup_state(self, state):
        state["asked"] = 0
        return state

    async def is_completed(self, messages, state):
        return state["asked"] >= 2

    async def env_response(self, messages, state):
        state["asked"] += 1
        return [{"role": "user", "content": f"Are you sure? ({state['asked']})"}], state


class FakeNewMultiTurnEnv(FakeMultiTurnEnv):
    """verifiers 0.1.10's shape: is_completed(state), env_response returns messages."""

    async def is_completed(self, state):
        return state["asked"] >= 1

    async def env_response(self, messages, state):
        state["asked"] += 1
        return [{"role": "user", "content": "once more"}]


def test_verifiers_adapter():
    env = VerifiersEnvAdapter(FakeMultiTurnEnv(), 100)
    assert env.reset({"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}) is None
    assert env.step("5") == ("Are you sure? (1)", None, False)
    assert env.step("4") == ("Are you sure? (2)", None, False)
    assert env.step("4!") == ("", None, True)
    assert [m["role"] for m in env.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    new = VerifiersEnvAdapter(FakeNewMultiTurnEnv(), 100)
    new.reset({"prompt": "hi"})
    assert new.step("a") == ("once more", None, False) and new.step("b") == ("", None, True)
    assert not asyncio.iscoroutine(new.state)
