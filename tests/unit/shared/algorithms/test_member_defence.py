"""Member defences by name and their parameters, as the configuration check and the Main Server
build them (shared/algorithms/registry.py ``build_member_defences``)."""
from __future__ import annotations

import pytest

from shared.algorithms.group_loss import GroupLoss
from shared.algorithms.member_defence import ClipMembers, Standardise
from shared.algorithms.registry import MEMBER_DEFENCES, build_group_loss, build_member_defences
from shared.run_config import load_run_config


def test_defences_are_built_in_order_with_their_parameters():
    built = build_member_defences(["standardise", "clip"], {"clip": {"multiple": 1.5}}, build_group_loss("data_weighted"))
    assert [type(d) for d in built] == [Standardise, ClipMembers]
    assert built[1].params.multiple == 1.5 and built[0].params.ratio == 2.0


@pytest.mark.parametrize("names, params, message", [
    (["nope"], {}, "unknown member defence 'nope'; choose one of"),
    (["clip", "clip"], {}, "names a defence twice"),
    (["median", "trimmed_mean"], {}, "median and trimmed_mean each replace the members' mean"),
    (["clip"], {"median": {}}, "has parameters for ['median'], which grouping.member_defences does not name"),
    (["clip"], {"clip": {"multiple": -1}}, "grouping.member_defence_params.clip.multiple: must be greater than 0"),
    (["trimmed_mean"], {"trimmed_mean": {"cut": 1}}, "grouping.member_defence_params.trimmed_mean.cut: unknown key (valid keys: trim)"),
])
def test_what_does_not_fit_is_refused_in_one_line(names, params, message):
    with pytest.raises(ValueError) as refused:
        build_member_defences(names, params, build_group_loss("data_weighted"))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_group_loss_that_cannot_weigh_its_members_runs_only_defences_on_activations():
    class Opaque(GroupLoss):
        def objective(self, logits, member_labels, member_losses, member_shares):
            raise AssertionError("not called")

    assert build_member_defences(["standardise"], {}, Opaque())
    with pytest.raises(ValueError, match="cannot weigh"):
        build_member_defences(["median"], {}, Opaque())


def test_every_registered_defence_builds_with_its_defaults():
    for name in MEMBER_DEFENCES:
        assert build_member_defences([name], {}, build_group_loss("per_member"))


def test_the_run_configuration_checks_them_at_start():
    config = {"algorithm": "s2fl", "data": {"num_devices": 2, "max_samples": 100},
              "grouping": {"member_defences": ["standardise", "median"]}}
    assert load_run_config(config).grouping.member_defences == ["standardise", "median"]
    config["grouping"]["member_defences"] = ["mean"]
    with pytest.raises(ValueError, match="unknown member defence 'mean'"):
        load_run_config(config)
