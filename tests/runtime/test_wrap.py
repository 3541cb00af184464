"""wrap / unwrap / compress / report: what a user of the public API relies on."""

import math
import copy
import gc

import pytest
import torch
from torch import nn

import daf
from tests.models import SmallCNN, TransformerBlock


def test_wrap_returns_the_same_module_and_keeps_its_weights():
    model = SmallCNN()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert daf.wrap(model) is model and type(model) is SmallCNN
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert daf.unwrap(model) is model


def test_training_forward_compresses_and_report_has_sites():
    model = daf.wrap(SmallCNN(), bits=2)
    model(torch.randn(8, 3, 16, 16)).sum().backward()
    report = daf.report(model)
    kinds = {r.kind for r in report.rows}
    assert {"compressed", "mask"} <= kinds  # ReLU's own saves are exact 1-bit masks (Config.masks)
    masks = [r for r in report.rows if r.kind == "mask"]
    assert all(r.bits == 1 and r.stored_bytes <= math.prod(r.shape) * 4 / 30 for r in masks)
    # a ReLU output saved by the next op too is stored twice (its mask, that op's codes), counted once as raw
    assert any(r.raw_bytes == 0 for r in masks if r.source == "ReluBackward0")
    compressed = [r for r in report.rows if r.kind == "compressed"]
    assert all(r.bits == 2 and r.stored_bytes < r.raw_bytes / 10 for r in compressed)
    assert any(r.site.startswith("bn1#") for r in compressed)
    assert "activations:" in str(report) and "bn1#0" in str(report)
    # the input batch has no autograd history: kept raw
    assert [r.kind for r in report.rows if r.site == "stem#0"] == ["raw"]
    assert report.totals()["raw_bytes"] == report.raw_bytes


def test_raw_bytes_count_each_saved_tensor_once():
    torch.manual_seed(0)
    model, x = SmallCNN(), torch.randn(8, 3, 16, 16)
    seen: dict[tuple, int] = {}
    keep = []  # hold every saved tensor so that no address is reused within the forward

    def pack(t):
        if not (t.requires_grad and t.is_leaf):
            seen[(t.data_ptr(), t.shape, t.stride())] = t.numel() * t.element_size()
        keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    daf.wrap(model, bits=2, min_numel=1)
    model(x).sum().backward()
    report = daf.report(model)
    parameters = {p.data_ptr() for p in [*model.parameters(), *model.buffers()]}
    expected = sum(n for key, n in seen.items() if key[0] not in parameters)
    assert report.raw_bytes == expected


def test_a_tensor_kept_raw_counts_once_however_many_views_of_it_are_saved():
    """Rotary embeddings' cos is saved by every layer's multiply through a view made in that layer:
    autograd holds one tensor, and the report counts one."""
    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            cos = torch.linspace(0, 1, 16)  # no history: kept raw
            for layer in self.layers:
                x = layer(x) * cos.unsqueeze(0)
            return x

    model = daf.wrap(Rotary(), bits=4, min_numel=1)
    model(torch.randn(4, 16)).sum().backward()
    raw = [r for r in daf.report(model).rows if r.kind == "raw" and r.shape == (1, 16)]
    assert len(raw) == 3 and sorted(r.stored_bytes for r in raw) == [0, 0, 64]
    assert sorted(r.raw_bytes for r in raw) == [0, 0, 64]


@pytest.mark.parametrize("context", ["eval", "no_grad", "inference_mode"])
def test_nothing_changes_outside_training_with_grad(context):
    torch.manual_seed(0)
    plain = SmallCNN()
    model = daf.wrap(copy.deepcopy(plain))
    x = torch.randn(4, 3, 16, 16)
    outputs = []
    for m in (plain, model):
        if context == "eval":
            m.eval()
            outputs.append(m(x))
        elif context == "no_grad":
            with torch.no_grad():
                outputs.append(m(x))
        else:
            with torch.inference_mode():
                outputs.append(m(x))
    assert torch.equal(outputs[0], outputs[1])
    assert daf.report(model).rows == [] and daf.session_of(model).forwards == 0


def test_unwrap_stops_compression_and_errors_are_clear():
    model = daf.wrap(nn.Sequential(nn.Linear(64, 64), nn.ReLU()), min_numel=1)
    with pytest.raises(ValueError, match="already wrapped"):
        daf.wrap(model)
    daf.unwrap(model)
    with pytest.raises(ValueError, match="not wrapped"):
        daf.unwrap(model)
    with pytest.raises(ValueError, match="not wrapped"):
        daf.report(model)
    with pytest.raises(ValueError, match="torch.nn.Module"):
        daf.wrap(lambda x: x)
    with pytest.raises(ValueError, match="Config.bits"):
        daf.wrap(nn.Linear(2, 2), bits=7)
    with pytest.raises(ValueError, match="daf.Config"):
        daf.wrap(nn.Linear(2, 2), config={"bits": 2})


def test_parameters_buffers_and_integer_tensors_are_never_compressed():
    embedding = nn.Embedding(100, 64)
    model = daf.wrap(nn.Sequential(embedding, nn.Linear(64, 64)), min_numel=1)
    tokens = torch.randint(0, 100, (32, 16))
    model(tokens).sum().backward()
    report = daf.report(model)
    assert report.parameters_referenced >= 1
    assert all(r.dtype.startswith("float") for r in report.rows if r.kind == "compressed")
    assert any(r.dtype == "int64" and r.kind == "raw" for r in report.rows)
    assert embedding.weight.grad is not None


def test_frozen_parameters_are_referenced_not_copied():
    base = nn.Linear(64, 64)
    base.weight.requires_grad_(False)
    model = daf.wrap(nn.Sequential(base, nn.Tanh(), nn.Linear(64, 64)), min_numel=1)
    model(torch.randn(32, 64, requires_grad=True)).sum().backward()
    stored_shapes = [r.shape for r in daf.report(model).rows if r.kind == "compressed"]
    assert (64, 64) not in stored_shapes


def test_tensor_saved_by_two_ops_is_stored_once():
    model = daf.wrap(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)), min_numel=1, masks=False)
    model(torch.randn(32, 64)).sum().backward()
    rows = daf.report(model).rows
    relu_out = [r for r in rows if r.shape == (32, 256) and r.source == "ReluBackward0"]
    assert sorted(r.kind for r in relu_out) == ["compressed", "shared"]
    assert sum(r.raw_bytes for r in relu_out) == 32 * 256 * 4


def test_relu_output_is_a_mask_for_relu_and_values_for_the_next_op():
    model = daf.wrap(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)), bits=2, min_numel=1,
                     audit=daf.Audit(every=0))
    model(torch.randn(32, 64)).sum().backward()
    rows = daf.report(model).rows
    relu_out = [r for r in rows if r.shape == (32, 256) and r.source == "ReluBackward0"]
    assert sorted((r.kind, r.bits) for r in relu_out) == [("compressed", 2), ("mask", 1)]
    assert [r.stored_bytes for r in relu_out if r.kind == "mask"] == [32 * 256 // 8]


def test_records_are_released_when_the_graph_is_freed():
    model = daf.wrap(SmallCNN())
    store = daf.session_of(model).store
    loss = model(torch.randn(4, 3, 16, 16)).sum()
    assert len(store) > 0
    loss.backward()
    del loss
    gc.collect()
    assert len(store) == 0 and store.stats()["bytes_in_use"] == 0


def test_compress_context_with_backward_after_the_block():
    block = TransformerBlock()
    x = torch.randn(4, 16, 64)
    with daf.compress(block, bits=8) as session:
        loss = block(x).square().mean()
    loss.backward()
    report = daf.report(session)
    assert report.ratio > 3 and any(r.site.startswith("fc1#") for r in report.rows)
    out = block(x)  # outside the block nothing is compressed
    assert out.grad_fn is not None


def test_compress_without_model_names_sites_by_order():
    w = torch.randn(128, 128, requires_grad=True)
    with daf.compress(min_numel=1) as session:
        loss = torch.tanh(torch.randn(64, 128) @ w).sum()
    loss.backward()
    assert [r.site for r in daf.report(session).rows][:2] == ["<root>#0", "<root>#1"]
