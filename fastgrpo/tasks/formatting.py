"""The prompt text of a row, exactly as the model will see it, and its SFT completion.

A row's turns come from its `prompt` column (a string: one user turn; a list of messages: TRL's
conversational form) or its chat `messages` column (a list of {role, content}; a final
assistant turn is the row's reference completion when it has no completion column). Before
them go the system prompt and the few-shot examples (user / assistant turn pairs). With a chat
template (`tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`,
`enable_thinking` passed only when set, as Qwen3's template reads it) that is the prompt; without
one the text is the system prompt, the examples (prompt + completion) and the prompt, separated
by blank lines, and a multi-turn conversation is written `Role: content`.

The SFT completion of a chat model ends as the template's assistant turn would: the conversation
with the completion as its last assistant turn is rendered and the generation prompt cut off its
front; the turn's end up to the eos token is dropped because the SFT trainer appends eos itself
(ChatML: `answer<|im_end|>\\n` → `answer`, then `<|im_end|>` = eos is appended).

A tool trace (a completion that is a message list with tool messages between the model's turns, or
a chat row's turns after its last user message when they hold one) stays that message list: SFT
trains the model's turns and, untrained between them, the ids a multi-turn episode puts there
(fastgrpo.episodes.render.trace_segments, the episode runner's own renderer).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger("fastgrpo.tasks")

Turns = List[Dict[str, str]]


def row_turns(value, where: str, column: str) -> Turns:
    """A prompt / messages cell as a list of {role, content} turns (a string = one user turn)."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: column {column!r} is empty (expected the prompt text)")
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}: column {column!r} holds {type(value).__name__}; expected a string or a "
                         f"non-empty list of {{role, content}} messages")
    turns = []
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: column {column!r} message {j} is not a {{role: str, content: str}} object")
        turns.append({"role": m["role"], "content": m["content"]})
    if not any(t["role"] != "system" and t["content"].strip() for t in turns):
        raise ValueError(f"{where}: column {column!r} has no non-empty user message")
    return turns


def completion_text(value, where: str, column: str):
    """A completion cell: its text (a string, or TRL's conversational list of assistant messages),
    or a tool trace — a message list with tool (or user) messages between assistant turns, given
    back as that list (checked by `check_trace`)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value or None
    if isinstance(value, (list, tuple)) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
        if any(m.get("role", "assistant") != "assistant" for m in value):
            return check_trace(list(value), where, column)
        return "".join(m["content"] for m in value) or None
    raise ValueError(f"{where}: column {column!r} holds {type(value).__name__}; expected the completion text")


def check_trace(messages: Sequence[dict], where: str, column: str) -> Turns:
    """A tool trace as {role, content} turns: assistant turns with tool / user messages between
    them, first and last an assistant turn (what an episode's turns are); named error otherwise."""
    out: Turns = []
    for j, m in enumerate(messages):
        role = m.get("role")
        if role not in ("assistant", "tool", "user"):
            raise ValueError(f"{where}: column {column!r} message {j} has role {role!r}; a tool trace holds assistant, "
                             "tool and user messages")
        if m.get("tool_calls"):
            raise ValueError(f"{where}: column {column!r} message {j} has structured tool_calls; write the call in the "
                             "assistant's content as the model writes it (<tool_call>{\"name\": …, \"arguments\": …}"
                             "</tool_call>)")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: column {column!r} message {j} has no text content")
        if out and role == "assistant" and out[-1]["role"] == "assistant":
            raise ValueError(f"{where}: column {column!r} messages {j - 1} and {j} are two assistant turns in a row; a "
                             "tool trace has a tool (or user) message between the model's turns")
        msg = {"role": role, "content": m["content"]}
        if isinstance(m.get("name"), str):  # a tool message's tool name (templates that render it)
            msg["name"] = m["name"]
        out.append(msg)
    if out[0]["role"] != "assistant" or out[-1]["role"] != "assistant":
        raise ValueError(f"{where}: column {column!r}: a tool trace starts and ends with an assistant turn (the model's "
                         f"first and final turns); it runs {out[0]['role']} … {out[-1]['role']}")
    return out


class PromptFormatter:
    """Renders turns into the model's prompt text (and SFT completions) for one task."""

    def __init__(self, tokenizer=None, chat_template: str = "auto", system_prompt: Optional[str] = None,
                 enable_thinking: Optional[bool] = None, tools=None):
        if chat_template not in ("auto", "on", "off"):
            raise ValueError(f"data.chat_template={chat_template!r}: expected auto, on or off")
        has = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
        if chat_template == "on" and not has:
            what = "no tokenizer was given" if tokenizer is None else \
                f"the tokenizer ({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__) or 'unnamed'}) has no chat template"
            raise ValueError(f"data.chat_template=on: {what}; set data.chat_template=off for raw text, or use a "
                             f"model whose tokenizer has a chat template")
        self.tokenizer = tokenizer
        self.use_template = has and chat_template != "off"  # auto: the template when the tokenizer has one
        self.system_prompt = system_prompt or None
        self.enable_thinking = enable_thinking
        # multi-turn tools (fastgrpo.episodes): (schemas, the fallback text, whether the template renders
        # `tools=`): a template that does gets the schemas, any other prompt the text as its system part
        self.tools = tools
        if tools is not None and not (self.use_template and tools[2]):
            self.system_prompt = tools[1] + ("\n\n" + self.system_prompt if self.system_prompt else "")
        self.shots: List[Tuple[Turns, str]] = []  # few-shot examples: (turns, completion)
        self._warned = False

    def _system(self, turns: Turns, where: str) -> Turns:
        if self.system_prompt is None:
            return []
        if any(t["role"] == "system" for t in turns):
            raise ValueError(f"{where}: the row has its own system message and data.system_prompt is set; "
                             f"drop one of them")
        return [{"role": "system", "content": self.system_prompt}]

    def _shot_turns(self) -> Turns:
        out: Turns = []
        for turns, comp in self.shots:
            out += [t for t in turns if t["role"] != "system"]
            out += list(comp) if isinstance(comp, list) else [{"role": "assistant", "content": comp}]
        return out

    def _apply(self, messages: Turns, generation_prompt: bool) -> str:
        kw: Dict[str, Any] = {}
        if self.enable_thinking is not None:
            kw["enable_thinking"] = self.enable_thinking
        if self.tools is not None and self.tools[2]:
            kw["tools"] = self.tools[0]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kw)

    @staticmethod
    def plain(turns: Turns) -> str:
        body = [t for t in turns if t["role"] != "system"]
        if len(body) == 1 and body[0]["role"] == "user":
            return body[0]["content"]
        return "\n\n".join(f"{t['role'].capitalize()}: {t['content']}" for t in body) + "\n\nAssistant:"

    def messages(self, turns: Turns, where: str = "row") -> Turns:
        """The full message list a prompt is rendered from: system, few-shot turns, the row's turns."""
        return self._system(turns, where) + self._shot_turns() + list(turns)

    def prompt(self, turns: Turns, where: str = "row") -> str:
        if self.use_template:
            return self._apply(self.messages(turns, where), True)
        parts = [self.system_prompt] if self.system_prompt is not None else []
        parts += [t["content"] for t in turns if t["role"] == "system"]
        parts += [self.plain(t) + (c if isinstance(c, str) else "".join(m["content"] for m in c)) for t, c in self.shots]
        parts.append(self.plain(turns))
        return "\n\n".join(parts)

    def completion(self, turns: Turns, completion, where: str = "row"):
        """The SFT target for `completion` after this prompt (see the module docstring); a tool
        trace (a message list) is kept as it is (SFT renders it, as an episode would)."""
        if isinstance(completion, list):
            return completion
        if not self.use_template:
            return completion
        msgs = self.messages(turns, where)
        head = self._apply(msgs, True)
        full = self._apply(msgs + [{"role": "assistant", "content": completion}], False)
        if not full.startswith(head):
            if not self._warned:
                self._warned = True
                logger.warning("%s: the chat template renders an assistant turn that does not extend its generation "
                               "prompt; SFT completions are the raw completion text", where)
            return completion
        turn = full[len(head):]
        eos = getattr(self.tokenizer, "eos_token", None)
        cut = turn.rfind(eos) if eos else -1
        return turn[:cut] if cut >= 0 else turn


def prompt_lengths(tokenizer, prompts: Sequence[str], batch: int = 256) -> List[int]:
    """Token counts of prompts as the rollout encodes them (no special tokens added)."""
    out: List[int] = []
    for i in range(0, len(prompts), batch):
        out += [len(x) for x in tokenizer(list(prompts[i:i + batch]), add_special_tokens=False)["input_ids"]]
    return out
