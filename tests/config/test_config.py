"""Config loading: YAML + --set overrides map onto the dataclasses; unknown keys and invalid
values fail at load time naming the field."""
import pytest

from fastgrpo.config import TrainConfig, dump_config, load_config, parse_override


def test_defaults_load_and_validate():
    cfg = load_config()
    assert isinstance(cfg, TrainConfig)
    assert cfg.rollout.group_size == 8
    lc = cfg.algorithm.loss_config(cfg.rollout.temperature, cfg.rollout.max_new_tokens)
    assert lc.eps_high == cfg.algorithm.eps_high and lc.beta == cfg.algorithm.beta


def test_yaml_file_and_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("steps: 7\noptimizer: {lr: 1e-2, betas: [0.8, 0.9]}\nrollout: {engine: torch}\n")
    cfg = load_config(str(p), ["optimizer.lr=1e-3", "rollout.group_size=4", "algorithm.dual_clip_c=3",
                               "logging.tensorboard=false", "rewards.functions=[accuracy]", "rewards.weights=[2]"])
    assert cfg.steps == 7
    assert load_config(str(p)).optimizer.lr == 0.01  # YAML 1.1 reads 1e-2 as a string; taken as a float
    assert cfg.optimizer.lr == pytest.approx(1e-3) and cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.rollout.group_size == 4 and cfg.algorithm.dual_clip_c == 3.0
    assert cfg.logging.tensorboard is False and cfg.rewards.weights == [2.0]


def test_roundtrip_dump(tmp_path):
    cfg = load_config(None, ["steps=3", "algorithm.beta=0.04"])
    dump_config(cfg, str(tmp_path / "c.yaml"))
    assert load_config(str(tmp_path / "c.yaml")) == cfg


@pytest.mark.parametrize("override, field", [
    ("optimizer.lrr=1", "optimizer.lrr"),                  # unknown field
    ("nosuchsection.x=1", "nosuchsection"),                # unknown section
    ("rollout.group_size=1", "rollout.group_size"),        # G must be >= 2
    ("rollout.group_size=2.5", "rollout.group_size"),      # not an int
    ("rollout.engine=tensorrt", "rollout.engine"),         # bad choice
    ("optimizer.lr=-1", "optimizer.lr"),
    ("optimizer.betas=[0.9]", "optimizer.betas"),
    ("algorithm.eps_low=1.5", "eps_low"),                  # caught by LossConfig, section named
    ("algorithm.kl=k9", "algorithm.kl"),
    ("logging.tensorboard=maybe", "logging.tensorboard"),  # not a bool
    ("rewards.weights=[1.0]", "rewards.weights"),          # 2 functions, 1 weight
    ("rewards.functions=[accuracy, magic words]", "rewards.functions[1]"),
    ("eval.num_samples=4", "eval.temperature"),            # pass@k needs sampling
])
def test_invalid_values_name_the_field(override, field):
    with pytest.raises(ValueError) as e:
        load_config(None, [override] + (["rewards.functions=[accuracy, format]"] if "weights" in override else []))
    assert field in str(e.value)


def test_override_syntax_errors():
    with pytest.raises(ValueError, match="section.field=value"):
        parse_override("optimizer.lr")
    with pytest.raises(ValueError, match="config steps=.*expected an integer"):
        load_config(None, ["steps.x=1"])


def test_yaml_not_a_mapping(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="YAML mapping"):
        load_config(str(p))
