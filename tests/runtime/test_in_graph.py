"""Compression inside compiled graphs (issue 39): ``daf.wrap(torch.compile(model))`` runs the compiled module
under hooks that AOTAutograd inlines (``daf.runtime.in_graph``); the other order is in tests/test_compile.py. ``aot_eager`` is AOTAutograd as inductor
gets it, without building C++: a tiny block compiles in about a second."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import daf
from daf.config import Config
from daf.runtime.in_graph import in_graph_hooks


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)


def _x() -> torch.Tensor:
    return torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(0))


def _saved_by_graphs(loss: torch.Tensor) -> int:
    """Bytes the compiled functions behind ``loss`` hold for backward (their packed saves included)."""
    seen, total, nodes = set(), 0, [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in type(node).__name__:
            total += sum(t.nbytes for t in node.saved_tensors)
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return total


def _step(model: nn.Module, params: nn.Module) -> tuple[int, torch.Tensor]:
    loss = model(_x()).square().mean()
    saved = _saved_by_graphs(loss)
    return saved, torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(params.parameters()))])


def test_a_compiled_block_saves_8_bit_codes_inside_its_graph():
    torch._dynamo.reset()
    plain = _block()
    raw, expected = _step(torch.compile(plain, backend="aot_eager"), plain)
    torch._dynamo.reset()
    counters.clear()
    with pytest.warns(UserWarning, match="^DAF: this model is compiled with torch.compile: inside its graphs DAF "
                                         "stores the policy's codes.*nearest rounding instead of stochastic"):
        model = daf.wrap(torch.compile(_block(), backend="aot_eager"), bits=8, min_numel=1024)
    packed, got = [_step(model, model) for _ in range(2)][-1]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert raw / packed > 2  # 2.17: fused attention's q and k stay raw (2.2 when they were 8-bit codes)
    assert float(nn.functional.cosine_similarity(got, expected, dim=0)) > 0.999


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                         nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def test_relu_outputs_keep_their_sign_bits_so_backward_masks_stay_exact():
    """Codes alone round small positives to 0 and ReLU's backward drops their gradient: cosine 0.982 on a
    ResNet-18 at 8 bits; with the sign bits 0.99999 (docs/integrations.md)."""
    x = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    grads, held = [], []
    for wrapped in (False, True):
        torch._dynamo.reset()
        model = _cnn()
        compiled = torch.compile(model, backend="aot_eager")
        if wrapped:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled = daf.wrap(compiled, bits=8, min_numel=1024)
        loss = compiled(x).logsumexp(1).mean()
        held.append(_saved_by_graphs(loss))
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))]).double())
    # here codes alone give 0.999985 and 3.4x (saves only ReLU's backward reads cost 8 bits, not 1)
    assert float(nn.functional.cosine_similarity(*grads, dim=0)) > 0.999999
    assert held[0] / held[1] > 3.8


def test_the_default_policy_gives_a_cnns_feature_maps_2_bits_in_the_graph_and_the_report_says_what_stays_raw():
    torch._dynamo.reset()
    x = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    plain = _cnn()
    raw = _saved_by_graphs(torch.compile(plain, backend="aot_eager")(x).logsumexp(1).mean())
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = daf.wrap(torch.compile(_cnn(), backend="aot_eager"), min_numel=1024)
    packed = _saved_by_graphs(model(x).logsumexp(1).mean())
    rows = daf.report(model).rows
    by_why = {}
    for row in rows:
        by_why.setdefault(row.why, []).append(row)
    assert {row.bits for row in by_why["in graph: feature map"]} == {2}
    assert {row.source for row in by_why["in graph: feature map"]} == {"convolution"}
    nonzeros = [row for why, rows in by_why.items() if "nonzeros at 4 bits" in why for row in rows]
    assert {(row.source, row.bits) for row in nonzeros} == {("relu", 4)}  # ReLU outputs the next conv reads
    assert [row.kind for row in by_why["in graph: ReLU's sign bits only, exact"]] == ["mask"]
    assert all(row.kind == "raw" for row in by_why["in graph, raw: fewer than min_numel elements"])  # BN statistics
    assert sum(row.raw_bytes for row in rows) / sum(row.stored_bytes for row in rows) > 4
    assert raw / packed > 4  # what the graph holds, parameters and inputs included
    assert daf.report(model).sections["compiled graphs"] == {"graphs": 1, "saves": len(rows), "raw": 9,  # + pooled
                                                             "rounding": "nearest", "groups": "min/max"}


def test_a_compiled_child_packs_in_its_graph_and_the_eager_rest_goes_through_the_session():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), _block())
    plain_raw = _step(model, model)[0]
    assert plain_raw == 0  # eager: no compiled function holds anything
    model[2] = torch.compile(model[2], backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        daf.wrap(model, bits=8, min_numel=1024)
    packed, _ = _step(model, model)
    torch._dynamo.reset()
    unwrapped = nn.Sequential(nn.Linear(64, 64), nn.GELU(), torch.compile(_block(), backend="aot_eager"))
    assert 0 < packed < _step(unwrapped, unwrapped)[0] / 1.9  # fused attention's q and k raw
    sites = {row.site.split("#")[0].split("/")[0] for row in daf.report(model).rows}
    assert sites == {"0", "1", "graph0"}  # the linear and GELU through the session; the graph's saves


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "channels_last"])
def test_the_hooks_run_eagerly_too_and_keep_the_saved_layout(layout):
    x = torch.randn(8, 16, 12, 10)
    x = {"contiguous": x, "transposed": x.transpose(1, 3),
         "channels_last": x.to(memory_format=torch.channels_last)}[layout]
    hooks = in_graph_hooks(Config(bits=8, min_numel=1))
    packed = hooks.pack_hook(x)
    back = hooks.unpack_hook(packed)
    assert back.shape == x.shape and back.stride() == x.stride()
    assert float((back - x).abs().max()) <= float(x.max() - x.min()) / 255  # one 8-bit step of the range
    assert packed[:2] == ("codes", 8)  # eagerly nobody says who reads the save
    assert packed[2].dtype == torch.uint8 and packed[2].nbytes < x.nbytes / 3


@pytest.mark.parametrize("first", [False, True])
def test_a_boolean_save_is_1_bit_and_comes_back_exact(first):
    mask = torch.rand(8, 64, 33, generator=torch.Generator().manual_seed(0)) > 0.1
    mask.view(-1)[0] = first
    mask = mask.transpose(1, 2)
    hooks = in_graph_hooks(Config(min_numel=1))
    packed = hooks.pack_hook(mask)
    back = hooks.unpack_hook(packed)
    assert packed[0] == "mask" and packed[2].nbytes == -(-mask.numel() // 8)
    assert torch.equal(back, mask) and back.stride() == mask.stride()


def test_the_hooks_keep_small_integer_and_overlapping_saves_as_they_are():
    hooks = in_graph_hooks(Config(min_numel=64))
    for kept in (torch.randn(63), torch.arange(100), torch.randn(1, 100).expand(10, 100)):
        assert hooks.pack_hook(kept) is kept and hooks.unpack_hook(kept) is kept


def test_a_module_compiled_and_run_before_wrap_packs_once_wrapped():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
    compiled = torch.compile(model, backend="aot_eager")
    x = _x().flatten(0, 1)
    raw = _saved_by_graphs(compiled(x).square().mean())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        daf.wrap(compiled, min_numel=1024)
    assert _saved_by_graphs(compiled(x).square().mean()) < raw / 2.5  # dynamo compiled it again under the hooks


def test_eager_attentions_values_get_the_sensitive_width_in_a_graph_as_in_eager():
    from tests.runtime.remakes.test_table import EagerAttention

    torch._dynamo.reset()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = daf.wrap(torch.compile(EagerAttention(), backend="aot_eager"), min_numel=1024)
    model(torch.randn(4, 32, 64)).square().mean().backward()
    values = [row for row in daf.report(model).rows if "other operand of softmax's probabilities" in row.why]
    rows = [(r.site, r.why) for r in daf.report(model).rows]
    assert len(values) == 1 and values[0].bits == daf.Auto().sensitive_bits, rows


class MaskedAttention(nn.Module):
    """Fused attention under an additive causal mask made in the graph (-inf above the diagonal), as
    Hugging Face's sdpa models build it: the mask is a save of the graph, read by attention's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        mask = torch.where(causal, 0.0, float("-inf")).expand(x.shape[0], 1, -1, -1) + x[:, None, :, :1] * 0
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(1)


def test_an_additive_mask_with_minus_inf_stays_raw_and_the_gradient_is_kept():
    """SmolLM2 compiled with DAF at 8 bits had gradient cosine -0.002: its causal mask (-inf where masked) was
    coded, and codes cannot hold -inf. Fused attention's attn_mask stays raw, as its q and k do."""
    torch.manual_seed(0)
    x = torch.randn(4, 64, 32)
    grads = []
    for wrapped in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MaskedAttention()
        run = torch.compile(daf.wrap(model, bits=8, rounding="nearest", min_numel=256, audit=daf.Audit(every=0))
                            if wrapped else model, backend="aot_eager")
        run(x).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        if wrapped:
            rows = [row for row in daf.report(model).rows if "mask" in row.why and "-inf" in row.why]
            assert rows and all(row.kind == "raw" for row in rows)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.999


@pytest.mark.slow
def test_through_inductor_the_default_keeps_a_conv_bn_relu_nets_gradient_and_relu_masks_exact():
    """Through inductor (about 15 s): its partitioner saves each batch norm's input and recomputes ``relu(bn(x))``
    and ReLU's mask ``le(., 0)`` from it in backward. At 2-bit codes of that input the mask flipped near 0 (this
    net's gradient cosine 0.978, the last norm's bias 0.967, where eager DAF's is exact); such saves now get
    ``sensitive_bits``, the ReLU outputs the next conv reads are their nonzeros' codes, and the report says so."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
            self.c2, self.b2 = nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
            self.fc = nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.b1(self.c1(x)))
            return self.fc(torch.relu(self.b2(self.c2(x))).mean((2, 3)))

    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    plain = Net()
    nn.functional.cross_entropy(plain(x), y).backward()
    model = copy.deepcopy(plain)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn.functional.cross_entropy(torch.compile(daf.wrap(model, audit=daf.Audit(every=0)))(x), y).backward()
    rows = daf.report(model).rows
    daf.unwrap(model)
    assert any("compares values recomputed" in row.why and row.bits == 8 for row in rows)
    assert any("nonzeros at 4 bits" in row.why for row in rows)
    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))

    # b2's bias gradient reads nothing coded but the last ReLU's recomputed mask: 0.967 when it flipped
    assert cosine(model.b2.bias.grad, plain.b2.bias.grad) > 0.999
    assert cosine(torch.cat([p.grad.flatten() for p in model.parameters()]),
                  torch.cat([p.grad.flatten() for p in plain.parameters()])) > 0.995
