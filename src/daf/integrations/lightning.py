"""``DAFCallback`` for Lightning: ``lightning.Trainer(..., callbacks=[DAFCallback(bits=4)])``.

It wraps the LightningModule when fitting begins (unless ``daf.wrap`` was called on it already), so what
any of its modules saves for backward is compressed, whether ``training_step`` calls ``self(x)`` or
``self.model.encoder(x)``; logs DAF's figures (``daf/raw_bytes``, ``daf/stored_bytes``, ``daf/ratio``)
through ``LightningModule.log`` after every training batch; and unwraps the module when fitting ends if
it wrapped it. Works with ``lightning`` and with the older ``pytorch_lightning`` package.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # the standalone package, before "lightning" bundled it
    from pytorch_lightning import Callback, LightningModule, Trainer

from daf.integrations import WrappingCallback

__all__ = ["DAFCallback"]


class DAFCallback(WrappingCallback, Callback):
    """Compress what the LightningModule saves for backward while it fits; log DAF's figures.

    ``config`` and keyword overrides are those of ``daf.wrap``; after fitting ``callback.session`` holds
    the session (``daf.report(callback.session)``).
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._wrapping.begin(pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.log_dict(self._wrapping.figures(), on_step=True, on_epoch=False)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._wrapping.end()
