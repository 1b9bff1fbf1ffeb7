"""Environments for the env tests: well-behaved, hanging, crashing, and badly shaped ones."""
import os
import time


class CountEnv:
    """Counts the model's turns; done after two, reward 1.0 when the second turn says 'done'."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        self.turns = 0
        return f"question: {row['q']}"

    def step(self, text):
        self.turns += 1
        if self.turns >= 2:
            return "bye", float("done" in text), True
        return f"turn {self.turns} seen: {text}", None, False


class HangEnv(CountEnv):
    def step(self, text):
        while True:
            time.sleep(60)


class CrashEnv(CountEnv):
    def step(self, text):
        os._exit(1)


class RaiseEnv(CountEnv):
    def step(self, text):
        if text == "raise":
            raise KeyError("no such move")
        return super().step(text)


class BadReturnEnv(CountEnv):
    def step(self, text):
        return "only an observation"


class BrokenInitEnv(CountEnv):
    def __init__(self):
        raise RuntimeError("cannot open the game")


class ForkingEnv(CountEnv):
    """Starts a helper process at reset (which must die with the environment)."""

    def reset(self, row):
        pid = os.fork()
        if pid == 0:
            while True:
                time.sleep(60)
        self.helper = pid
        return str(pid)


class NeedsArgs:
    def __init__(self, size):
        self.size = size

    def reset(self, row):
        return None

    def step(self, text):
        return "", None, True


class NoStep:
    def reset(self, row):
        return None

    def _private(self):
        return 1


class NoReset:
    def step(self, text):
        return "", None, True


class LooksLikeVerifiers:
    def env_response(self, messages, state):
        return [{"role": "user", "content": "again"}]

    def is_completed(self, messages, state):
        return True


NOT_A_CLASS = 42


class WordGame:
    """TRL's environment_factory shape: reset(**row), public methods are tools, get_reward()."""

    def __init__(self):
        self.secret = ""
        self.solved = False

    def reset(self, **row):
        self.secret = row["secret"]
        self.solved = False
        return "Guess the word."

    def guess(self, word: str) -> str:
        """Guess the secret word.

        Args:
            word: your guess.
        """
        self.solved = word == self.secret
        return "correct" if self.solved else "wrong"

    def hint(self, position: int) -> str:
        """Reveal one letter of the secret word.

        Args:
            position: which letter (0-based).
        """
        return self.secret[position]

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0


def make_word_game():
    return WordGame()


class UntypedTool:
    def reset(self, **row):
        return None

    def act(self, move) -> str:
        """Make a move.

        Args:
            move: the move.
        """
        return move
