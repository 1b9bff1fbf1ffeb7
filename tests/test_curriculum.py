import json
import random

import numpy as np
import pytest

from fastgrpo.curriculum import Curriculum, dynamic_sampling, filter_best_of_n, filter_by_pass_rate, informative


def test_offline_filters():
    rewards = {"easy": [1.0] * 8, "mid": [1.0, 0.0] * 4, "hard": [0.0] * 8, "edge": [1.0] * 2 + [0.0] * 8}
    assert filter_by_pass_rate(rewards) == ["mid", "edge"]  # 0.5 and 0.2 are in [0.2, 0.8]
    assert filter_by_pass_rate(rewards, low=0.0, high=0.1) == ["hard"]
    assert filter_best_of_n({"a": [0.0] * 7 + [1.0], "b": [0.0] * 8, "c": [0.0] * 8 + [1.0]}, n=8) == ["b", "c"]
    with pytest.raises(ValueError, match="low"):
        filter_by_pass_rate(rewards, low=0.9, high=0.1)
    with pytest.raises(ValueError, match="at least n=8"):
        filter_best_of_n({"a": [0.0]}, n=8)


def test_pass_rate_counts_ema_and_pruning():
    c = Curriculum([0, 1, 2], ema_decay=0.5, min_attempts=4)
    assert c.pass_rate(0) == 0.5  # prior
    c.update([0, 0, 0, 0, 1, 1, 1, 1], [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, None, 0.0])
    assert c.pass_rate(0) == 1.0 and c.pass_rate(1) == pytest.approx(1 / 3)
    assert c.active_ids() == [1, 2]  # prompt 0 pruned (1.0 > 0.9 after 4 attempts)
    c.update([1, 1], [1.0, 1.0])
    assert c.pass_rate(1) == pytest.approx(0.5 * (1 / 3) + 0.5 * 1.0)
    with pytest.raises(ValueError, match="unknown id"):
        c.update([7], [1.0])


def test_sampling_weights_favour_hard_prompts():
    c = Curriculum(list(range(2)), prune_above=None)
    c.update([0] * 4 + [1] * 4, [1.0, 1.0, 1.0, 0.0] + [0.0] * 4)  # pass rates 0.75 and 0.0
    w = c.weights()
    assert w[1] / w[0] == pytest.approx(1.0 / 0.25)
    ids = c.sample(4000, np.random.default_rng(0))
    share = ids.count(1) / len(ids)
    assert 0.77 < share < 0.83  # expected 0.8
    assert c.sample(2, random.Random(1)) in ([0, 1], [1, 0])  # without replacement when possible
    assert c.sample(3, 5) == c.sample(3, 5)  # seeded
    uni = Curriculum([0, 1], weighting="uniform")
    assert list(uni.weights()) == [0.5, 0.5]


def test_dynamic_sampling_refills_and_is_bounded():
    stream = iter([[1, 1], [0, 1], [0, 0], [1, 0], [0.5, 0.5], [1, 0]] + [[1, 1]] * 100)
    calls = []

    def generate(k):  # a round: k groups' rewards
        calls.append(k)
        return [next(stream) for _ in range(k)]

    kept_of = lambda r: sum(informative(g) for g in r)  # noqa: E731
    res = dynamic_sampling(generate, 3, kept_of=kept_of)
    kept = [g for r in res.rounds for g in r if informative(g)]
    # the last round asks for what is missing; an oversized round is the caller's to trim
    assert kept == [[0, 1], [1, 0], [1, 0]]
    assert res.full and res.kept == 3 and res.seen == 6 and calls == [3, 2, 1]
    assert res.metrics()["curriculum/dynamic_drop_frac"] == 0.5
    bounded = dynamic_sampling(lambda k: [[1, 1]] * k, 4, kept_of=kept_of, max_tries=3)
    assert not bounded.full and bounded.tries == 3 and bounded.kept == 0
    assert bounded.metrics()["curriculum/dynamic_drop_frac"] == 1.0


def test_dynamic_sampling_agrees_across_ranks():
    """`agree` (a sum over ranks) decides how many rounds run: here a peer rank kept 2 groups per
    round, so one local informative group per round fills 6 after two rounds on every rank."""
    calls = []

    def generate(k):
        calls.append(k)
        return [[0, 1]]

    res = dynamic_sampling(generate, 6, kept_of=len, agree=lambda n: 3 * n)
    assert res.tries == 2 and res.full and calls == [6, 3] and res.kept == 6
    with pytest.raises(ValueError, match="max_tries"):
        dynamic_sampling(generate, 2, kept_of=len, max_tries=0)


def test_informative_ignores_unverifiable():
    assert informative([0, 1]) and not informative([1, 1]) and not informative([None, 1])
    assert informative([None, 0.0, 1.0]) and not informative([0.5, 0.5 + 1e-12])


def test_histogram_and_checkpoint_roundtrip():
    c = Curriculum(["a", "b", "c", "d"], min_attempts=2)
    c.update(["a", "a", "b", "b", "c", "c"], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    h = c.histogram(bins=10)
    assert h["curriculum/pass_rate_hist/0.0-0.1"] == pytest.approx(1 / 3)
    assert h["curriculum/pass_rate_hist/0.9-1.0"] == pytest.approx(1 / 3)
    assert h["curriculum/seen_frac"] == 0.75 and h["curriculum/pruned_frac"] == 0.25
    state = json.loads(json.dumps(c.state_dict()))
    d = Curriculum(["a", "b", "c", "d"], min_attempts=2)
    d.load_state_dict(state)
    assert d.active_ids() == c.active_ids() and d.pass_rate("b") == c.pass_rate("b")
    assert d.sample(3, 11) == c.sample(3, 11)
    with pytest.raises(ValueError, match="prompt ids differ"):
        Curriculum(["x"]).load_state_dict(state)


def test_bad_arguments():
    with pytest.raises(ValueError, match="prompt_ids"):
        Curriculum([])
    with pytest.raises(ValueError, match="weighting"):
        Curriculum([1], weighting="hardest")
    with pytest.raises(ValueError, match="batch_size"):
        Curriculum([1]).sample(0)
    c = Curriculum([1], min_attempts=1)
    c.update([1], [1.0])
    with pytest.raises(ValueError, match="pruned"):
        c.sample(1)


def _weights_from_stats(c, ids):
    """The weights recomputed from every prompt's pass rate (what `weights` did before it kept
    them in arrays updated per prompt)."""
    if c.weighting == "uniform":
        w = np.ones(len(ids))
    else:
        w = np.maximum(np.array([1.0 - c.pass_rate(p) for p in ids], dtype=np.float64), c.min_weight)
    return w / w.sum()


def test_incremental_weights_match_a_full_recomputation_bit_for_bit():
    rng = np.random.default_rng(3)
    c = Curriculum(list(range(50)), prune_above=0.7, min_attempts=4, min_weight=0.1)
    twin = Curriculum(list(range(50)), prune_above=0.7, min_attempts=4, min_weight=0.1)
    for step in range(30):
        ids = [int(i) for i in rng.integers(0, 50, 8) for _ in range(4)]
        rewards = [float(x) for x in rng.random(len(ids)) < 0.6]
        c.update(ids, rewards)
        active = [p for p in c.prompt_ids if not c._stats[p].pruned]
        assert c.active_ids() == active
        assert np.array_equal(c.weights(), _weights_from_stats(c, active))  # identical bits: same draws
        g1, g2 = np.random.default_rng(step), np.random.default_rng(step)
        want = [active[i] for i in g2.choice(len(active), size=5, replace=False, p=_weights_from_stats(c, active))]
        assert c.sample(5, g1) == want
        if step == 10:
            c.min_weight = 0.3  # a changed floor moves every weight
        if step == 20:
            twin.load_state_dict(json.loads(json.dumps(c.state_dict())))
            twin.min_weight = c.min_weight
            assert twin.active_ids() == c.active_ids() and np.array_equal(twin.weights(), c.weights())
            assert twin.histogram() == c.histogram()
    assert len(c.active_ids()) < 50  # some prompts were retired along the way
    seen = [c.pass_rate(p) for p in c.prompt_ids if c._stats[p].ema is not None]
    h = c.histogram()
    counts, _ = np.histogram(seen, bins=10, range=(0.0, 1.0))
    assert [h[k] for k in h if "/pass_rate_hist/" in k] == list(counts / len(seen))
    assert h["curriculum/pass_rate_mean"] == float(np.mean(seen))
    assert h["curriculum/pruned_frac"] == (50 - len(c.active_ids())) / 50
    assert np.array_equal(c.weights([3, 1]), _weights_from_stats(c, [3, 1]))


def test_histogram_counts_equal_numpy_histogram_at_bin_edges():
    # ema_decay=0: the pass rate is the last group's, k/10 — on or next to every bin edge
    # (3/10 = 0.3 lies below linspace's 0.30000000000000004, so it belongs to bin 0.2-0.3)
    c = Curriculum(list(range(11)), ema_decay=0.0, prune_above=None)
    c.update([k for k in range(11) for _ in range(10)], [float(j < k) for k in range(11) for j in range(10)])
    rates = [c.pass_rate(k) for k in range(11)]
    assert rates == [k / 10 for k in range(11)]
    counts, _ = np.histogram(rates, bins=10, range=(0.0, 1.0))
    h = c.histogram()
    assert [h[k] for k in h if "/pass_rate_hist/" in k] == list(counts / 11)
    assert h["curriculum/pass_rate_hist/0.2-0.3"] == 2 / 11 and h["curriculum/pass_rate_hist/0.9-1.0"] == 2 / 11
    h5 = c.histogram(bins=5, prefix="x")
    assert [h5[k] for k in h5 if "/pass_rate_hist/" in k] == list(np.histogram(rates, bins=5, range=(0.0, 1.0))[0] / 11)
