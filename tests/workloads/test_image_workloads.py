"""tiny-mnist and resnet18-fmnist: loaders, fixed splits, seeded models and a training step on a slice."""

from pathlib import Path

import pytest
import torch

from daf.workloads import get_workload
from daf.workloads.fashion_mnist import DATA_DIR, INSTALL_HINT

needs_fmnist = pytest.mark.skipif(not (Path(DATA_DIR) / "train-images-idx3-ubyte.gz").exists(),
                                  reason=f"Fashion-MNIST not installed ({INSTALL_HINT})")


def _steps(workload, batch, steps):
    model = workload.build_model()
    optimizer, schedule = workload.optimizer(model, steps)
    losses = []
    for data in workload.batches(batch, steps):
        loss = workload.loss(model, data)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        losses.append(loss.item())
    return model, losses


def test_tiny_mnist_split_and_training():
    workload = get_workload("tiny-mnist", train_size=256, eval_size=200)
    x, y, ex, ey = workload.data()
    assert x.shape == (256, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert ex.shape == (200, 1, 28, 28) and set(ey.tolist()) <= set(range(10))
    full = get_workload("tiny-mnist")
    assert len(full.data()[0]) == 4000 and len(full.data()[2]) == 1000
    assert torch.equal(full.data()[2][:200], ex)  # the held-out split does not depend on any option
    model, losses = _steps(workload, 32, 2)
    assert all(torch.isfinite(torch.tensor(losses)))
    figures = workload.evaluate(model)
    assert 0 <= figures["accuracy"] <= 1 and figures["eval_examples"] == 200
    assert model.training


def test_same_seed_same_model_and_batches():
    a, b, c = (get_workload("tiny-mnist", seed=s, train_size=128) for s in (0, 0, 1))
    for pa, pb in zip(a.build_model().parameters(), b.build_model().parameters()):
        assert torch.equal(pa, pb)
    batches = [[x for x, _ in w.batches(16, 3)] for w in (a, b, c)]
    assert all(torch.equal(p, q) for p, q in zip(batches[0], batches[1]))
    assert not torch.equal(batches[0][0], batches[2][0])


@needs_fmnist
def test_resnet18_fmnist_loader_and_two_steps():
    workload = get_workload("resnet18-fmnist", train_size=64, eval_size=32, width=8)
    x, y, ex, ey = workload.data()
    assert x.shape == (64, 1, 28, 28) and ex.shape == (32, 1, 28, 28)
    model, losses = _steps(workload, 16, 2)
    assert len(losses) == 2 and all(l == l for l in losses)
    assert workload.evaluate(model)["eval_examples"] == 32
    optimizer, schedule = workload.optimizer(model, 400)
    assert isinstance(optimizer, torch.optim.SGD) and schedule is not None


def test_missing_fashion_mnist_names_the_install(tmp_path):
    from daf.workloads.fashion_mnist import load_fashion_mnist
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        load_fashion_mnist("train", data_dir=tmp_path)


@needs_fmnist
def test_resnet18_fmnist_keeps_pixels_and_gives_the_same_batches_as_a_normalized_split():
    from daf.workloads.fashion_mnist import load_fashion_mnist
    workload = get_workload("resnet18-fmnist", train_size=256, eval_size=32, width=8)
    assert workload.data()[0].dtype == torch.uint8  # 4x less resident memory than float32
    normalized, labels = load_fashion_mnist("train")
    images, targets = next(workload.batches(64, 1))
    index = torch.tensor([int((normalized[:256] == image).flatten(1).all(1).nonzero()[0]) for image in images])
    assert images.dtype == torch.float32 and torch.equal(images, normalized[index]) and torch.equal(targets, labels[index])


def test_resnet18_frames_hold_no_full_size_tensor_that_daf_stored():
    """Under DAF a block's input is stored compressed by the next block's first convolution; the model's
    own Python frames must not keep the full-size tensor alive behind it (a stage called as one
    nn.Sequential held its input until its last block returned)."""
    import weakref

    import daf
    from daf.workloads.resnet import ResNet18

    model = daf.wrap(ResNet18(num_classes=10, in_channels=1, width=8).train(), audit=daf.Audit(every=0))  # hooks count
    seen: dict[str, weakref.ref] = {}
    alive_later: list[bool] = []
    model.layer1[0].register_forward_pre_hook(lambda m, args: seen.update(stem=weakref.ref(args[0])))
    model.layer1[1].conv2.register_forward_pre_hook(lambda m, args: alive_later.append(seen["stem"]() is not None))
    model(torch.randn(4, 1, 16, 16)).sum().backward()
    assert alive_later == [False]

    plain = ResNet18(num_classes=10, in_channels=1, width=8).train()  # and without DAF autograd keeps it
    plain.layer1[0].register_forward_pre_hook(lambda m, args: seen.update(stem=weakref.ref(args[0])))
    plain.layer1[1].conv2.register_forward_pre_hook(lambda m, args: alive_later.append(seen["stem"]() is not None))
    plain(torch.randn(4, 1, 16, 16)).sum().backward()
    assert alive_later == [False, True]
