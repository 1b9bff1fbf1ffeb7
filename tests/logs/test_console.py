"""The quiet console (fastgrpo/logs/console.py): library logs go to <run>/log.txt, and a
second run (or stage) in the same process closes the first run's file."""
import logging

import pytest

from fastgrpo.logs.console import LIBRARY_LOGGERS, quiet_console


@pytest.fixture
def restore_loggers(monkeypatch):
    from fastgrpo.logs import console

    monkeypatch.setattr(console, "QUIETED", console.QUIETED)
    saved = {n: (lg.handlers[:], lg.propagate, lg.__class__, lg.level)
             for n in LIBRARY_LOGGERS for lg in [logging.getLogger(n)]}
    yield
    for n, (handlers, propagate, cls, level) in saved.items():
        lg = logging.getLogger(n)
        lg.handlers, lg.propagate, lg.__class__ = handlers, propagate, cls
        lg.setLevel(level)
    logging.captureWarnings(False)


def test_library_logs_go_to_the_run_file_and_a_second_run_closes_the_first(tmp_path, restore_loggers, capsys):
    first = quiet_console(str(tmp_path / "a"))
    logging.getLogger("transformers").warning("from the first run")
    (h1,) = logging.getLogger("transformers").handlers
    assert h1.stream is not None and not h1.stream.closed
    second = quiet_console(str(tmp_path / "b"))
    logging.getLogger("vllm").warning("from the second run")
    assert h1.stream is None  # FileHandler.close() drops its stream: no file left open
    assert "from the first run" in open(first).read() and "from the second run" in open(second).read()
    assert "from the" not in capsys.readouterr().err
    logging.getLogger("trl").addHandler(logging.StreamHandler())  # a console handler added later
    assert all(isinstance(h, logging.FileHandler) for h in logging.getLogger("trl").handlers)


def test_numbers_and_the_bar_read_as_a_person_writes(tmp_path, monkeypatch):
    """issue 34: `eval/num_problems: 200.0000`, pass@k printed 8, 1, 4, `acc=0.00` on every
    step of a run that does not train on accuracy, a last line naming tb/ and plots/ that were
    never written."""
    from fastgrpo.logs.console import bar_postfix, eval_order, number, run_folder_line

    assert [number(v) for v in (200.0, 0.123456, 3, 12345.6, 0.5, True)] == ["200", "0.1235", "3", "12346", "0.5", "True"]
    ev = {"eval/pass@8": 1.0, "eval/num_problems": 200.0, "eval/pass@1": 0.5, "eval/accuracy": 0.5, "eval/pass@4": 0.9}
    assert eval_order(ev) == ["eval/accuracy", "eval/pass@1", "eval/pass@4", "eval/pass@8", "eval/num_problems"]
    assert "acc" not in bar_postfix({"reward/mean": 0.7, "perf/throughput": 10.0})  # process-only: no accuracy
    assert bar_postfix({"reward/mean": 0.7, "train/accuracy": 0.25})["acc"] == "0.25"
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "tb").mkdir()  # empty: nothing written there
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("tensorboard", "matplotlib") else real(n, *a))
    line = run_folder_line(str(tmp_path))
    assert line == (f"[fastgrpo] run folder: {tmp_path} (metrics.jsonl); no tb/ or plots/: tensorboard and matplotlib "
                    "are not installed (pip install tensorboard matplotlib)")
    assert run_folder_line(str(tmp_path), tensorboard=False, plots=False).endswith("(metrics.jsonl)")


def test_another_rank_logs_to_its_own_file(tmp_path, restore_loggers, capsys):
    """issue 34: rank 1 of `torchrun --nproc_per_node 2` printed DeepSpeed's and torch's lines
    on the console (a second copy of each); now they go to log-rank1.txt."""
    path = quiet_console(str(tmp_path), rank=1)
    logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU")
    for h in logging.getLogger("DeepSpeed").handlers:
        h.close()
    with open(path) as f:
        assert path.endswith("log-rank1.txt") and "Setting accelerator" in f.read()
    assert "Setting accelerator" not in capsys.readouterr().err


def test_the_bar_eta_leaves_out_the_first_step():
    """issue 34: a native build in the first GRPO step (~90 s) made the bar's ETA read 7 h 15 m;
    after the first step the clock starts again (a fake clock: no sleeps)."""
    import io

    from tqdm import tqdm

    from fastgrpo.logs.console import restart_clock

    now = [0.0]
    bar = tqdm(total=101, file=io.StringIO(), mininterval=0, smoothing=0)
    bar._time = lambda: now[0]
    bar.start_t = bar.last_print_t = 0.0
    now[0] = 90.0  # the first step: a build
    bar.update(1)
    restart_clock(bar)
    for _ in range(4):  # then 1 s a step
        now[0] += 1.0
        bar.update(1)
    d = bar.format_dict
    rate = (d["n"] - d["initial"]) / d["elapsed"]
    assert d["n"] == 5 and d["initial"] == 1 and rate == 1.0  # without the restart: 5 / 94 steps a second
    assert "00:04<01:36" in bar.format_meter(**d)  # 96 steps left at 1 s each
    bar.close()


def test_a_held_out_evaluation_shows_a_bar_over_its_problems(capsys, monkeypatch):
    """issue 34: a first evaluation of 200 problems ran for minutes without a word. The built-in
    engine counts completions batch by batch; evaluate turns them into problems on a bar that it
    removes at the end (leave=False) and unhooks from the engine."""
    from types import SimpleNamespace

    from fastgrpo.config import EvalConfig, RolloutConfig
    from fastgrpo.models.tiny import build_tiny_model
    from fastgrpo.rollout.torch_engine import TorchEngine
    from fastgrpo.trainer.evaluation import evaluate

    model, tok = build_tiny_model("qwen2", seed=0)
    engine = TorchEngine(model, tok, max_batch_size=4)
    counts = []
    engine.progress = counts.append
    engine.generate(["1+2=", "3+4=", "5+6="], n=2)
    assert counts == [4, 2]  # completions per batch of 4
    engine.progress = None
    problems = [SimpleNamespace(prompt=f"{i}+1=", answer=str(i + 1), id=i) for i in range(5)]
    fns = {"accuracy": lambda completions, answers, **kw: [0.0] * len(completions)}
    rcfg = RolloutConfig(max_new_tokens=2)
    import tqdm.auto

    closed = []

    class Bar(tqdm.auto.tqdm):
        def close(self):
            closed.append(self.n)
            super().close()

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    evaluate(engine, problems, fns, EvalConfig(num_samples=2, temperature=0.0), rcfg, progress=True)
    err = capsys.readouterr().err
    assert "eval:   0%" in err and "0/5 [" in err and "problem/s" in err
    assert closed[0] == 5 and engine.progress is None  # 10 completions = 5 problems; unhooked
    evaluate(engine, problems, fns, EvalConfig(num_samples=2, temperature=0.0), rcfg)  # progress off: no bar
    assert "eval:" not in capsys.readouterr().err


def test_vllm_counting_bar_draws_nothing_and_counts():
    """vLLM's own bar ("Processed prompts") would be a second bar beside the evaluation's: its
    tqdm class draws nothing and hands the counts on; vLLM reads n, format_dict and postfix."""
    from fastgrpo.rollout.vllm_support import counting_bar

    got = []
    pbar = counting_bar(got.append)(total=3, desc="Processed prompts", dynamic_ncols=True, postfix="x")
    assert pbar.format_dict["elapsed"] >= 0
    pbar.postfix = "est. speed"
    pbar.update(2)
    pbar.update(1)
    assert pbar.n == 3 and got == [2, 1]
    pbar.refresh()
    pbar.close()
    assert list(counting_bar(got.append)([1, 2], desc="Adding requests")) == [1, 2] and got == [2, 1]


def test_waits_say_what_they_do(tmp_path, monkeypatch, capsys):
    """issue 34: the vLLM engine's start (26 s) and a GGUF conversion said nothing; each now says
    it on a line of its own before the wait."""
    import fastgrpo.rollout as rollout
    from fastgrpo.config import RolloutConfig
    from fastgrpo.trainer import build

    monkeypatch.setattr(rollout, "choose_engine", lambda engine, model: ("vllm", None))
    monkeypatch.setattr(rollout, "make_engine", lambda *a, **kw: "engine")
    assert build.build_rollout_engine(RolloutConfig(engine="vllm"), None, None, prompt_len=8) == "engine"
    out = capsys.readouterr().out
    assert "starting the vLLM engine" in out and "vLLM engine ready in" in out

    import transformers

    from fastgrpo.models.gguf import gguf_to_hf

    def refuse(*a, **kw):
        raise ImportError("no gguf")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="gguf"):
        gguf_to_hf(str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert f"fastgrpo: converting {tmp_path / 'm.gguf'} into a HF folder once" in capsys.readouterr().err


def test_model_load_and_bench_say_what_they_do(tmp_path, monkeypatch):
    """issue 34: loading a model of your own (minutes for 7B) and `fastgrpo bench` (29 s) were
    silent; the load is said first, bench says its warm-up and each step as it ends."""
    from fastgrpo import pipeline
    from fastgrpo.config import load_config

    said = []
    monkeypatch.setattr(pipeline, "build_model", lambda mcfg, tokenizer=None: ("model", tokenizer))
    cfg = load_config(None, ["model.path=/models/Qwen2.5-7B"])
    assert pipeline._build_model(cfg, pipeline.RunParts("tok", None, None, None), said.append) == ("model", "tok")
    assert said == ["[fastgrpo] loading the model /models/Qwen2.5-7B …"]
    monkeypatch.undo()
    said.clear()
    cfg = load_config(None, ["steps=2", "sft_first=false", "rollout.engine=torch", "rollout.prompts_per_step=2",
                             "rollout.group_size=2", "rollout.max_new_tokens=4", "logging.progress=false",
                             "logging.plots=false", "logging.tensorboard=false", f"logging.out_dir={tmp_path}"])
    pipeline.run_bench(cfg, log=said.append)
    assert "the first a warm-up left out of the medians" in said[0]
    assert said[1].startswith("[fastgrpo] bench: step 1/2 (warm-up) in ") and said[2].startswith("[fastgrpo] bench: step 2/2 in ")


def test_ray_and_worker_library_lines_go_to_the_run_log(tmp_path, restore_loggers, capsys):
    """issue 34: Ray's token-authentication line (the driver, at ray.init) and vLLM's warnings in
    an async run's rollout workers (Ray's log_to_driver printed them, NUMA lines among them) reached
    the console. Ray's logger is quieted like the other libraries', and a worker quiets its own
    into the same <run>/log.txt (AsyncTrainer hands it the folder)."""
    pytest.importorskip("ray")
    from ray._private.authentication import authentication_token_setup as auth

    from fastgrpo.config import load_config
    from fastgrpo.logs import console
    from fastgrpo.trainer.async_trainer import build_worker_engine

    path = quiet_console(str(tmp_path))
    assert console.QUIETED == str(tmp_path)
    logging.getLogger("ray").handlers.clear()  # what ray.init(configure_logging=False) does first
    auth._warn_token_auth_enabled()  # then Ray's own warning, as ray.init calls it
    logging.getLogger("vllm").handlers = []  # a fresh worker process: nothing quieted yet
    cfg = load_config(None, ["rollout.engine=torch", "rollout.worker_threads=1"])
    engine, kind = build_worker_engine(cfg, quiet_dir=str(tmp_path))
    assert kind == "torch"
    logging.getLogger("vllm.v1.worker.cpu_worker").warning("Node 0 is not in available memory nodes [1].")
    for h in logging.getLogger("vllm").handlers + logging.getLogger("ray").handlers:
        h.flush()
    text = open(path).read()
    assert "Token authentication is enabled" in text and "available memory nodes" in text
    captured = capsys.readouterr()
    assert "Token authentication" not in captured.err + captured.out
    assert "memory nodes" not in captured.err + captured.out
