"""Attention's probabilities on the math path (scaled_dot_product_attention with dropout on a CPU) are
remade in backward from the scores' two operands and the call's mask, not stored."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import daf
from daf.tracing import attention_map_of
from tests.models import node_named


def _qkv(dtype: torch.dtype = torch.float32, tokens: int = 24, keys: int = 24) -> list[torch.Tensor]:
    shapes = ((2, 3, tokens, 8), (2, 3, keys, 8), (2, 3, keys, 8))
    return [torch.randn(shape, dtype=dtype, requires_grad=True) for shape in shapes]


def _mask(kind: str | None, tokens: int, keys: int, dtype: torch.dtype) -> torch.Tensor | None:
    if kind == "float":  # BERT's: a large negative number on padding, broadcast over heads and queries
        mask = torch.zeros(2, 1, 1, keys, dtype=dtype)
        mask[0, ..., -3:] = torch.finfo(dtype).min
        return mask.expand(2, 1, tokens, keys)
    if kind == "bool":
        return torch.rand(2, 1, tokens, keys) > 0.3
    return None


def _probabilities(out: torch.Tensor) -> tuple[object, torch.Tensor]:
    node = node_named(out, "SafeSoftmaxBackward0")
    return node, node._saved_result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind,causal", [(None, False), ("float", False), ("bool", False), (None, True)])
def test_remade_from_the_forward_operands_bit_for_bit(mask_kind, causal, dtype) -> None:
    torch.manual_seed(0)
    q, k, v = _qkv(dtype, 24, 24 if causal else 20)
    mask = _mask(mask_kind, 24, k.shape[2], dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.3, is_causal=causal)
    node, saved = _probabilities(out)
    found = attention_map_of(saved, mask, causal)
    assert found is not None
    operands = [getattr(found.node, name) for name in found.attributes]
    assert torch.equal(found.function(*operands), saved)


def test_what_is_not_the_math_paths_probabilities() -> None:
    torch.manual_seed(0)
    q, k, v = _qkv()
    mask = _mask("float", 24, 24, torch.float32)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.3)
    _, saved = _probabilities(out)
    assert attention_map_of(saved, None, False) is None  # the call's mask must match what the graph added
    assert attention_map_of(q.softmax(-1), None, False) is None  # not a product's scores
    assert attention_map_of((q @ k.transpose(-1, -2)).softmax(-2), None, False) is None  # not the last dimension
    bias = torch.randn(1, 3, 24, 24, requires_grad=True)  # a learned position bias (T5): has history
    assert attention_map_of((q @ k.transpose(-1, -2) + bias).softmax(-1), bias.detach(), False) is None
    assert attention_map_of(F.scaled_dot_product_attention(q, k, v), None, False) is None  # the fused output


def _attention(config: daf.Config, mask: torch.Tensor | None = None, causal: bool = False,
               frozen_key: bool = False) -> tuple[torch.Tensor, daf.Report, list[torch.Tensor]]:
    torch.manual_seed(0)
    q, k, v = _qkv()
    key = k.detach() if frozen_key else k
    with daf.compress(config=config) as block:
        out = F.scaled_dot_product_attention(q * 1.0, key * 1.0, v * 1.0, attn_mask=mask, dropout_p=0.3,
                                             is_causal=causal)
    return out, block.report(), [q, k, v]


def test_stored_nothing_and_the_dropped_map_derived_from_it() -> None:
    out, report, _ = _attention(daf.Config(bits=4, min_numel=1), _mask("float", 24, 24, torch.float32))
    by_source = {(row.source, row.kind) for row in report.rows}
    assert ("SafeSoftmaxBackward0", "derived") in by_source
    assert not any(row.source == "SafeSoftmaxBackward0" and row.kind != "derived" for row in report.rows)
    dropped = [row for row in report.rows if row.kind == "derived" and row.source != "SafeSoftmaxBackward0"]
    assert len(dropped) == 1 and dropped[0].shape == (6, 24, 24) and dropped[0].stored_bytes == 0
    assert sum(row.stored_bytes for row in report.rows if row.shape == (2, 3, 24, 24) and row.kind != "mask") == 0


@pytest.mark.parametrize("mask_kind,causal", [(None, False), ("float", False), ("bool", False), (None, True)])
def test_backward_gets_the_softmax_of_the_decoded_operands(mask_kind, causal) -> None:
    torch.manual_seed(1)
    mask = _mask(mask_kind, 24, 24, torch.float32)
    out, _, _ = _attention(daf.Config(bits=4, min_numel=1), mask, causal)
    node, remade = _probabilities(out)
    product = node.next_functions[0][0]  # the scores, behind the bias's add and the product's view
    while type(product).__name__ != "BmmBackward0":
        product = product.next_functions[0][0]
    scores = (product._saved_self @ product._saved_mat2).view(remade.shape)  # decoded through DAF's unpack
    if causal:
        scores = scores.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), float("-inf"))
    elif mask_kind == "bool":
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    assert torch.allclose(remade, torch.ops.aten._safe_softmax(scores, -1), rtol=0, atol=1e-6)


def test_gradients_at_eight_bits_match_plain_autograd() -> None:
    mask = _mask("float", 24, 24, torch.float32)
    out, report, leaves = _attention(daf.Config(bits=8, min_numel=1), mask)  # seeds 0: the same dropout below
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(grad)
    got = [t.grad for t in leaves]
    assert any(row.kind == "derived" and row.source == "SafeSoftmaxBackward0" for row in report.rows)
    torch.manual_seed(0)
    q, k, v = _qkv()
    F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, attn_mask=mask, dropout_p=0.3).backward(grad)
    for mine, plain in zip(got, (q.grad, k.grad, v.grad)):
        assert F.cosine_similarity(mine.flatten(), plain.flatten(), dim=0) > 0.999


def _numpy_mask(tokens: int = 24) -> tuple[np.ndarray, torch.Tensor]:
    """A padding mask over a numpy buffer that a loader reuses for the next batch (torch.from_numpy:
    a write to the buffer changes the tensor and no version counter)."""
    buffer = np.random.default_rng(0).random((2, 1, tokens, tokens)) > 0.3
    return buffer, torch.from_numpy(buffer)


def _change(how: str, mask: torch.Tensor, buffer: np.ndarray | None) -> None:
    """What a program does to the mask between forward and backward: the next batch's padding."""
    if how == "numpy":
        buffer[...] = np.random.default_rng(1).random(buffer.shape) > 0.7
    elif how == "data":
        mask.data[..., -5:] = torch.finfo(mask.dtype).min  # no version change
    else:
        mask.add_(1.0)  # a version change


def _gradients_after_the_mask_changed(how: str, config: daf.Config | None, change: bool = True) -> list[torch.Tensor]:
    if how == "numpy":
        buffer, mask = _numpy_mask()
    else:
        buffer, mask = None, torch.randn(2, 1, 24, 24, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    q, k, v = _qkv()
    with daf.compress(config=config) if config is not None else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, attn_mask=mask, dropout_p=0.3)
    if change:
        _change(how, mask, buffer)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    return [q.grad, k.grad, v.grad]


@pytest.mark.parametrize("how", ["numpy", "data", "in_place"])
def test_a_mask_changed_after_forward_gives_plain_autograds_gradients(how) -> None:
    """The remake reads a copy of the mask taken in forward (issue 42: a numpy-backed mask rewritten for the
    next batch gave an 8-bit cosine of 0.60, one changed through .data 0.997, one changed in place raised)."""
    config = daf.Config(bits=8, min_numel=1)
    got = _gradients_after_the_mask_changed(how, config)
    unchanged = _gradients_after_the_mask_changed(how, config, change=False)
    plain = _gradients_after_the_mask_changed(how, None)
    for mine, same, theirs in zip(got, unchanged, plain):
        assert torch.equal(mine, same)  # the same codes, the same copy of the mask: the same gradient
        assert F.cosine_similarity(mine.flatten(), theirs.flatten(), dim=0) > 0.999


def _accumulated_in_one_graph(config: daf.Config | None) -> list[torch.Tensor]:
    """Two forwards over one mask buffer, refreshed in place for the second, then one backward over both."""
    torch.manual_seed(0)
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, 24, 24)
    losses = []
    for batch in range(2):
        mask.copy_(torch.randn(2, 1, 24, 24, generator=torch.Generator().manual_seed(10 + batch)))
        with daf.compress(config=config) if config is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, attn_mask=mask, dropout_p=0.3)
        losses.append((out * torch.randn(out.shape, generator=torch.Generator().manual_seed(batch))).sum())
    sum(losses).backward()
    return [q.grad, k.grad, v.grad]


def test_a_mask_buffer_refreshed_by_a_second_forward_before_one_backward_runs_as_plain_autograd() -> None:
    """Gradient accumulation in one graph (issue 42: raised 'attention mask ... modified in place')."""
    got = _accumulated_in_one_graph(daf.Config(bits=8, min_numel=1))
    plain = _accumulated_in_one_graph(None)
    for mine, theirs in zip(got, plain):
        assert F.cosine_similarity(mine.flatten(), theirs.flatten(), dim=0) > 0.999


def test_one_copy_of_an_equal_mask_serves_every_layer_and_a_broadcast_stays_small() -> None:
    from daf.runtime.snapshots import MaskCopies
    copies = MaskCopies()
    padding = torch.zeros(2, 1, 1, 24)
    mask = padding.expand(2, 1, 24, 24)
    first = copies.copy_of(mask)
    assert copies.copy_of(mask.clone()) is first and first.untyped_storage().nbytes() == 2 * 24 * 4
    padding.add_(1.0)  # an unequal mask: a copy of its own; the first copy keeps its values
    assert copies.copy_of(mask) is not first and bool((first == 0).all())


def test_coded_where_the_query_operand_is_not_saved() -> None:
    # a key without history (a frozen projection without adapters, BERT's layer 0): the product saves
    # no query operand, so there is nothing to remake the probabilities from
    _, report, _ = _attention(daf.Config(bits=4, min_numel=1), frozen_key=True)
    kinds = {row.kind for row in report.rows if row.source == "SafeSoftmaxBackward0"}
    assert kinds == {"compressed"}


def test_coded_where_the_operands_are_coarser_than_the_probabilities_keep() -> None:
    # probabilities keep 4 bits (the exponent guard); 2-bit operands would remake them coarser
    _, report, _ = _attention(daf.Config(bits=2, min_numel=1))
    rows = [row for row in report.rows if row.source == "SafeSoftmaxBackward0"]
    assert [(row.kind, row.bits) for row in rows] == [("compressed", 4)]


def test_background_packing_remakes_alike() -> None:
    mask = _mask("float", 24, 24, torch.float32)
    out, report, leaves = _attention(daf.Config(bits=8, min_numel=1, background=True), mask)
    out.sum().backward()
    assert any(row.kind == "derived" and row.source == "SafeSoftmaxBackward0" for row in report.rows)
    assert all(torch.isfinite(t.grad).all() for t in leaves)


def test_a_bert_with_dropout_remakes_every_layer_whose_key_has_history() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, attn_implementation="sdpa")
    model = daf.wrap(transformers.BertForSequenceClassification(config), daf.Config(bits=4, min_numel=64))
    model.train()  # attention dropout on: the math path
    ids = torch.randint(1, 100, (4, 16))
    attention = torch.ones(4, 16, dtype=torch.long)
    attention[0, 12:] = 0  # padding: a mask the remake must add
    model(input_ids=ids, attention_mask=attention, labels=torch.tensor([0, 1, 0, 1])).loss.backward()
    rows = [row for row in daf.report(model).rows if row.source == "SafeSoftmaxBackward0"]
    assert [row.kind for row in rows] == ["derived", "derived"] and all(row.stored_bytes == 0 for row in rows)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_remade_once_for_the_dropped_map_and_the_softmax() -> None:
    import daf.tracing.products as products

    calls = []
    with pytest.MonkeyPatch.context() as patch:
        original = products._attention_map
        patch.setattr(products, "_attention_map", lambda *a, **k: calls.append(1) or original(*a, **k))
        out, report, _ = _attention(daf.Config(bits=4, min_numel=1), _mask("float", 24, 24, torch.float32))
        out.sum().backward()
    assert any(row.kind == "derived" and row.source == "SafeSoftmaxBackward0" for row in report.rows)
    assert len(calls) == 1  # p @ v's dropped map and the softmax read the same remade probabilities
