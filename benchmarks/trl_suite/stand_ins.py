"""Local stand-ins for the hub models, tokenizers and datasets that TRL's GRPO tests load.

TRL's `tests/test_grpo_trainer.py` loads `trl-internal-testing/tiny-*` models (2 layers, hidden
size 8 or 16, bf16 weights, the family's real tokenizer) and the `trl-internal-testing/zen`
prompt datasets from the hub. Nothing can be downloaded here, so `build_hub_cache` writes
look-alikes into a huggingface_hub cache folder (`models--<org>--<name>/snapshots/<rev>/`, the
layout `from_pretrained` reads with `HF_HUB_OFFLINE=1`): the model ids, architectures, sizes and
dtype of the originals, randomly initialised from our own configs, and for each family a
tokenizer with the family's chat template (the one TRL ships in `trl/chat_templates/`, read from
the installed package) and special tokens.

The Qwen2.5 / Qwen3 stand-in tokenizers keep the real Qwen ids where the tests hard-code them:
byte-level BPE with the 256 byte tokens at ids 0-255 (GPT-2 order, as Qwen's), the Qwen special
tokens at 151643+ (`<|endoftext|>`, `<|im_end|>`, `<tool_call>`, ...), and the few dozen word
pieces the tool-calling tests spell out as id lists (`_QWEN_PIECES`: facts about Qwen's
vocabulary, each checked against the test's own comment). Every other id is a filler piece. No
merges: text encodes byte by byte, which is all the tests need from the encoder.

`load_dataset` answers the `zen` configs the tests use (standard / conversational prompt-only,
19 prompts split 17 / 2 as the hub's, same columns) from the Zen of Python in the stdlib's
`this` module; any other id goes to `datasets.load_dataset`.
"""
from __future__ import annotations

import codecs
import json
import os
import re
from typing import Dict, Optional

STAND_IN_VERSION = "3"  # bump when a stand-in changes: the cache is rebuilt
REVISION = "0" * 39 + STAND_IN_VERSION  # the snapshot "commit" every stand-in lives at
ORG = "trl-internal-testing"

# Qwen2.5 / Qwen3 vocabulary entries that the tool tests hard-code (id → byte-level piece; Ġ is a
# space, Ċ a newline), e.g. '<tool_call>\n{"name": "multiply_tool", ...' = 151657, 198, 4913, 606, ...
_QWEN_PIECES = {
    4913: '{"', 606: "name", 788: '":', 330: 'Ġ"', 64648: "multiply", 22785: "_tool", 497: '",',
    16370: "arguments", 5212: 'Ġ{"', 11248: "}}Ċ", 1513: "Ġdon", 944: "'t", 1414: "Ġknow", 894: "Ġany",
    5392: "Ġtool", 17453: "Done", 7692: "async", 93054: "_multiply", 35744: "increment", 9520: "step",
    2765: "Ġwon", 16252: "Ġincrement", 450: "de", 13477: "crement", 927: "sh", 411: "out", 1318: "text",
    6023: "hi", 95642: '"}}Ċ', 14172: "tool", 6659: "call", 397: ">Ċ", 522: "</", 314: "Ġ{", 293: "Ġb",
}
# (token, special) in id order from 151643, as in Qwen2.5's tokenizer; Qwen3 adds the last four
_QWEN_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
               ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
               ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
               ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
               ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
               ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
               ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False)]
_QWEN3_ADDED = [("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False)]
_QWEN_REGULAR = 151643

# family → tokenizer facts: TRL chat template file, special tokens, bos / eos / pad, regular vocab
FAMILIES: Dict[str, dict] = {
    "qwen2": dict(template="qwen2_5.jinja", added=_QWEN_ADDED, eos="<|im_end|>", pad="<|endoftext|>",
                  regular=_QWEN_REGULAR),
    "qwen3": dict(template="qwen3.jinja", added=_QWEN_ADDED + _QWEN3_ADDED, eos="<|im_end|>",
                  pad="<|endoftext|>", regular=_QWEN_REGULAR),
    "llama3": dict(template="llama3_2.jinja", added=[(t, True) for t in (
        "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
        "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")],
        bos="<|begin_of_text|>", eos="<|eot_id|>", regular=4096),
    "gemma": dict(template="gemma.jinja", added=[(t, True) for t in (
        "<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")],
        bos="<bos>", eos="<eos>", pad="<pad>", regular=4096),
    "cohere2": dict(template="cohere2.jinja", added=[(t, True) for t in ("<PAD>", "<BOS_TOKEN>", "<EOS_TOKEN>")],
                    bos="<BOS_TOKEN>", eos="<EOS_TOKEN>", pad="<PAD>", regular=4096),
    "glm4moe": dict(template="glm4moe.jinja", added=[(t, True) for t in ("<|endoftext|>", "[gMASK]", "<sop>")],
                    eos="<|endoftext|>", pad="<|endoftext|>", regular=4096),
    "gptoss": dict(template="gptoss.jinja", added=[(t, True) for t in ("<|startoftext|>", "<|endoftext|>")],
                   bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>", regular=4096),
    "nemotron": dict(template="nemotron_3_nano.jinja", added=[(t, True) for t in ("<unk>", "<s>", "</s>")],
                     bos="<s>", eos="<|im_end|>", pad="<unk>", regular=4096),
}


def _bytes_to_unicode():
    """GPT-2's byte → printable character table, in its order (the order of byte-level vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def _filler(i: int) -> str:
    """A unique 4-letter piece for filler number i (the caller skips those that are real pieces)."""
    a = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return "".join(a[(i // 52 ** k) % 52] for k in (3, 2, 1, 0))


def _template_tokens(text: str):
    """The `<|...|>` tokens a chat template spells out (they become special tokens)."""
    return sorted(set(re.findall(r"<\|[A-Za-z0-9_]{1,40}\|>", text)))


def build_tokenizer(family: str):
    """The stand-in tokenizer of a family (see the module docstring): a PreTrainedTokenizerFast."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import chat_template_utils

    spec = FAMILIES[family]
    template = (chat_template_utils._CHAT_TEMPLATES_DIR / spec["template"]).read_text(encoding="utf-8")
    vocab = {c: i for i, c in enumerate(_bytes_to_unicode())}
    pieces = _QWEN_PIECES if spec["regular"] == _QWEN_REGULAR else {}
    used = set(vocab)
    used.update(pieces.values())
    k = 0
    for i in range(256, spec["regular"]):
        if i in pieces:
            vocab[pieces[i]] = i
            continue
        while _filler(k) in used:
            k += 1
        vocab[_filler(k)] = i
        k += 1
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    added = list(spec["added"])
    names = {t for t, _ in added}
    for t in _template_tokens(template) + [spec.get(r) for r in ("bos", "eos", "pad")]:
        if t is not None and t not in names:
            added.append((t, True))
            names.add(t)
    for t, special in added:  # one at a time: ids follow this order
        tok_ = AddedToken(t, special=special, normalized=False)
        (tk.add_special_tokens if special else tk.add_tokens)([tok_])
    kw = {r + "_token": spec[r] for r in ("bos", "eos", "pad") if spec.get(r)}
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False, **kw)
    tok.chat_template = template
    return tok


def _model_specs(toks):
    """model id → (family, config factory). Sizes follow the hub originals (2 layers, hidden 8 or 16)."""
    import transformers as tf

    def ids(family):
        t = toks[family]
        eos = t.eos_token_id
        return dict(eos_token_id=eos, pad_token_id=t.pad_token_id if t.pad_token_id is not None else eos,
                    bos_token_id=t.bos_token_id)

    small = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                 intermediate_size=32)
    reward = dict(small, hidden_size=16, num_labels=1)
    return {
        "tiny-Qwen2ForCausalLM-2.5": ("qwen2", lambda: tf.Qwen2Config(vocab_size=len(toks["qwen2"]), **small,
                                                                    **ids("qwen2"))),
        "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", lambda: tf.Qwen2Config(vocab_size=152064, **reward,
                                                                                  **ids("qwen2"))),
        "tiny-Qwen3ForCausalLM": ("qwen3", lambda: tf.Qwen3Config(vocab_size=len(toks["qwen3"]), **small,
                                                                 **ids("qwen3"))),
        "tiny-Qwen3ForSequenceClassification": ("qwen3", lambda: tf.Qwen3Config(vocab_size=151936, **reward,
                                                                               **ids("qwen3"))),
        "tiny-Qwen3MoeForCausalLM": ("qwen3", lambda: tf.Qwen3MoeConfig(
            vocab_size=151936, **small, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            head_dim=128, **ids("qwen3"))),
        "tiny-LlamaForSequenceClassification-3.2": ("llama3", lambda: tf.LlamaConfig(vocab_size=128256, **reward,
                                                                                    **ids("llama3"))),
        "tiny-Gemma2ForCausalLM": ("gemma", lambda: tf.Gemma2Config(vocab_size=len(toks["gemma"]), **small,
                                                                   **ids("gemma"))),
        "tiny-Cohere2ForCausalLM": ("cohere2", lambda: tf.Cohere2Config(
            vocab_size=262144, **small, logit_scale=1.0, rope_theta=50000, **ids("cohere2"))),
        "tiny-Glm4MoeForCausalLM": ("glm4moe", lambda: tf.Glm4MoeConfig(
            vocab_size=151365, **small, moe_intermediate_size=32, head_dim=2, n_routed_experts=4,
            num_experts_per_tok=2, attention_bias=True, routed_scaling_factor=2.5, use_qk_norm=True,
            num_nextn_predict_layers=1, **ids("glm4moe"))),
        "tiny-GptOssForCausalLM": ("gptoss", lambda: tf.GptOssConfig(
            vocab_size=len(toks["gptoss"]), **small, num_local_experts=4, num_experts_per_tok=2, **ids("gptoss"))),
        "tiny-NemotronHForCausalLM-nano": ("nemotron", lambda: tf.NemotronHConfig(
            vocab_size=len(toks["nemotron"]), hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=32, layers_block_type=["mamba", "attention", "moe"], mamba_num_heads=8,
            mamba_head_dim=4, mamba_n_groups=1, ssm_state_size=16, mamba_d_conv=4, mamba_expand=2,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32, **ids("nemotron"))),
        "tiny-RemoteForCausalLM": ("llama3", None),  # custom code: see _write_remote
    }


_REMOTE_CONFIG = '''from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote"
'''
_REMOTE_MODELING = '''from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel

from .configuration_remote import RemoteConfig


class RemoteModel(LlamaModel):
    config_class = RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class RemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = RemoteConfig
'''


def _init_weights(model, seed: int):
    """Seeded init without NaNs: Xavier for linear layers, N(0, 0.02) for embeddings."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                bound = (6.0 / (m.in_features + m.out_features)) ** 0.5
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) * 2 * bound - bound)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, torch.nn.Embedding):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.02)


def _snapshot(hub: str, repo_id: str) -> str:
    repo = os.path.join(hub, "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(REVISION)
    path = os.path.join(repo, "snapshots", REVISION)
    os.makedirs(path, exist_ok=True)
    return path


def _write_model(path: str, family: str, make_config, name: str, tok, seed: int):
    import torch
    import transformers as tf

    cfg = make_config()
    arch = name[len("tiny-"):].split("-")[0]  # e.g. Qwen2ForCausalLM
    cfg.architectures = [arch]
    cls = getattr(tf, arch)
    torch.manual_seed(seed)
    model = cls(cfg)
    _init_weights(model, seed)
    model = model.to(torch.bfloat16)
    if arch.startswith("NemotronH"):  # the originals keep the SSM's A_log and D in float32
        for layer in model.model.layers:
            mixer = getattr(layer, "mixer", None)
            if hasattr(mixer, "A_log"):
                mixer.A_log.data, mixer.D.data = mixer.A_log.data.float(), mixer.D.data.float()
    model.save_pretrained(path)
    gen = tf.GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                              pad_token_id=cfg.pad_token_id)
    gen.save_pretrained(path)
    tok.save_pretrained(path)


def _write_remote(path: str, tok, seed: int):
    """tiny-RemoteForCausalLM: a Llama under custom code (`trust_remote_code=True` needed)."""
    import importlib.util
    import sys

    import torch

    for fname, src in (("configuration_remote.py", _REMOTE_CONFIG), ("modeling_remote.py", _REMOTE_MODELING)):
        with open(os.path.join(path, fname), "w") as f:
            f.write(src)
    pkg = "_fastgrpo_remote_stand_in"
    sys.modules.pop(pkg, None)
    spec = importlib.util.spec_from_file_location(pkg, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    with open(os.path.join(path, "__init__.py"), "w"):
        pass
    mod = importlib.util.module_from_spec(spec)
    sys.modules[pkg] = mod
    spec.loader.exec_module(mod)
    conf = importlib.import_module(pkg + ".configuration_remote")
    modeling = importlib.import_module(pkg + ".modeling_remote")
    os.remove(os.path.join(path, "__init__.py"))
    eos = tok.eos_token_id
    cfg = conf.RemoteConfig(vocab_size=len(tok), hidden_size=8, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, intermediate_size=32, eos_token_id=eos, pad_token_id=eos,
                            bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    model = modeling.RemoteForCausalLM(cfg)
    _init_weights(model, seed)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c["architectures"] = ["RemoteForCausalLM"]
    c["auto_map"] = {"AutoConfig": "configuration_remote.RemoteConfig",
                     "AutoModel": "modeling_remote.RemoteModel",
                     "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
                     "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    tok.save_pretrained(path)
    sys.modules.pop(pkg, None)
    for k in [k for k in sys.modules if k.startswith(pkg + ".")]:
        sys.modules.pop(k)


def model_ids():
    """The hub ids the stand-in cache answers."""
    return [f"{ORG}/{n}" for n in _model_specs({f: None for f in FAMILIES})]


def build_hub_cache(hub: str, only=None, log=print) -> str:
    """Write every stand-in model (or those named in `only`, short names) into the hub cache
    folder `hub`; a stand-in already there at this STAND_IN_VERSION is kept. Returns `hub`."""
    os.makedirs(hub, exist_ok=True)
    toks: Dict[str, object] = {}
    specs = _model_specs(toks)
    for seed, (name, (family, make_config)) in enumerate(specs.items()):
        if only is not None and name not in only:
            continue
        path = os.path.join(hub, "models--" + f"{ORG}--{name}", "snapshots", REVISION)
        if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "model.safetensors")):
            continue
        if family not in toks:
            toks[family] = build_tokenizer(family)
        path = _snapshot(hub, f"{ORG}/{name}")
        log(f"[trl_suite] stand-in {ORG}/{name}")
        if make_config is None:
            _write_remote(path, toks[family], seed)
        else:
            _write_model(path, family, make_config, name, toks[family], seed)
    return hub


# ---------------------------------------------------------------- datasets


def _zen_lines():
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this  # its text, rot13, is this.s

    text = codecs.decode(this.s, "rot13")
    return [ln for ln in text.splitlines()[2:] if ln.strip()]


def zen_rows(config: str):
    """The rows of one `trl-internal-testing/zen` config we stand in for (19, like the hub's)."""
    lines = _zen_lines()[:19]
    if config == "standard_prompt_only":
        # the first half of each line, as a prompt to complete
        return {"prompt": [" ".join(ln.split()[: max(1, len(ln.split()) // 2)]) for ln in lines]}
    if config == "conversational_prompt_only":
        return {"prompt": [[{"role": "user", "content": f"How does this line go on: {ln.split()[0]} ...?"}]
                           for ln in lines]}
    raise ValueError(f"trl-internal-testing/zen: no stand-in for config {config!r} (the GRPO tests use "
                     "standard_prompt_only and conversational_prompt_only)")


_real_load_dataset = None


def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    """`datasets.load_dataset` with `trl-internal-testing/zen` answered locally (train 17 / test 2
    rows, no shuffling, like the hub's train_test_split(test_size=0.1))."""
    import datasets

    if path != f"{ORG}/zen":
        return (_real_load_dataset or datasets.load_dataset)(path, name, *args, split=split, streaming=streaming,
                                                             **kwargs)
    name = name if name is not None else kwargs.pop("data_dir", None)
    full = datasets.Dataset.from_dict(zen_rows(name))
    parts = full.train_test_split(test_size=0.1, shuffle=False)
    dd = datasets.DatasetDict({"train": parts["train"], "test": parts["test"]})
    if streaming:
        dd = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in dd.items()})
    if split is None:
        return dd
    if split not in dd:
        raise ValueError(f"{path}/{name}: split {split!r}: expected one of {sorted(dd)}")
    return dd[split]


def install_load_dataset():
    """Point `datasets.load_dataset` at the stand-in (before the test module imports it)."""
    global _real_load_dataset
    import datasets

    if _real_load_dataset is None:
        _real_load_dataset = datasets.load_dataset
    datasets.load_dataset = load_dataset


def offline_env(work: str) -> Dict[str, str]:
    """Environment for a process that reads the stand-ins: hub cache at <work>/hub, offline."""
    return {"HF_HUB_CACHE": os.path.join(work, "hub"), "HF_HOME": os.path.join(work, "hf_home"),
            "HF_MODULES_CACHE": os.path.join(work, "hf_modules"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def stand_in_path(hub: str, name: str) -> Optional[str]:
    path = os.path.join(hub, "models--" + f"{ORG}--{name}", "snapshots", REVISION)
    return path if os.path.isdir(path) else None
