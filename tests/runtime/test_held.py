"""Norm inputs held until the ReLU after the norm is known, then coded split by its mask
(``daf.runtime.held``); held inputs no ReLU claims coded plainly; gradients and bytes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf
from daf.codec.split import SplitPacked
from daf.runtime.held import norms_under_relu
from tests.runtime.remakes.test_blocks import Net


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _rows(model: nn.Module) -> dict[str, daf.report]:
    return {row.site: row for row in daf.report(model).rows}


def test_which_norms_a_relu_output_is_of():
    x, y = torch.randn(2, 4, 3, 3, requires_grad=True), torch.randn(2, 4, 3, 3, requires_grad=True)
    a = F.batch_norm(x, None, None, training=True)
    b = F.group_norm(y, 2)
    assert norms_under_relu(F.relu(a)) == [a.grad_fn]
    assert norms_under_relu(F.relu(a + b)) == [a.grad_fn, b.grad_fn]
    assert norms_under_relu(F.relu(a + y)) == [a.grad_fn]
    assert norms_under_relu(F.relu(x * 2)) == [] and norms_under_relu(F.silu(a)) == []
    assert norms_under_relu(F.relu(a * 2)) == []  # scaled: not the norm's output
    assert norms_under_relu(torch.relu(x)) == [] and norms_under_relu(F.relu(x.detach())) == []


def test_a_resnet_splits_each_norm_input_before_a_relu_and_remakes_the_conv_inputs():
    torch.manual_seed(0)
    model = daf.wrap(Net(), audit=daf.Audit(every=0), split_norm_inputs=True)
    _grads(model, *_batch())
    rows = _rows(model)
    split = [r for r in rows.values() if r.why.startswith("split by the ReLU mask")]
    # the stem's norm, two per block, and the downsampling shortcut's norm (split by the block's last ReLU)
    assert len(split) == 1 + 2 * 3 + 1 and all(r.bits == 2 and r.stored_bytes > 0 for r in split)  # the policy's width
    assert rows["blocks.1.short.1#0"].why == rows["blocks.1.bn2#0"].why  # one ReLU, two norms behind its add
    assert sum(r.kind == "derived" and r.why.startswith("norm_block: remade") for r in rows.values()) >= 6


def test_backward_reads_the_split_record_by_its_definition():
    """What the norm's backward gets: the conv output (held as 8-bit codes until its ReLU) as 4-bit codes where
    the ReLU mask passes (within half a step of 16 levels over the group's range, plus the 8-bit step), and
    the mean of each run of 256 others elsewhere (within the 8-bit step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    daf.wrap(model, audit=daf.Audit(every=0), split_norm_inputs=True)
    conv_out = []
    model[0].register_forward_hook(lambda module, args, out: conv_out.append(out.detach().clone()))
    codecs = daf.session_of(model).codecs
    decoded = []
    decode = codecs.decode_with_mask
    codecs.decode_with_mask = lambda *a, **k: decoded.append(decode(*a, **k)) or decoded[-1]
    out = model(torch.randn(4, 3, 16, 16))
    x, mask = conv_out[0], model[1](conv_out[0]) > 0  # the norm again on the same batch: the same statistics
    out.square().mean().backward()
    got = decoded[0]
    assert got.shape == x.shape
    flat_x, flat_got, flat_mask = x.reshape(-1), got.reshape(-1), mask.reshape(-1)
    held_step = max((flat_x[i:i + 256].max() - flat_x[i:i + 256].min()).item() for i in range(0, flat_x.numel(), 256)) / 255
    others = flat_x[~flat_mask]
    means = torch.stack([others[i:i + 256].mean() for i in range(0, others.numel(), 256)])
    assert (flat_got[~flat_mask] - means.repeat_interleave(256)[:others.numel()]).abs().max() <= held_step / 2 * 1.01
    kept = flat_x[flat_mask]
    widest = max((kept[i:i + 256].max() - kept[i:i + 256].min()).item() for i in range(0, kept.numel(), 256))
    assert (flat_got[flat_mask] - kept).abs().max() <= (widest / 15 / 2 + held_step) * 1.01


@pytest.mark.parametrize("setting", [{}, {"channels_last": True}])
def test_split_records_give_a_gradient_near_autograds(setting):
    torch.manual_seed(0)
    plain = Net()
    x, y = _batch()
    reference = _grads(plain, x, y)
    model = daf.wrap(copy.deepcopy(plain), audit=daf.Audit(every=0), split_norm_inputs=True, **setting)
    got = _grads(model, x, y)
    assert sum(r.why.startswith("split") for r in daf.report(model).rows) == 8
    assert F.cosine_similarity(got, reference, dim=0) > 0.95


def test_no_split_at_four_bits_or_more():
    """Where the policy gives the norm's input 4 bits or more, plain codes are finer than a split's means."""
    torch.manual_seed(0)
    model = daf.wrap(Net(), audit=daf.Audit(every=0), floors={"batch_norm": 4}, split_norm_inputs=True)
    _grads(model, *_batch())
    assert not any(r.why.startswith("split") for r in daf.report(model).rows)


def test_the_background_packer_and_the_calling_thread_give_the_same_gradient():
    torch.manual_seed(0)
    plain = Net()
    x, y = _batch()
    grads = [_grads(daf.wrap(copy.deepcopy(plain), audit=daf.Audit(every=0), split_norm_inputs=True, background=b), x, y)
             for b in (False, True)]
    assert torch.equal(grads[0], grads[1])


def test_split_records_spilled_under_a_budget_read_back_the_same():
    torch.manual_seed(0)
    plain = Net()
    x, y = _batch()
    split = {"audit": daf.Audit(every=0), "split_norm_inputs": True, "page_size": 4096}
    free = daf.wrap(copy.deepcopy(plain), **split)
    tight = daf.wrap(copy.deepcopy(plain), budget="8KiB", **split)  # min_bits 2: a split record counts as 2 bits
    assert torch.equal(_grads(free, x, y), _grads(tight, x, y))
    stats = daf.report(tight).sections["store"]
    assert stats["spills"] > 0 and stats["demotions"] == 0
    demoted = daf.wrap(copy.deepcopy(plain), budget="8KiB", min_bits=1, **split)  # its 4-bit codes to 2
    got = _grads(demoted, x, y)
    assert daf.report(demoted).sections["store"]["demotions"] > 0
    assert F.cosine_similarity(got, _grads(plain, x, y), dim=0) > 0.8


class _ThreeNorms(nn.Module):
    """relu(bn1(a) + bn2(b) + bn3(c)): the ReLU's add has bn3 and another add below it."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 8, 3, padding=1) for _ in range(3))
        self.norms = nn.ModuleList(nn.BatchNorm2d(8) for _ in range(3))
        self.head = nn.Conv2d(8, 10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norms[0](self.convs[0](x)) + self.norms[1](self.convs[1](x)) + self.norms[2](self.convs[2](x))
        return self.head(F.relu(h)).mean((2, 3))


def test_held_inputs_no_relu_claims_are_coded_plainly():
    """At most two are held: the first is coded when the third comes, the second when the forward ends."""
    torch.manual_seed(0)
    plain = _ThreeNorms()
    x, y = _batch()
    reference = _grads(plain, x, y)
    model = daf.wrap(copy.deepcopy(plain), audit=daf.Audit(every=0), split_norm_inputs=True)
    got = _grads(model, x, y)
    rows = _rows(model)
    assert rows["norms.2#0"].why.startswith("split by the ReLU mask")
    for site in ("norms.0#0", "norms.1#0"):
        assert rows[site].bits == 2 and rows[site].stored_bytes > 0 and not rows[site].why.startswith("split")
    assert F.cosine_similarity(got, reference, dim=0) > 0.95


def test_backward_asking_before_the_forward_ends_gets_the_held_input_coded():
    """A session used as a context (no wrapped model's end of forward): backward's unpack codes what is held."""
    torch.manual_seed(0)
    conv, norm = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
    x = torch.randn(4, 3, 16, 16)
    weights = torch.randn(4, 8, 16, 16)
    reference = torch.autograd.grad((norm(conv(x)) * 2 * weights).sum(), conv.weight)[0]
    session = daf.runtime.session.Session(daf.Config(audit=daf.Audit(every=0), split_norm_inputs=True))
    session.begin_forward()
    with session.hooks():
        out = norm(conv(x)) * 2  # saves nothing: the norm's input stays held
    assert len(session._held) == 1
    got = torch.autograd.grad((out * weights).sum(), conv.weight)[0]
    assert len(session._held) == 0
    assert F.cosine_similarity(got.flatten(), reference.flatten(), dim=0) > 0.95
    session.close()


def test_a_split_record_is_stored_as_such():
    torch.manual_seed(0)
    model = daf.wrap(Net(), audit=daf.Audit(every=0), split_norm_inputs=True)
    session = daf.session_of(model)
    kinds = []
    put = session.store.put
    session.store.put = lambda packed, *a: kinds.append(type(packed)) or put(packed, *a)
    _grads(model, *_batch())
    assert kinds.count(SplitPacked) == 8


def test_off_by_default():
    torch.manual_seed(0)
    model = daf.wrap(Net(), audit=daf.Audit(every=0))
    _grads(model, *_batch())
    assert not any(r.why.startswith("split") for r in daf.report(model).rows)
    with pytest.raises(ValueError, match="split_norm_inputs"):
        daf.Config(split_norm_inputs="yes")


def test_a_split_that_would_do_nothing_is_refused():
    with pytest.raises(ValueError, match="needs the remake rule 'norm_block'"):
        daf.Config(split_norm_inputs=True, remakes=("activation",))
    with pytest.raises(ValueError, match="splits MinMax or Outliers codes"):
        daf.Config(split_norm_inputs=True, codec=daf.Division())
