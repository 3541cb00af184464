"""A language model's log-probabilities, made by a frozen head, are remade in backward from an 8-bit
record of the head's input instead of stored (tokens x hidden size instead of tokens x vocabulary)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf
from daf.policy.exponent_guard import HEAD_INPUT_BITS
from daf.tracing import head_log_probabilities, nodes_behind

VOCAB, WIDTH = 512, 32


class TinyLM(nn.Module):
    """A trained trunk under a frozen head, with the loss as Hugging Face's causal LMs compute it
    (logits upcast to float32, flattened); ``keep_input=False`` gives the head a temporary input."""

    def __init__(self, dtype: torch.dtype = torch.float32, keep_input: bool = True, change_input: bool = False,
                 mask_vocabulary: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH).requires_grad_(False)
        self.trunk = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False).requires_grad_(False).to(dtype)
        self.dtype, self.keep_input, self.change_input = dtype, keep_input, change_input
        self.mask_vocabulary = mask_vocabulary  # "logits" or "upcast": which tensor is edited in place

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(torch.tanh(self.trunk(self.embed(ids)))).to(self.dtype)
        logits = self.head(hidden if self.keep_input else hidden * 1.0)
        if self.change_input:  # allowed by autograd: nothing saved it (the head is frozen)
            hidden.add_(1.0)
        if self.mask_vocabulary == "logits":
            with torch.no_grad():  # the second half of the vocabulary barred, after the head
                logits[..., VOCAB // 2:] = float("-inf")
        upcast = logits.float()
        if self.mask_vocabulary == "upcast":
            with torch.no_grad():
                upcast[..., VOCAB // 2:] = float("-inf")
        return F.cross_entropy(upcast.view(-1, VOCAB), ids.view(-1))


def _rows(model: nn.Module) -> list[daf.report.SiteRow]:
    return daf.report(model).rows


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_remade_bit_for_bit_from_the_forward_input(dtype) -> None:
    torch.manual_seed(0)
    head = nn.Linear(WIDTH, VOCAB).to(dtype).requires_grad_(False)
    y = torch.randn(4, 24, WIDTH, dtype=dtype, requires_grad=True) * 3
    log_probabilities = head(y).float().view(-1, VOCAB).log_softmax(-1)
    assert nodes_behind(log_probabilities)  # the view, the cast (bfloat16), the linear's own view, its product
    remade = head_log_probabilities(y.detach(), weight=head.weight, bias=head.bias, versions=(head.weight._version, head.bias._version),
                                    shape=tuple(log_probabilities.shape), dtype=torch.float32)
    assert torch.equal(remade, log_probabilities)


def test_nodes_behind_only_log_softmax_over_the_last_dimension() -> None:
    x = torch.randn(6, 10, requires_grad=True)
    assert nodes_behind(x.softmax(-1)) == []
    assert nodes_behind(x.log_softmax(0)) == []
    assert [type(n).__name__ for n, _ in nodes_behind((x * 2).log_softmax(-1))] == ["MulBackward0"]


def test_the_log_probabilities_store_nothing_and_the_head_input_is_kept_at_eight_bits() -> None:
    torch.manual_seed(0)
    model = daf.wrap(TinyLM(), daf.Config(bits=4, min_numel=64))
    model(_ids()).backward()
    rows = _rows(model)
    derived = [row for row in rows if row.source == "LogSoftmaxBackward0" and row.kind == "derived"]
    assert len(derived) == 1 and derived[0].shape == (96, VOCAB) and derived[0].raw_bytes == 96 * VOCAB * 4
    assert not any(row.source == "LogSoftmaxBackward0" and row.kind == "compressed" for row in rows)
    inputs = [row for row in rows if row.site.endswith(".head_input")]
    assert len(inputs) == 1 and inputs[0].bits == HEAD_INPUT_BITS and inputs[0].shape == (4, 24, WIDTH)
    assert inputs[0].raw_bytes == 0 and 0 < inputs[0].stored_bytes < 96 * WIDTH * 4 // 3  # counted, at 8 bits
    assert daf.report(model).stored_bytes >= inputs[0].stored_bytes


def test_gradients_match_plain_autograd_closely() -> None:
    torch.manual_seed(0)
    plain = TinyLM()
    model = daf.wrap(TinyLM(), daf.Config(bits=8, min_numel=64))
    model.load_state_dict(plain.state_dict())
    plain(_ids()).backward()
    model(_ids()).backward()
    assert any(row.kind == "derived" and row.source == "LogSoftmaxBackward0" for row in _rows(model))
    for (name, mine), theirs in zip(model.named_parameters(), plain.parameters()):
        if theirs.grad is not None:
            assert F.cosine_similarity(mine.grad.flatten(), theirs.grad.flatten(), dim=0) > 0.999, name


def test_coded_as_before_where_the_head_input_is_gone_by_the_loss() -> None:
    torch.manual_seed(0)
    model = daf.wrap(TinyLM(keep_input=False), daf.Config(bits=4, min_numel=64))
    model(_ids()).backward()
    rows = _rows(model)
    assert [row.kind for row in rows if row.source == "LogSoftmaxBackward0"][0] == "compressed"
    assert not any(row.site.endswith(".head_input") for row in rows)


def test_coded_as_before_where_the_head_input_changed_after_the_head_read_it() -> None:
    torch.manual_seed(0)
    plain = TinyLM(change_input=True)
    model = daf.wrap(TinyLM(change_input=True), daf.Config(bits=8, min_numel=64))
    model.load_state_dict(plain.state_dict())
    plain(_ids()).backward()
    model(_ids()).backward()
    rows = _rows(model)
    assert [row.kind for row in rows if row.source == "LogSoftmaxBackward0"][0] == "compressed"
    assert not any(row.site.endswith(".head_input") for row in rows)
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()) if q.grad is not None]
    assert all(F.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999 for a, b in grads)


@pytest.mark.parametrize("dtype, where", [(torch.float32, "logits"), (torch.bfloat16, "logits"),
                                          (torch.bfloat16, "upcast")])
def test_logits_edited_in_place_after_the_head_are_stored_and_give_plain_autograds_gradients(dtype, where) -> None:
    """Issue 42: the remake recomputed the logits from the head's input and lost the edit (the barred half
    of the vocabulary got probability again); now the log-probabilities are stored as they were made."""
    torch.manual_seed(0)
    plain = TinyLM(dtype, mask_vocabulary=where)
    model = daf.wrap(TinyLM(dtype, mask_vocabulary=where), daf.Config(bits=8, min_numel=64))
    model.load_state_dict(plain.state_dict())
    ids = torch.randint(0, VOCAB // 2, (4, 24), generator=torch.Generator().manual_seed(5))
    plain(ids).backward()
    model(ids).backward()
    assert [row.kind for row in _rows(model) if row.source == "LogSoftmaxBackward0"][0] == "compressed"
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()) if q.grad is not None]
    assert grads and all(F.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999 for a, b in grads)


def test_a_head_changed_in_place_before_backward_raises() -> None:
    torch.manual_seed(0)
    model = daf.wrap(TinyLM(), daf.Config(bits=4, min_numel=64))
    loss = model(_ids())
    with torch.no_grad():
        model.head.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place since forward"):
        loss.backward()


def test_remade_once_for_log_softmax_and_nll_loss() -> None:
    import daf.runtime.remakes.heads as heads_module

    calls = []
    torch.manual_seed(0)
    model = daf.wrap(TinyLM(), daf.Config(bits=4, min_numel=64, audit=daf.Audit(every=0)))  # counts calls
    with pytest.MonkeyPatch.context() as patch:
        original = heads_module.head_log_probabilities
        patch.setattr(heads_module, "head_log_probabilities", lambda *a, **k: calls.append(1) or original(*a, **k))
        model(_ids()).backward()
    assert [row.kind for row in _rows(model) if row.source == "LogSoftmaxBackward0"] == ["derived", "shared"]
    assert len(calls) == 1
