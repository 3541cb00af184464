"""The allocator: within budget always, optimal against brute force on small cases."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daf.policy.allocator import RAW_BITS, Site, allocate, variance_costs
from tests.policy.oracle import brute_force

CHOICES = (1, 2, 4, 8)


def _site(i, size, c, raw=False):
    return Site(f"s{i}", size, variance_costs(c, CHOICES, raw))


sites_strategy = st.lists(
    st.tuples(st.integers(1, 64).map(lambda k: 256 * k), st.floats(0.0, 1e3), st.booleans()),
    min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(sites_strategy, st.sampled_from([1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0]))
def test_matches_brute_force_and_meets_the_budget(spec, average):
    sites = [_site(i, size, c, raw) for i, (size, c, raw) in enumerate(spec)]
    plan = allocate(sites, average)
    best = brute_force(sites, average)
    assert plan.exact
    assert plan.mean_bits <= average
    total = sum(s.size for s in sites)
    assert sum(s.size * plan.bits[s.name] for s in sites) / total <= average
    assert math.isclose(plan.cost, best.cost, rel_tol=1e-9, abs_tol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.dictionaries(st.sampled_from([1, 2, 3, 4, 8, 32]),
                                                                   st.floats(0, 100), min_size=1)),
                min_size=1, max_size=4),
       st.floats(1.0, 8.0))
def test_arbitrary_cost_tables_and_sizes(spec, average):
    sites = [Site(f"s{i}", size, costs) for i, (size, costs) in enumerate(spec)]
    try:
        best = brute_force(sites, average)
    except ValueError:
        with pytest.raises(ValueError, match="cheapest"):
            allocate(sites, average)
        return
    plan = allocate(sites, average)
    assert plan.mean_bits <= average
    assert math.isclose(plan.cost, best.cost, rel_tol=1e-9, abs_tol=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 16).map(lambda k: 256 * k), st.integers(0, 48).map(lambda k: 256 * k),
                          st.floats(0.0, 1e3)), min_size=1, max_size=5),
       st.sampled_from([1.0, 1.5, 2.0, 3.0]))
def test_sites_storing_part_of_their_elements(spec, average):
    """A site that needs codes for ``size`` of its ``elements`` (a ReLU output's nonzeros) buys bits
    per stored element but counts all its elements in the average."""
    sites = [Site(f"s{i}", size, variance_costs(c, CHOICES), size + extra) for i, (size, extra, c) in enumerate(spec)]
    plan = allocate(sites, average)
    best = brute_force(sites, average)
    assert plan.exact and math.isclose(plan.cost, best.cost, rel_tol=1e-9, abs_tol=1e-12)
    assert sum(s.size * plan.bits[s.name] for s in sites) <= average * sum(s.elements for s in sites)
    assert math.isclose(plan.mean_bits, sum(s.size * plan.bits[s.name] for s in sites)
                        / sum(s.elements for s in sites))


def test_a_half_empty_site_gets_twice_the_bits():
    dense, sparse = _site(0, 4096, 1.0), Site("s1", 2048, variance_costs(1.0, CHOICES), 4096)
    assert allocate([dense, sparse], 2.0).bits == {"s0": 2, "s1": 4}


def test_large_problem_coarsens_but_stays_within_budget():
    sites = [_site(i, 256 * (1000 + 37 * i), 1.0 + (i % 7) ** 3, raw=True) for i in range(60)]
    plan = allocate(sites, 2.0, max_cells=1 << 12)
    assert not plan.exact and plan.unit > 256
    assert plan.mean_bits <= 2.0
    exact = allocate(sites, 2.0, max_cells=1 << 23)
    assert exact.exact and exact.cost <= plan.cost <= exact.cost * 1.25


def test_heterogeneous_sites_beat_uniform():
    sites = [_site(0, 1024, 1000.0), _site(1, 3072, 1.0)]
    plan = allocate(sites, 2.0)
    uniform = sum(s.costs[2] for s in sites)
    assert plan.bits == {"s0": 4, "s1": 1} and plan.cost < uniform


def test_raw_counts_at_its_bits():
    sites = [_site(0, 256, 50.0, raw=True), _site(1, 256 * 100, 1.0)]
    plan = allocate(sites, 2.5)
    assert plan.bits["s0"] == RAW_BITS and plan.mean_bits <= 2.5
    assert allocate(sites, 1.2).bits["s0"] != RAW_BITS  # 32 bits for s0 and 1 for s1 is 1.31 on average


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "2", True])
def test_bad_average(bad):
    with pytest.raises(ValueError, match="average"):
        allocate([_site(0, 256, 1.0)], bad)


def test_bad_sites():
    with pytest.raises(ValueError, match="size"):
        Site("a", 0, {2: 1.0})
    with pytest.raises(ValueError, match="elements"):
        Site("a", 512, {2: 1.0}, 256)
    with pytest.raises(ValueError, match="finite"):
        Site("a", 256, {2: float("inf")})
    with pytest.raises(ValueError, match="positive bit counts"):
        Site("a", 256, {0: 1.0})
    with pytest.raises(ValueError, match="distinct"):
        allocate([_site(0, 256, 1.0), _site(0, 512, 1.0)], 2.0)
    with pytest.raises(ValueError, match="cheapest"):
        allocate([Site("a", 256, {2: 1.0, 4: 0.0})], 1.5)
