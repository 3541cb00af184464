"""Policy config types: each handled by the factory registered for it; users can add their own."""

import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import daf
from daf.config import register_config_type
from daf.policy import AdaptivePolicy, Policy, UniformPolicy, make_policy, register_policy


@dataclass(frozen=True)
class EveryOther:
    """A user's policy config: ``bits`` at every other compressed tensor, raw in between."""

    bits: int = 4


class EveryOtherPolicy(Policy):
    def __init__(self, bits: int) -> None:
        self.bits, self.calls = bits, 0

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        self.calls += 1
        return self.bits if self.calls % 2 else 0


@register_policy(EveryOther)
def _every_other(config: daf.Config) -> Policy:
    return EveryOtherPolicy(config.policy.bits)


def test_builtin_types_dispatch_to_their_policies():
    assert isinstance(make_policy(daf.Config(bits=4)), UniformPolicy) and make_policy(daf.Config(bits=4)).bits == 4
    assert isinstance(make_policy(daf.Config(policy=daf.Adaptive(average=1.5))), AdaptivePolicy)


def test_a_registered_policy_runs_in_a_wrapped_model_and_round_trips():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    daf.wrap(model, policy=EveryOther(bits=8), min_numel=1)
    model(torch.randn(128, 64)).sum().backward()
    kinds = [row.kind for row in daf.report(model).rows]
    assert "compressed" in kinds and kinds.count("raw") >= 2
    config = daf.session_of(model).config
    data = json.loads(json.dumps(config.to_dict()))
    assert data["policy"] == {"kind": "everyother", "bits": 8}
    assert daf.Config.from_dict(data) == config


def test_a_config_type_without_a_factory_is_a_clear_error():
    @dataclass(frozen=True)
    class Orphan:
        pass

    register_config_type("policy", Orphan, kind="orphan-for-test")
    with pytest.raises(ValueError, match="no policy is registered for Config.policy of type Orphan; "
                                         r"register a factory with @daf.policy.register_policy\(Orphan\)"):
        make_policy(daf.Config(policy=Orphan()))


def test_an_unregistered_type_is_refused_by_config():
    @dataclass(frozen=True)
    class Unknown:
        pass

    with pytest.raises(ValueError, match=r"Config.policy must be one of daf.Auto\(...\), daf.Uniform\(\), daf.Adaptive\(...\), .*"
                                         r"others by daf.policy.register_policy\), got .*Unknown\(\)"):
        daf.Config(policy=Unknown())


def test_registration_refuses_what_config_could_not_hold():
    class NotADataclass:
        pass

    @dataclass
    class Mutable:
        bits: int = 2

    for cls in (NotADataclass, Mutable):
        with pytest.raises(ValueError, match="must be a frozen dataclass"):
            register_policy(cls)(_every_other)

    @dataclass(frozen=True)
    class Uniform:  # same kind name as daf.Uniform, another class
        pass

    with pytest.raises(ValueError, match="policy kind 'uniform' is already taken by daf.Uniform; pass another kind="):
        register_policy(Uniform)(_every_other)
    with pytest.raises(ValueError, match="registered for one of \\('policy', 'codec'\\)"):
        register_config_type("rounding", EveryOther)
