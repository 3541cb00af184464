"""One wrapped model used from two threads at once gives each thread its own gradients."""

import threading

import torch
from torch import nn

import daf


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def _grads(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])


def _worst_cosines(model: nn.Module, plain: nn.Module, inputs: list[torch.Tensor], rounds: int) -> list[float]:
    """Each thread's worst gradient cosine to plain PyTorch's over ``rounds`` forwards run at once by two
    threads on ``model``; raises what a thread raised."""
    expected = [_grads(plain, x) for x in inputs]
    barrier, worst, errors = threading.Barrier(2), [1.0, 1.0], []

    def work(i: int) -> None:
        try:
            for _ in range(rounds):
                barrier.wait()  # both forwards at once: their saves interleave
                got = _grads(model, inputs[i])
                worst[i] = min(worst[i], float(torch.nn.functional.cosine_similarity(got, expected[i], dim=0)))
        except Exception as error:  # reported below: an exception in a thread does not fail the test
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return worst


def test_two_threads_on_one_wrapped_model_get_the_gradients_of_plain_pytorch():
    model = daf.wrap(_model(), bits=8, rounding="nearest", min_numel=1)
    inputs = [torch.randn(128, 64, generator=torch.Generator().manual_seed(i)) * (1 + 10 * i) for i in range(2)]
    worst = _worst_cosines(model, _model(), inputs, rounds=20)
    assert min(worst) > 0.999, worst


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 4, 1))


def test_two_threads_splitting_norm_inputs_by_their_own_relu_masks():
    """split_norm_inputs holds each norm's input until its ReLU (daf.runtime.held): under two threads' forwards at
    once (torch's ops release the GIL), each record is split by its own thread's mask (a wrong one raises at
    decode or wrecks the gradient)."""
    model = daf.wrap(_cnn(), audit=daf.Audit(every=0), split_norm_inputs=True)
    inputs = [torch.randn(8, 3, 24, 24, generator=torch.Generator().manual_seed(i)) * (1 + 3 * i) for i in range(2)]
    worst = _worst_cosines(model, _cnn(), inputs, rounds=10)
    assert any(r.why.startswith("split by the ReLU mask") for r in daf.report(model).rows)
    assert min(worst) > 0.95, worst
