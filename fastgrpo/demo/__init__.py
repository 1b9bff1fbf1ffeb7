"""fastgrpo.demo: the embedded default run (`run_default`, its config in default.py) and its tool
variant (`run_default(demo="tools")`, tools.py). Its task is fastgrpo.tasks.arithmetic and its
model fastgrpo.models.tiny."""


def run_default(out_dir=None, overrides=(), demo="default"):
    from fastgrpo.demo.default import run_default as _run

    return _run(out_dir, overrides, demo)
