"""Hard-to-easy sparsity schedule: values at given steps, validation, state, plot."""

import math

import pytest

from vsa2_rl.config import ConfigError, SparsityConfig
from vsa2_rl.rl.schedule import SparsitySchedule, plot_schedule


def _schedule(num_steps=100, **settings):
    return SparsitySchedule.from_config(SparsityConfig(**settings), num_steps)


def test_constant_schedule_rollout_equals_train_eval_lower():
    schedule = _schedule(train=0.9, eval=0.75)
    for step in (0, 1, 1000):
        levels = schedule(step)
        assert levels.rollout == levels.train == 0.9
        assert levels.eval == 0.75


def test_linear_warmup_from_dense():
    schedule = _schedule(train=0.9, eval=0.5, warmup_steps=10, warmup_shape="linear")
    assert schedule(0).train == 0.0  # dense
    assert schedule(5).train == pytest.approx(0.45)
    assert schedule(9).train == pytest.approx(0.81)
    assert schedule(10).train == schedule(50).train == 0.9
    assert schedule(3).eval == 0.5


def test_cosine_warmup_anneals_density_and_is_the_configs_default():
    assert SparsityConfig().warmup_shape == "cosine"  # one default: the config's
    schedule = _schedule(train=0.8, eval=0.5, warmup_steps=8)
    for step in (0, 2, 4, 6):
        density = 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * step / 8))
        assert schedule(step).train == pytest.approx(1 - density)
        assert schedule(step).rollout == schedule(step).train
    assert schedule(8).train == 0.8


def test_curriculum_after_warmup_hard_to_easy():
    schedule = _schedule(
        14, train=0.95, train_end=0.85, warmup_steps=4, warmup_shape="linear", eval=0.75
    )
    assert schedule.curriculum_steps == 10  # the steps after the warm-up
    assert schedule(2).train == pytest.approx(0.95 / 2)  # warm-up towards the start value
    assert schedule(4).train == pytest.approx(0.95)
    assert schedule(9).train == pytest.approx(0.90)
    assert schedule(14).train == pytest.approx(0.85)
    assert schedule(100).train == pytest.approx(0.85)


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"train": 1.0}, "sparsity.train"),
        ({"eval": -0.1}, "sparsity.eval"),
        ({"train": 0.7, "eval": 0.8}, "sparsity.eval"),
        ({"warmup_steps": -1}, "sparsity.warmup_steps"),
        ({"warmup_shape": "step"}, "sparsity.warmup_shape"),
        ({"train_end": 0.6, "eval": 0.7}, "sparsity.train_end"),
        ({"train_end": 1.2}, "sparsity.train_end"),
    ],
)
def test_the_config_validates_the_settings_naming_the_key(settings, key):
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        _schedule(**settings)


def test_bad_steps_are_refused():
    with pytest.raises(ValueError, match="num_steps"):
        _schedule(0)
    with pytest.raises(ValueError, match="step"):
        _schedule()(-1)


def test_state_dict_roundtrip_and_rejected_state_keeps_settings():
    source = _schedule(25, train=0.95, train_end=0.9, warmup_steps=5, eval=0.8)
    target = _schedule()
    target.load_state_dict(source.state_dict())
    assert [target(s) for s in range(40)] == [source(s) for s in range(40)]
    before = target.state_dict()
    with pytest.raises(ValueError, match=r"sparsity\.eval"):
        target.load_state_dict({**before, "eval": 0.99})
    with pytest.raises(ValueError, match="curriculum_steps=0"):
        target.load_state_dict({**before, "curriculum_steps": 0})
    assert target.state_dict() == before
    with pytest.raises(ValueError, match="unknown"):
        target.load_state_dict({"sparsity": 0.5})


def test_state_of_a_checkpoint_before_the_config_held_it_loads():
    """Checkpoints written while the schedule had fields of its own resume on the same curve."""
    old = {
        "train_sparsity": 0.95,
        "eval_sparsity": 0.8,
        "warmup_steps": 5,
        "warmup_shape": "cosine",
        "train_sparsity_end": 0.9,
        "curriculum_steps": 20,
        "curriculum_shape": "linear",
        "allow_eval_above_train": False,
    }
    target = _schedule()
    target.load_state_dict(old)
    expected = _schedule(25, train=0.95, train_end=0.9, warmup_steps=5, eval=0.8)
    assert [target(s) for s in range(40)] == [expected(s) for s in range(40)]
    with pytest.raises(ValueError, match="not one a run config gives"):
        target.load_state_dict({**old, "curriculum_shape": "cosine"})


def test_from_run_config():
    config = SparsityConfig(train=0.9, train_end=0.8, eval=0.7, warmup_steps=10)
    schedule = SparsitySchedule.from_config(config, num_steps=30)
    assert schedule(0).train == 0.0
    assert schedule(10).train == pytest.approx(0.9)
    assert schedule(20).train == pytest.approx(0.85)
    assert schedule(30).train == pytest.approx(0.8)
    assert schedule(30).eval == 0.7


def test_plot_schedule_draws_the_schedule_into_a_png(tmp_path, monkeypatch):
    """The saved figure's curves are the schedule's closed form: a linear warm-up from dense to
    0.9 over 5 steps, then 0.9; eval 0.75 throughout; the warm-up shaded."""
    from matplotlib.figure import Figure

    saved = []
    savefig = Figure.savefig

    def recording_savefig(figure, *args, **kwargs):
        saved.append(figure)
        return savefig(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    schedule = _schedule(train=0.9, eval=0.75, warmup_steps=5, warmup_shape="linear")
    path = tmp_path / "schedule.png"
    plot_schedule(schedule, 20, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    ((axes,),) = [figure.axes for figure in saved]
    train, evaluation = axes.get_lines()
    steps = list(range(20))
    assert list(train.get_xdata()) == steps and list(evaluation.get_xdata()) == steps
    assert list(train.get_ydata()) == pytest.approx([0.9 * min(s / 5, 1.0) for s in steps])
    assert list(evaluation.get_ydata()) == pytest.approx([0.75] * 20)
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert legend == ["rollout = train", "eval", "dense warm-up"]
    (warmup,) = axes.patches
    corners = warmup.get_path().transformed(warmup.get_patch_transform()).vertices
    assert (corners[:, 0].min(), corners[:, 0].max()) == pytest.approx((0, 5))  # data x
