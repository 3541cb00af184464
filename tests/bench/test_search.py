"""daf.bench without training: the batch search, the methods, per-block recomputation, the table."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from daf import Adaptive, Config, Outliers
from daf.bench.memory import format_table
from daf.bench.methods import WORKLOAD_BITS, checkpoint_blocks, methods_for, workload_config
from daf.bench.search import SearchResult, largest_fitting


class Probe:
    """A probe that fits up to ``threshold`` and uses ``base + per_item * batch`` bytes (or no peak)."""

    def __init__(self, threshold, base=100.0, per_item=1.0, peaks=True):
        self.threshold, self.base, self.per_item, self.peaks = threshold, base, per_item, peaks
        self.calls = []

    def __call__(self, batch):
        self.calls.append(batch)
        return batch <= self.threshold, (self.base + self.per_item * batch) if self.peaks else None


def _check(found, probe, start, resolution, limit):
    assert isinstance(found, SearchResult)
    assert [b for b, _ in found.probes] == probe.calls
    assert all(ok == (b <= probe.threshold) for b, ok in found.probes)
    assert len(set(probe.calls)) == len(probe.calls), "a batch probed twice"
    assert all(b >= 1 for b in probe.calls) and all(b <= max(start, limit) for b in probe.calls)
    fitting = [b for b, ok in found.probes if ok]
    failing = [b for b, ok in found.probes if not ok]
    assert found.batch == max(fitting, default=0)
    assert found.failed_at == min(failing, default=None)
    assert found.batch <= probe.threshold
    if found.failed_at is None:  # growth stopped at the limit
        assert probe.threshold >= limit and found.batch == max(start, limit)
    else:
        assert found.failed_at > probe.threshold
        if found.batch == 0:  # nothing fits: halved all the way down to 1
            assert probe.threshold < 1 and found.failed_at == 1
        else:
            assert found.failed_at - found.batch <= max(1, int(found.batch * resolution))


@pytest.mark.parametrize("threshold", [1, 2, 15, 16, 17, 31, 32, 33, 100, 291, 300, 1000, 4095, 50_000])
@pytest.mark.parametrize("resolution", [0.01, 0.1, 0.25, 0.5])
def test_finds_the_threshold_within_the_resolution(threshold, resolution):
    probe = Probe(threshold, base=100, per_item=1)
    found = largest_fitting(probe, start=16, cap=100 + threshold + 0.5, resolution=resolution)
    _check(found, probe, 16, resolution, 1 << 16)


@settings(max_examples=300, deadline=None)
@given(threshold=st.integers(0, 70_000), start=st.integers(1, 5000), resolution=st.floats(0.001, 0.999),
       limit=st.integers(1, 1 << 16), base=st.floats(0, 1e6), per_item=st.floats(-10, 1e4),
       peaks=st.booleans(), cap=st.floats(1, 1e9))
def test_search_against_the_true_threshold(threshold, start, resolution, limit, base, per_item, peaks, cap):
    """Whatever the peaks say (even a cap they contradict, or peaks that shrink), the answer is right."""
    probe = Probe(threshold, base, per_item, peaks)
    found = largest_fitting(probe, start=start, cap=cap, resolution=resolution, limit=limit)
    _check(found, probe, start, resolution, limit)


@settings(max_examples=100, deadline=None)
@given(threshold=st.integers(1, 20_000), start=st.integers(1, 64), resolution=st.sampled_from([0.05, 0.1, 0.25]))
def test_accurate_peaks_take_few_probes(threshold, start, resolution):
    """With peaks on a straight line and the cap where the threshold is, the growth aims at it."""
    probe = Probe(threshold, base=500, per_item=3)
    found = largest_fitting(probe, start=start, cap=500 + 3 * threshold + 1, resolution=resolution)
    _check(found, probe, start, resolution, 1 << 16)
    assert len(probe.calls) <= 14  # doubling alone would take up to 20


def test_start_that_does_not_fit_halves():
    probe = Probe(threshold=5)
    found = largest_fitting(probe, start=64, cap=1000, resolution=0.1)
    assert probe.calls[:5] == [64, 32, 16, 8, 4]
    assert (found.batch, found.failed_at) == (5, 6)


def test_nothing_fits():
    probe = Probe(threshold=0)
    found = largest_fitting(probe, start=10, cap=1000)
    assert probe.calls == [10, 5, 2, 1]
    assert (found.batch, found.failed_at) == (0, 1)


def test_growth_stops_at_the_limit():
    probe = Probe(threshold=10**9, peaks=False)
    found = largest_fitting(probe, start=3, cap=1e12, limit=100)
    assert probe.calls == [3, 6, 12, 24, 48, 96, 100]
    assert (found.batch, found.failed_at) == (100, None)


def test_without_peaks_growth_doubles():
    probe = Probe(threshold=1000, peaks=False)
    largest_fitting(probe, start=16, cap=1e9, resolution=0.1)
    assert probe.calls[:7] == [16, 32, 64, 128, 256, 512, 1024]


def test_docstring_example():
    found = largest_fitting(lambda b: (b <= 300, 100 + b), start=16, cap=400, resolution=0.1)
    assert (found.batch, found.failed_at) == (291, 320)


@pytest.mark.parametrize("start, resolution", [(0, 0.1), (-4, 0.1), (16, 0.0), (16, 1.0), (16, -0.1), (16, 1.5)])
def test_invalid_arguments(start, resolution):
    probe = Probe(threshold=100)
    with pytest.raises(ValueError, match="start must be >= 1 and resolution in"):
        largest_fitting(probe, start=start, cap=1000, resolution=resolution)
    assert probe.calls == []


# --- methods ---------------------------------------------------------------------------------------

CAP = 3 << 30


@pytest.mark.parametrize("workload", sorted(WORKLOAD_BITS))
def test_quick_keeps_three(workload):
    bits = WORKLOAD_BITS[workload]
    quick = methods_for(workload, CAP, quick=True)
    assert [m.name for m in quick] == ["fp32 (system malloc)", "fp32", f"DAF {bits}-bit"]
    assert quick[0].allocator == "system" and quick[0].daf is None
    assert quick[1].allocator == "auto" and quick[1].daf is None
    assert quick[2].daf == workload_config(workload) and quick[2].daf.bits == bits


@pytest.mark.parametrize("workload", sorted(WORKLOAD_BITS))
def test_every_method(workload):
    bits = WORKLOAD_BITS[workload]
    methods = methods_for(workload, CAP)
    names = [m.name for m in methods]
    assert len(names) == len(set(names))
    assert {"fp32 (system malloc)", "fp32", "checkpoint", "compile budget 0.5", f"DAF {bits}-bit",
            f"DAF {bits}-bit + checkpoint", f"DAF {bits}-bit budget"} <= set(names)
    by_name = {m.name: m for m in methods}
    assert by_name["checkpoint"].checkpoint and by_name["checkpoint"].daf is None
    assert by_name["compile budget 0.5"].compile and by_name["compile budget 0.5"].compile_budget == 0.5
    assert by_name["compile"].compile and by_name["compile"].compile_budget is None and by_name["compile"].daf is None
    compiled = by_name[f"DAF {bits}-bit compiled"]  # torch.compile(daf.wrap(model)): no recomputation budget
    assert compiled.compile and compiled.compile_budget is None and compiled.daf == workload_config(workload)
    assert by_name["fp32 decommit"].decommit and by_name["fp32 decommit"].daf is None
    decommit = by_name[f"DAF {bits}-bit decommit"]
    assert decommit.decommit and decommit.daf == workload_config(workload).replace(decommit=True)
    assert [m.name for m in methods if m.decommit] == ["fp32 decommit", f"DAF {bits}-bit decommit"]
    assert by_name[f"DAF {bits}-bit + checkpoint"].checkpoint and by_name[f"DAF {bits}-bit + checkpoint"].daf
    for method in methods:
        assert set(method.to_dict()) == {"name", "daf", "checkpoint", "compile", "compile_budget", "allocator",
                                         "decommit", "notes"}
        if method.daf is not None:
            assert method.daf.bits == bits or isinstance(method.daf.policy, Adaptive)  # an average, no width
            assert method.to_dict()["daf"] == method.daf.to_dict()


def test_smollm_runs_at_the_bits_that_keep_its_loss_and_without_adaptive():
    assert workload_config("smollm-lora") == Config(bits=4, codec=Outliers())
    assert workload_config("resnet18-fmnist") == Config(bits=2)
    assert not any("adaptive" in m.name for m in methods_for("smollm-lora", CAP))
    adaptive = [m for m in methods_for("resnet18-fmnist", CAP) if "adaptive" in m.name]
    assert len(adaptive) == 1 and adaptive[0].daf == Config(policy=Adaptive(average=2.0))


@pytest.mark.parametrize("cap", [600 << 20, 3 << 30, 1000])
def test_budget_method_gets_an_eighth_of_the_cap(cap):
    [budget] = [m for m in methods_for("resnet18-fmnist", cap) if m.name.endswith("budget")]
    assert budget.daf == Config(bits=2, budget=cap // 8)


def test_unknown_workload_gets_2_bits():
    assert "DAF 2-bit" in [m.name for m in methods_for("something-else", CAP)]


# --- checkpoint_blocks ---------------------------------------------------------------------------

def _resnet_pair():
    from daf.workloads.resnet import ResNet18
    torch.manual_seed(0)
    model = ResNet18(num_classes=10, in_channels=1, width=8)
    return model, copy.deepcopy(model)


def _step(model, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def test_checkpointed_resnet_gives_the_same_loss_and_gradients():
    plain, checkpointed = _resnet_pair()
    assert checkpoint_blocks(checkpointed) == 8  # two BasicBlocks in each of the four layers
    x, y = torch.randn(4, 1, 16, 16), torch.randint(0, 10, (4,))
    assert torch.allclose(_step(plain, x, y), _step(checkpointed, x, y))
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_checkpointing_saves_less_for_backward():
    plain, checkpointed = _resnet_pair()
    checkpoint_blocks(checkpointed)
    x = torch.randn(4, 1, 16, 16)

    def saved_bytes(model):
        total = 0

        def pack(tensor):
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
        return total

    assert saved_bytes(checkpointed) < saved_bytes(plain) / 2


def test_checkpointed_blocks_run_plainly_without_grad():
    plain, checkpointed = _resnet_pair()
    checkpoint_blocks(checkpointed)
    plain.eval(), checkpointed.eval()
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        assert torch.equal(plain(x), checkpointed(x))


@pytest.mark.xfail(strict=True, reason="src bug (daf.bench.methods.checkpoint_blocks): the recomputation in "
                                      "backward runs each block's BatchNorm in training mode again, so running "
                                      "statistics are updated twice per step (num_batches_tracked 2, not 1): the "
                                      "'checkpoint' methods train a different model state than fp32")
def test_checkpointing_leaves_batchnorm_statistics_as_without():
    plain, checkpointed = _resnet_pair()
    checkpoint_blocks(checkpointed)
    x, y = torch.randn(4, 1, 16, 16), torch.randint(0, 10, (4,))
    _step(plain, x, y), _step(checkpointed, x, y)
    for (name, a), (_, b) in zip(plain.state_dict().items(), checkpointed.state_dict().items()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6), name


def test_block_lists_of_other_shapes():
    class Layered(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
            self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # leaves only: not blocks

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    model = Layered()
    reference = copy.deepcopy(model)
    assert checkpoint_blocks(model) == 3
    x = torch.randn(5, 8, requires_grad=True)
    model(x).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    reference(x).sum().backward()
    assert torch.allclose(grad, x.grad)
    assert checkpoint_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == 0


# --- the table -----------------------------------------------------------------------------------

def _row(name, largest, peak=None, at_start=None):
    return {"method": {"name": name}, "largest_batch": largest, "failed_at": None, "peak_rss_bytes": peak,
            "at_start": at_start, "probes": []}


def test_format_table():
    mib = 1 << 20
    bench = {"workload": "tiny-mnist", "start": 128, "methods": [
        _row("fp32 (system malloc)", 100, 500 * mib, {"step_ms": 12.4, "peak_rss_bytes": 300 * mib}),
        _row("fp32", 200, 510 * mib, {"step_ms": 11.0, "peak_rss_bytes": 250 * mib}),
        _row("DAF 2-bit", 800, 590 * mib, None),
    ]}
    text = format_table(bench)
    lines = text.splitlines()
    assert len(lines) == 5 and set(lines[1]) <= {"-", " "}
    for column in ("method", "largest batch", "x fp32 (system)", "x fp32", "peak RSS MiB", "step ms @128",
                   "peak RSS MiB @128"):
        assert column in lines[0]
    assert lines[2].startswith("fp32 (system malloc)") and lines[3].startswith("fp32 ")
    assert lines[4].startswith("DAF 2-bit")
    assert lines[2].split()[-6:] == ["100", "1.00", "0.50", "500", "12", "300"]
    assert lines[3].split()[-6:] == ["200", "2.00", "1.00", "510", "11", "250"]
    assert lines[4].split()[-6:] == ["800", "8.00", "4.00", "590", "-", "-"]
    assert len({len(line) for line in lines}) == 1 or all(len(line) <= len(lines[1]) for line in lines)


def test_format_table_without_baselines():
    text = format_table({"workload": "w", "start": 16, "methods": [_row("DAF 2-bit", 40), _row("other", 0)]})
    rows = text.splitlines()[2:]
    assert rows[0].split()[-6:] == ["40", "-", "-", "-", "-", "-"]
    assert rows[1].split()[-6:] == ["0", "-", "-", "-", "-", "-"]


def test_minilm_runs_the_config_that_keeps_its_accuracy():
    # docs/results.md: 2-bit MinMax codes lose 4.5 points; these floors and codec keep it within 1
    assert workload_config("minilm-tweets") == Config(
        bits=2, codec=Outliers(derivatives=True),
        floors={"layer_norm": 4, "scaled_dot_product_attention": 4, "linear": 4})
