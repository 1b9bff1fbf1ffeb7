"""What comes between two model turns, as token ids: rendered against a fixed base, never re-encoded
from the model's own text.

Chat templates (tokenizers with one): the ids the environment adds are the template's delta. A
fixed base conversation `[user: BASE, assistant: BASE]` is rendered once; the environment's
messages (tool results, an environment's observation) are rendered after that base and the base's
own rendering is cut off the front, both as text (checked to be a prefix) and as ids (checked
again: the ids of base + delta must start with the ids of the base, so no BPE merge crosses the
cut). Three pieces result, each its own ledger segment:

- the close (`bridge`): what the template writes after an assistant message's content (Qwen:
  `<|im_end|>` `\\n`), minus the part the model already sampled (a turn that ended on eos has
  sampled `<|im_end|>`; one that stopped at `</tool_call>` has not);
- the environment's messages (`environment`): their rendering, headers included;
- the next assistant header (`bridge`): the generation prompt.

This is the approach of verifiers' token-level renderers and TRL's "fixed base" trick (read
2026-12-04), checked here on ids as well as text. Tokenizers without a chat template (the tiny
demo model) use the documented tag format instead: `\\n<tool_response>\\n…\\n</tool_response>\\n`
after the turn, encoded on its own (a char-level tokenizer has no merges to cross).

History rewriting: some templates rewrite earlier assistant turns (Qwen3 drops the `<think>`
block of turns before the last user message). `rewrites_history(tokenizer, role)` probes the
template once at load; such a template needs `rollout.history` = keep | fork
(fastgrpo.rollout.episodes), and `fork_prompt` renders the history as the template would show it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from fastgrpo.episodes.calls import TOOL_RESPONSE_END, TOOL_RESPONSE_START

_BASE = "fastgrpo-base-7f3a"            # a content no template rewrites (no tags, no whitespace)
_THINK_PROBE = "<think>\nprobe-reasoning-91c2\n</think>\n\nprobe-answer"


class TemplateError(ValueError):
    """The chat template cannot render an environment turn as a clean extension (named)."""


def _ids(tokenizer, text: str) -> List[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render(tokenizer, messages, generation_prompt: bool, tools=None) -> str:
    kw = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)


def _delta(tokenizer, longer: str, base: str, what: str) -> Tuple[str, List[int]]:
    """(text, ids) that `longer` adds to `base`, checked as text and as ids."""
    if not longer.startswith(base):
        raise TemplateError(f"the chat template rewrites the conversation when {what} is added (the rendering of the "
                            "earlier turns changed); set rollout.history=fork, or use a template that appends")
    text = longer[len(base):]
    base_ids, all_ids, piece = _ids(tokenizer, base), _ids(tokenizer, longer), _ids(tokenizer, text)
    if all_ids[:len(base_ids)] != base_ids or all_ids[len(base_ids):] != piece:
        raise TemplateError(f"the tokenizer merges tokens across the boundary where {what} starts, so its ids are not "
                            "a clean extension of the conversation")
    return text, piece


class TurnRenderer:
    """Ids of the bridge and environment segments between two model turns, for one tokenizer.

    role: the role environment messages take ("tool" for tool results; an environment's
    observation takes `env_role`, "user" by default)."""

    def __init__(self, tokenizer, use_template: Optional[bool] = None, tools: Optional[list] = None):
        self.tok = tokenizer
        self.template = has_template(tokenizer) if use_template is None else use_template
        self.tools = tools
        if not self.template:
            return
        base = [{"role": "user", "content": _BASE}, {"role": "assistant", "content": _BASE}]
        self._base_msgs = base
        self._base = _render(tokenizer, base, False, tools)
        at = self._base.rfind(_BASE)
        if at < 0:
            raise TemplateError("the chat template drops the assistant's content from the conversation")
        # what the template writes after an assistant message's content (Qwen: "<|im_end|>\n")
        self.close_ids = _ids(tokenizer, self._base[at + len(_BASE):])

    def close(self, sampled: Sequence[int]) -> List[int]:
        """The bridge after a model turn: the template's close minus what the turn already
        sampled of it (its longest suffix that is a prefix of the close)."""
        if not self.template:
            return []
        c = self.close_ids
        for k in range(min(len(c), len(sampled)), 0, -1):
            if list(sampled[-k:]) == c[:k]:
                return c[k:]
        return list(c)

    def environment(self, messages: List[dict]) -> Tuple[Tuple[str, List[int]], Tuple[str, List[int]]]:
        """((text, ids) of the environment's messages, (text, ids) of the next assistant header)."""
        if not self.template:
            body = "".join(f"\n{TOOL_RESPONSE_START}\n{m['content']}\n{TOOL_RESPONSE_END}\n" if m["role"] == "tool"
                           else f"\n{m['content']}\n" for m in messages)
            return (body, _ids(self.tok, body)), ("", [])
        msgs = self._base_msgs + list(messages)
        env = _render(self.tok, msgs, False, self.tools)
        head = _render(self.tok, msgs, True, self.tools)
        return (_delta(self.tok, env, self._base, f"a {messages[0]['role']} message"),
                _delta(self.tok, head, env, "the next assistant header"))

    def probe(self, role: str) -> None:
        """Render one environment turn now (at load): a template that cannot is refused before any
        model starts."""
        self.environment([{"role": role, "content": "probe"}])


def rewrites_history(tokenizer, role: str = "user", tools=None) -> bool:
    """Whether the chat template changes an earlier assistant turn once an environment message of
    `role` follows it (Qwen3: a `<think>` block before the last user message is dropped)."""
    if not has_template(tokenizer):
        return False
    msgs = [{"role": "user", "content": _BASE}, {"role": "assistant", "content": _THINK_PROBE},
            {"role": role, "content": _BASE}]
    try:
        return _THINK_PROBE not in _render(tokenizer, msgs, True, tools)
    except Exception:  # a template that refuses the role: no history to rewrite with it
        return False


def fork_prompt(tokenizer, prompt_text: str, history: List[dict], tools=None) -> str:
    """The prompt of a forked sample (rollout.history=fork): `prompt_text` (the task's prompt,
    ending in the assistant header) with the episode's history so far as the template renders it
    (rewritten turns included), ending in the next assistant header."""
    user = [{"role": "user", "content": _BASE}]
    bare = _render(tokenizer, user, False, tools)
    header = _render(tokenizer, user, True, tools)[len(bare):]
    if not prompt_text.endswith(header):
        raise TemplateError("rollout.history=fork: the task's prompt does not end in the template's assistant header, "
                            "so the history cannot be rendered after it")
    full = _render(tokenizer, user + list(history), True, tools)
    if not full.startswith(bare):
        raise TemplateError("rollout.history=fork: the template rewrites the user message itself")
    return prompt_text[:len(prompt_text) - len(header)] + full[len(bare):]


def trace_segments(renderer: TurnRenderer, trace: List[dict]) -> List[Tuple[object, bool]]:
    """A tool trace (assistant turns with tool / user messages between them, checked by
    fastgrpo.tasks.formatting.check_trace) as SFT segments [(text or ids, trained), …], with the
    ids an episode puts between the turns: each assistant turn trained as written; a turn that ends
    in a tool call stops there (the episode stops at `</tool_call>`) and the template's close after
    it is not trained, any other turn ends on eos (trained) before the rest of the close; the
    environment's messages and the next assistant header are not trained. The final turn's eos is
    the SFT trainer's own."""
    from fastgrpo.episodes.calls import TOOL_CALL_END

    turns: List[Tuple[str, List[dict]]] = []   # (an assistant turn, the environment messages after it)
    for m in trace:
        if m["role"] == "assistant":
            turns.append((m["content"], []))
        else:
            turns[-1][1].append(m)
    eos = getattr(renderer.tok, "eos_token_id", None)
    out: List[Tuple[object, bool]] = []
    for text, env in turns:
        out.append((text, True))
        if not env:
            break
        sampled = _ids(renderer.tok, text)
        if not text.rstrip().endswith(TOOL_CALL_END) and eos is not None:
            out.append(([eos], True))   # a turn without a call ends on eos, as the model samples it
            sampled.append(eos)
        (_, env_ids), (_, head) = renderer.environment(env)
        out += [(list(renderer.close(sampled)), False), (list(env_ids), False), (list(head), False)]
    return [(piece, trained) for piece, trained in out if piece]
