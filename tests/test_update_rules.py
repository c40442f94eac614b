"""The update-rule seam: ``rl.algorithm`` picks a class from vsa2_rl.config.UPDATE_RULES that
follows vsa2_rl.rl.update.UpdateRule; a new algorithm is a module plus a registry entry."""

import importlib
from types import SimpleNamespace

import pytest
import torch

from vsa2_rl.config import ALGORITHMS, UPDATE_RULES
from vsa2_rl.rl import update as update_module
from vsa2_rl.rl.update import UpdateRule, build_update_rule, check_rollouts

MEMBERS = [name for name in dir(UpdateRule) if not name.startswith("_")] + ["requires"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_names_a_class_with_the_protocols_members(algorithm):
    module, _, name = UPDATE_RULES[algorithm].partition(":")
    rule = getattr(importlib.import_module(module), name)
    missing = [member for member in MEMBERS if not hasattr(rule, member)]
    assert missing == []
    assert set(rule.requires) <= {"latents", "log_probs", "kl_penalty"}


class Recorder:
    """A third rule, as a user would write it (this module, registered by the test)."""

    requires = ("latents",)

    def __init__(self, config):
        self.config = config

    @classmethod
    def from_config(cls, policy, sampler, config):
        return cls(config)


def test_a_registry_entry_is_all_a_new_rule_needs(monkeypatch):
    monkeypatch.setitem(update_module.UPDATE_RULES, "recorder", "test_update_rules:Recorder")
    config = SimpleNamespace(rl=SimpleNamespace(algorithm="recorder"))
    rule = build_update_rule(None, None, config)
    assert isinstance(rule, Recorder) and rule.config is config


def test_rollouts_without_a_field_the_rule_reads_are_refused():
    rule = SimpleNamespace(requires=("latents", "log_probs"))
    chunk = SimpleNamespace(latents=torch.zeros(2, 1), log_probs=None)
    with pytest.raises(ValueError, match="log_probs, which the rollout phase left empty"):
        check_rollouts(rule, SimpleNamespace(chunks=[chunk]))
    chunk.log_probs = torch.zeros(1, 1)
    check_rollouts(rule, SimpleNamespace(chunks=[chunk]))
