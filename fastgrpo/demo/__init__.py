"""fastgrpo.demo: the embedded default run (`run_default`), its arithmetic task and tiny models."""


def run_default(out_dir=None, overrides=()):
    from .default import run_default as _run

    return _run(out_dir, overrides)
