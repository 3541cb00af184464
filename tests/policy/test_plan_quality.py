"""Plans that keep the gradients (issue 13): every gradient the caller asks for is costed, so no lossy
width is free, and a plan is never truly worse than uniform bits of the same (or fewer) bytes."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import daf
from daf.policy.importance import ImportanceEstimator
from tests.runtime.differential_models import ModelSpec, build

# A chain whose saved tensors (tanh outputs) reach no parameter gradient, only the input's: the
# estimator costed them 0 at every width, and at an average of 8 the plan gave them 1 bit and kept
# the linear's input raw (mean 7.2 bits, estimated variance 0; input gradient cosine 0.96).
TANH_CHAIN = (("act", "tanh"),) * 4 + (("linear", False),)
BLOCKS = [("linear", True), ("linear", False), ("act", "tanh"), ("act", "gelu"), ("act", "sigmoid"),
          ("act", "softmax"), ("act", "relu"), ("norm", "layer", 1), ("square",), ("gate",),
          ("mlp", 2, "gelu", True), ("attention", 2, "eager", False, 0.0, True, "default")]


def _spec(blocks, seed=0, channels=32):
    return ModelSpec(batch=4, height=4, width=4, channels=channels, dtype="float32", blocks=blocks, seed=seed)


def _gradients(spec, config=None, steps=3):
    """All gradients (parameters and input) after ``steps`` steps on one batch; the policy if wrapped."""
    model = build(spec)
    if config is not None:
        daf.wrap(model, config)
    generator = torch.Generator().manual_seed(spec.seed + 1)
    x = torch.randn(spec.batch, spec.tokens, spec.channels, generator=generator)
    target = torch.randn(x.shape, generator=generator)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        (model(leaf) * target).sum().backward()
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None] + [leaf.grad.flatten()]
    policy = daf.session_of(model).policy if config is not None else None
    if config is not None:
        daf.unwrap(model)
    return torch.cat(grads).double(), policy


def _error(config, spec, reference, seeds=3):
    """Mean squared gradient error relative to ``||reference||**2``, over stochastic-rounding seeds."""
    errors = []
    for seed in range(seeds):
        g, _ = _gradients(spec, daf.Config(min_numel=1, seed=seed, **config))
        errors.append(float((g - reference).square().sum() / reference.square().sum()))
    return sum(errors) / len(errors)


def test_a_site_that_reaches_only_the_input_gradient_is_costed():
    _, policy = _gradients(_spec(TANH_CHAIN), daf.Config(min_numel=1, policy=daf.Adaptive(average=8.0,
                                                                                          replan_every=1)))
    tanh_sites = [s for s in policy.estimator.sites if not s.startswith("blocks.4")]
    assert tanh_sites
    for site in tanh_sites:
        costs = policy.estimator.costs(site)
        assert costs is not None and all(cost > 0 for cost in costs.values()), (site, costs)


def test_average_8_on_a_chain_into_the_input_plans_8_bits_everywhere():
    _, policy = _gradients(_spec(TANH_CHAIN, channels=8), daf.Config(min_numel=1, policy=daf.Adaptive(
        average=8.0, replan_every=1, window=1)))
    assert set(policy.plan.bits.values()) == {8}
    assert policy.plan.cost > 0


def test_an_input_that_needs_no_gradient_adds_no_cost():
    # The same chain on an input without grad: the tanh outputs reach no gradient at all, so 0 is right.
    model = build(_spec(TANH_CHAIN))
    daf.wrap(model, min_numel=1, policy=daf.Adaptive(average=2.0, replan_every=1))
    for _ in range(2):
        model(torch.randn(4, 16, 32)).square().sum().backward()
    estimator = daf.session_of(model).policy.estimator
    assert all(estimator.sites[s].weight == 0 for s in estimator.sites if not s.startswith("blocks.4"))


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(blocks=st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_a_plan_is_never_truly_worse_than_uniform_bits_of_no_more_bytes(blocks, seed):
    spec = _spec(tuple(blocks) + (("linear", False),), seed)
    reference, _ = _gradients(spec)
    uniform = {bits: _error(dict(bits=bits), spec, reference) for bits in (4, 8)}
    for average, bits in ((4.0, 4), (6.0, 4), (8.0, 8)):
        config = dict(policy=daf.Adaptive(average=average, replan_every=100))
        _, policy = _gradients(spec, daf.Config(min_numel=1, **config))
        # no lossy width is free: the plan's estimated variance is 0 only where every site is kept raw
        lossy = [s for s, b in policy.plan.bits.items() if b <= 8]
        assert all(policy.estimator.costs(s)[policy.plan.bits[s]] > 0 for s in lossy), policy.plan
        # the measured error after the plan is not worse than that of uniform bits of no more bytes
        adaptive = _error(config, spec, reference)
        assert adaptive <= 1.5 * uniform[bits] + 1e-12, (average, adaptive, uniform[bits], policy.plan.bits)


def _policy_with_costs(average, weight):
    from daf.policy import AdaptivePolicy
    from daf.policy.importance import SiteStats
    policy = AdaptivePolicy(average, allow_raw=False)
    for i, numel in enumerate((4096, 8192, 1024)):
        policy.estimator.sites[f"s{i}"] = SiteStats(numel=numel, elements=numel, weight=weight * (i + 1), steps=1,
                                                    variance=torch.tensor([1.0, 0.1, 0.005, 2e-5], dtype=torch.float64))
    return policy


def test_without_estimates_to_plan_on_the_plan_is_uniform_and_says_so():
    for average, bits in ((2.0, 2), (6.0, 4), (8.0, 8)):
        policy = _policy_with_costs(average, weight=0.0)
        plan = policy.replan()
        assert set(plan.bits.values()) == {bits}
        assert policy.summary()["uniform_fallback"].startswith(f"uniform {bits} bits")


def test_a_plan_backed_by_estimates_stands_and_the_summary_says_no_fallback():
    policy = _policy_with_costs(6.0, weight=1.0)
    plan = policy.replan()
    assert policy.summary()["uniform_fallback"] is None and max(plan.bits.values()) == 8
