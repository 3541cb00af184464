"""DAF where people train (issue 17): any module of the wrapped tree, torch.compile, the Trainer and
Lightning callbacks, copies of a wrapped model, and the snippets of docs/integrations.md."""

from __future__ import annotations

import copy
import csv
import io
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import daf

DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


class AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 256), nn.GELU())
        self.decoder = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def _x() -> torch.Tensor:
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(0))


def _grads(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])


# -- any module of the tree -------------------------------------------------------------------

def test_children_called_directly_are_compressed_as_one_forward():
    model = daf.wrap(AutoEncoder(), bits=4, min_numel=1)
    model(_x()).square().mean().backward()
    whole = daf.report(model)
    for _ in range(2):  # as a training_step calling self.model.encoder, then self.model.decoder
        model.decoder(model.encoder(_x())).square().mean().backward()
        parts = daf.report(model)
        assert [r.site for r in parts.rows] == [r.site for r in whole.rows]
        assert parts.ratio > 4
        # the decoder's save of the encoder's GELU output: derived from GELU's input in one forward,
        # stored in its own part (docs/integrations.md); every other row is the same
        crossing = [(w.kind, p.kind) for w, p in zip(whole.rows, parts.rows) if w.kind != p.kind]
        assert crossing == [("derived", "compressed")]
        same = [(w.stored_bytes, p.stored_bytes) for w, p in zip(whole.rows, parts.rows) if w.kind == p.kind]
        assert all(a == b for a, b in same)
    assert daf.session_of(model).forwards == 3  # one forward per step, however many parts


def test_a_child_alone_begins_a_forward_with_gradients_of_plain_pytorch():
    torch.manual_seed(0)
    plain = AutoEncoder()
    model = daf.wrap(copy.deepcopy(plain), bits=8, rounding="nearest", min_numel=1)
    expected = _grads(plain.encoder, plain.encoder(_x()).square().mean())
    got = _grads(model.encoder, model.encoder(_x()).square().mean())
    assert daf.report(model).rows and all(r.site.startswith("encoder.") for r in daf.report(model).rows)
    assert float(nn.functional.cosine_similarity(got, expected, dim=0)) > 0.9999


def test_children_under_eval_no_grad_or_inference_mode_store_nothing():
    model = daf.wrap(AutoEncoder(), min_numel=1)
    with torch.no_grad():
        model.encoder(_x())
    with torch.inference_mode():
        model.decoder(torch.randn(4, 256))
    model.eval()
    model.encoder(_x()).sum().backward()
    assert daf.report(model).rows == [] and daf.session_of(model).forwards == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputation_in_backward_begins_no_forward(reentrant):
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = blocks

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
            return x

    plain = copy.deepcopy(Net())
    model = daf.wrap(Net(), bits=8, rounding="nearest", min_numel=1)
    x = _x().requires_grad_(reentrant)  # the reentrant variant needs an input that requires grad
    loss = model(x).square().mean()
    before = [r.site for r in daf.report(model).rows]
    loss.backward()  # (reentrant checkpointing does not support torch.autograd.grad)
    assert len(before) == (2 if reentrant else 3)  # the blocks' inputs (a leaf that requires grad has no row)
    assert daf.session_of(model).forwards == 1 and [r.site for r in daf.report(model).rows] == before
    plain(x).square().mean().backward()
    got, expected = (torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (model, plain))
    assert float(nn.functional.cosine_similarity(got, expected, dim=0)) > 0.9999


class _Counted(nn.Module):
    """A block whose last op is one whose output DAF may remake from records (so a later save makes it look
    at the block's nodes); it counts its forwards."""

    def __init__(self, ending: str) -> None:
        super().__init__()
        self.ending, self.calls = ending, 0
        self.linear = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.linear(x)
        if self.ending == "layer_norm":
            return self.norm(h)
        if self.ending == "rms_norm":
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        if self.ending == "attention":
            return nn.functional.scaled_dot_product_attention(h, h, h)
        return nn.functional.dropout(h, 0.5, training=True)


@pytest.mark.parametrize("ending", ["layer_norm", "rms_norm", "attention", "dropout"])
def test_checkpointed_blocks_are_not_recomputed_in_forward(ending):
    """DAF reads the saves of the node behind a tensor it stores, to remake it instead; a node inside a
    checkpointed block saved through checkpointing's hook, whose unpack recomputes the whole block and
    holds what it made until backward (MiniLM: +430 MiB after forward at batch 16). Never read there."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_Counted(ending) for _ in range(2))
            self.head = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            return self.head(x)

    torch.manual_seed(0)
    plain = Net()
    model = daf.wrap(copy.deepcopy(plain), bits=8, rounding="nearest", min_numel=1,
                     audit=daf.Audit(every=0))  # the audit's passes would run the blocks too
    x = torch.randn(4, 8, 64)
    torch.manual_seed(1)
    loss = model(x).square().mean()
    assert [block.calls for block in model.blocks] == [1, 1]  # forward ran each block once, recomputed none
    loss.backward()
    assert [block.calls for block in model.blocks] == [2, 2]
    torch.manual_seed(1)
    plain(x).square().mean().backward()
    got, expected = (torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]) for m in (model, plain))
    assert float(nn.functional.cosine_similarity(got, expected, dim=0)) > 0.999


# -- torch.compile ----------------------------------------------------------------------------

def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))


@pytest.mark.parametrize("order", ["compile(wrap(m))", "wrap(compile(m))"])
def test_compile_in_either_order_warns_once_and_trains(order):
    """Through inductor: an nn.Sequential compiled whole (dynamo enters it through its own wrapper, not the
    wrapped model's __call__) saves raw and says so; wrap(compile(m)) stores the policy's codes in the graph
    (tests/test_compile.py, tests/runtime/test_in_graph.py). Neither goes through DAF's eager session."""
    torch._dynamo.reset()
    plain = _mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if order == "compile(wrap(m))":
            wrapped = daf.wrap(_mlp(), bits=8, min_numel=1)
            model = torch.compile(wrapped)
        else:
            model = wrapped = daf.wrap(torch.compile(_mlp()), bits=8, min_numel=1)
        for _ in range(2):
            got = _grads(wrapped, model(_x()).square().mean())
    ours = [w for w in caught if str(w.message).startswith("DAF:")]
    assert len(ours) == 1 and "torch.compile" in str(ours[0].message)
    expected_text = ("compresses nothing" if order == "compile(wrap(m))"
                     else "inside its graphs DAF stores the policy's codes")
    assert expected_text in str(ours[0].message)
    report = daf.report(wrapped)
    if order == "compile(wrap(m))":
        assert report.stored_bytes == 0  # pinned: nothing compressed, nothing counted
    else:  # the graph's saves, listed with their widths
        assert 0 < report.stored_bytes < report.raw_bytes / 3
    expected = _grads(plain, plain(_x()).square().mean())
    assert float(nn.functional.cosine_similarity(got, expected, dim=0)) > 0.9999


def test_wrap_names_compiled_children():
    model = nn.Sequential(nn.Linear(4, 4), torch.compile(nn.Linear(4, 4)))
    with pytest.warns(UserWarning, match=r"^DAF: 1 of this model run under torch.compile: inside its graphs DAF stores the policy's codes"):
        daf.wrap(model)


# -- copies -----------------------------------------------------------------------------------

def _trains_plain(copied: nn.Module, original: nn.Module) -> None:
    """The copy is unwrapped, has the original's weights, and trains; the original stays wrapped."""
    assert getattr(copied, "_daf_attachment", None) is None
    with pytest.raises(ValueError, match="not wrapped"):
        daf.session_of(copied)
    for a, b in zip(copied.state_dict().values(), original.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.warns(UserWarning, match="copy of a wrapped model .* nothing it saves is compressed"):
        copied(_x()).square().mean().backward()
    original(_x()).square().mean().backward()
    assert daf.report(original).ratio > 2


def _saved(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_of_a_wrapped_model_is_a_plain_model(how):
    model = daf.wrap(AutoEncoder(), bits=4, min_numel=1)
    model(_x()).sum().backward()
    copied = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)),
              "torch.save": _saved}[how](model)
    _trains_plain(copied, model)
    daf.wrap(copied, daf.session_of(model).config)  # and wraps again, with a session of its own
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # wrapped again: the copy's inert hooks are gone, nothing to say
        copied.decoder(copied.encoder(_x())).square().mean().backward()
    assert daf.report(copied).ratio > 2 and daf.session_of(copied) is not daf.session_of(model)


def test_averaged_model_ema_of_a_wrapped_model():
    model = daf.wrap(AutoEncoder(), bits=4, min_numel=1)
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    model(_x()).square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    ema.update_parameters(model)
    assert ema(_x()).shape == (64, 64)
    _trains_plain(ema.module, model)


# -- the framework callbacks -----------------------------------------------------------------

def test_transformers_trainer_callback_wraps_compresses_and_logs(tmp_path):
    import transformers  # the "integrations" extra, which scripts/test.sh installs
    from daf.integrations.transformers import DAFCallback

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64))
    data = [{"input_ids": torch.randint(0, 100, (16,)), "labels": torch.tensor(i % 2)} for i in range(24)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8,
                                          logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                                          disable_tqdm=True)
    callback = DAFCallback(bits=4, min_numel=256)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    assert getattr(model, "_daf_attachment", None) is None  # it wrapped, so it unwrapped at the end
    assert daf.report(callback.session).ratio > 3
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3 and all(entry["daf/ratio"] > 3 and entry["daf/stored_bytes"] > 0 for entry in logged)


def test_transformers_callback_keeps_a_model_wrapped_before(tmp_path):
    import transformers
    from daf.integrations.transformers import DAFCallback

    model = daf.wrap(transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)),
        min_numel=64)
    data = [{"input_ids": torch.randint(0, 50, (8,)), "labels": torch.tensor(0)} for _ in range(4)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
                                          report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    callback = DAFCallback()
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    assert callback.session is daf.session_of(model)  # used the user's wrap, and left it on
    with pytest.raises(ValueError, match="bits"):
        DAFCallback(bits=3)  # options are checked when the callback is made


def test_lightning_callback_wraps_compresses_children_and_logs(tmp_path):
    import lightning  # the "integrations" extra, which scripts/test.sh installs
    from daf.integrations.lightning import DAFCallback

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoEncoder()

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return nn.functional.mse_loss(self.model.decoder(self.model.encoder(x)), x)  # not self(x)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(96, 64)), batch_size=32)
    callback = DAFCallback(bits=4, min_numel=256)
    trainer = lightning.Trainer(max_steps=3, callbacks=[callback], logger=lightning.pytorch.loggers.CSVLogger(tmp_path),
                                log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, accelerator="cpu")
    module = Module()
    trainer.fit(module, loader)
    assert getattr(module, "_daf_attachment", None) is None
    assert daf.report(callback.session).ratio > 4
    rows = list(csv.DictReader(open(next(Path(tmp_path).rglob("metrics.csv")))))
    ratios = [float(row["daf/ratio"]) for row in rows if row.get("daf/ratio")]
    assert len(ratios) == 3 and min(ratios) > 4


# -- docs/integrations.md ---------------------------------------------------------------------

SNIPPETS = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_docs_snippet(snippet):
    if "init_process_group" in snippet:
        _run_alone(snippet)
        return
    if "torch.compile" in snippet:
        torch._dynamo.reset()
    exec(compile(snippet, str(DOC), "exec"), {"__name__": "docs_integrations"})


def _run_alone(snippet: str) -> None:
    """A distributed snippet in a fresh interpreter, as torchrun starts one: inside pytest's process (its
    threads, its earlier tests' state) gloo's process group once hung for good in its destructor while
    joining its worker threads (CI, 2026-11-26); alone it never did. Killed on a timeout, never left."""
    import subprocess
    import sys
    try:
        done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the distributed snippet of docs/integrations.md did not finish in 300 s (killed)")
    assert done.returncode == 0, done.stderr[-2000:]


def test_docs_cover_every_topic_and_readme_links_them():
    text = DOC.read_text()
    for topic in ["Hugging Face Trainer", "Lightning", "DDP", "FSDP", "Autocast", "torch.compile",
                  "Gradient checkpointing", "save_on_cpu", "Copies and EMA", "state_dict"]:
        assert f"## {topic}" in text, topic
    assert "docs/integrations.md" in (DOC.parents[1] / "README.md").read_text()


def test_the_core_never_imports_the_frameworks():
    import subprocess
    import sys
    child = ("import sys, torch, daf; daf.wrap(torch.nn.Linear(2, 2)); "
             "print([m for m in ('lightning', 'transformers', 'daf.integrations') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_logged_figures_carry_the_gradient_audits_cosine_once_one_ran():
    from daf.integrations import figures
    model = daf.wrap(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)), min_numel=1)
    assert "daf/audit_cosine" not in figures(daf.session_of(model))
    model(torch.randn(16, 64)).sum().backward()
    cosine = figures(daf.session_of(model))["daf/audit_cosine"]
    assert cosine == daf.report(model).sections["audit"]["cosine"] and 0 < cosine <= 1 + 1e-9
