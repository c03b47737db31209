"""The walk varies every scheduler option, and runs production's settings in a third of its episodes
(runtime/check/options.py, specs/checker.md §11.1 "Options").

A bug behind an option the walk never varies is invisible to the checker, so: every ``init`` field
of ``SchedulerConfig`` takes at least two values over the episodes of a few seeds; and the options
``generate`` sets beyond a mode's own and the model's sizes (read from ``scheduler_setup`` itself,
so a new production setting fails this test until the walk draws it) hold in at least a third of
all episodes, aimed ones included.
"""

from __future__ import annotations

import random

import attrs
import pytest

from fxsched.core.config import SchedulerConfig
from fxsched.runtime.check.options import is_production
from fxsched.runtime.check.walk import episode_seed, random_episode

pytest.importorskip("torch")

from fxsched.runtime.generate import SPECS, scheduler_setup  # noqa: E402
from fxsched.runtime.torch_model.config import default_config  # noqa: E402

EPISODES = 3000
MODE_FIELDS = {"use_speculative", "dflash", "num_drafts", "ngram_speculative", "self_speculative"}
"""Set by the drafting mode (``generate --spec``), drawn by the walk's MODES."""
SIZED_TO_THE_MODEL = {"eos_ids", "max_batch_size", "max_seq_len", "admission_watermark"}
"""Production sets these from the model's config; the walk draws its own, scaled to its tiny scripts."""


def _episodes():
    return [random_episode(random.Random(episode_seed(seed, i))) for seed in (1, 2, 3)
            for i in range(EPISODES // 3)]


@pytest.fixture(scope="module")
def episodes():
    return _episodes()


def test_every_scheduler_option_takes_two_values_in_the_walk(episodes):
    seen: dict[str, set] = {f.name: set() for f in attrs.fields(SchedulerConfig) if f.init}
    for episode in episodes:
        config = episode.config()
        for name, values in seen.items():
            values.add(getattr(config, name))
    never = sorted(name for name, values in seen.items() if len(values) < 2)
    assert not never, f"scheduler options the walk never varies: {never}"


def _production() -> dict[str, object]:
    """The options generate sets for every mode beyond the mode's own and the model's sizes."""
    default = SchedulerConfig()
    settings: dict[str, object] = {}
    for spec in SPECS:
        try:
            config, _, _ = scheduler_setup(default_config(), spec, 2)
        except Exception:  # a mode the default model cannot run (no drafter of that kind)
            continue
        for f in attrs.fields(SchedulerConfig):
            if not f.init or f.name in MODE_FIELDS or f.name in SIZED_TO_THE_MODEL:
                continue
            value = getattr(config, f.name)
            if value != getattr(default, f.name):
                settings[f.name] = value
    return settings


def _runs_production(episode, settings) -> bool:
    config = episode.config()
    for name, value in settings.items():
        mine = getattr(config, name)
        if isinstance(value, bool) and mine != value:
            return False
        if not isinstance(value, bool) and isinstance(value, int) and value > 0 and mine <= 0:
            return False  # a size production turns on (a prefill chunk): on, at the walk's scale
    return True


def test_production_settings_run_in_a_third_of_the_episodes(episodes):
    settings = _production()
    assert settings.get("prefill_new_together") is True and settings.get("max_prefill_tokens"), settings
    share = sum(_runs_production(e, settings) for e in episodes) / len(episodes)
    assert share >= 1 / 3, f"production's settings {settings} in only {share:.0%} of the walk's episodes"
    marked = sum(is_production(e) for e in episodes) / len(episodes)
    assert marked >= 1 / 3 and all(_runs_production(e, settings) for e in episodes if is_production(e))
