"""A tensor saved by two ops is decoded once when backward unpacks it twice in a row."""

import gc

import torch

import daf
from daf.codec import Codecs
from daf.codec.backends import REFERENCE
from daf.runtime import Session


class CountingBackend:
    name = "counting"

    def __init__(self):
        self.encodes = self.decodes = 0

    def encode_flat(self, *args):
        self.encodes += 1
        return REFERENCE.encode_flat(*args)

    def decode_flat(self, *args):
        self.decodes += 1
        return REFERENCE.decode_flat(*args)


def run(reuse: bool):
    config = daf.Config(min_numel=1, bits=8, masks=False)  # relu and matmul share one record
    backend = CountingBackend()
    session = Session(config, codecs=Codecs(config, backend))
    if not reuse:  # the plain path: decode on every unpack
        session.unpack = lambda saved: saved.unpack() if hasattr(saved, "unpack") else \
            session.codecs.decode(session.store.get(saved.ref))
    torch.manual_seed(0)
    w1 = torch.randn(32, 64, requires_grad=True)
    w2 = torch.randn(64, 16, requires_grad=True)
    x = torch.randn(128, 32)
    session.begin_forward()
    with session.hooks():
        h = torch.relu(x @ w1)  # relu saves h; the next matmul saves h again
        loss = (h @ w2).sum()
    session.end_forward()
    loss.backward()
    gc.collect()
    return backend, session, (w1.grad, w2.grad)


def test_shared_tensor_decoded_once_and_not_kept_after_backward():
    backend, session, grads = run(reuse=True)
    assert backend.encodes == 1  # h (x has no autograd history and stays raw)
    assert backend.decodes == 1  # not 2: h is decoded once for relu and the second matmul
    assert len(session._recent) == 0  # the decoded tensor went with its record
    plain_backend, _, plain_grads = run(reuse=False)
    assert plain_backend.decodes == 2
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
