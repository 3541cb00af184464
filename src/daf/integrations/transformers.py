"""``DAFCallback`` for the Hugging Face ``Trainer``: ``Trainer(..., callbacks=[DAFCallback(bits=4)])``.

It wraps the model when training begins (unless ``daf.wrap`` was called on it already), adds DAF's
figures (``daf/raw_bytes``, ``daf/stored_bytes``, ``daf/ratio``) to every log entry, and unwraps the model
when training ends if it wrapped it.

Trainer calls its reporting integrations (``report_to``: TensorBoard, W&B, ...) before the callbacks
passed in ``callbacks``, so they would log an entry before DAF adds to it; to send DAF's figures to them
as well, put the callback first: ``trainer.callback_handler.callbacks.insert(0, DAFCallback())``.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from daf.integrations import WrappingCallback

__all__ = ["DAFCallback"]


class DAFCallback(WrappingCallback, TrainerCallback):
    """Compress what the Trainer's model saves for backward; log DAF's figures with the Trainer's logs.

    ``config`` and keyword overrides are those of ``daf.wrap``; after training ``callback.session`` holds
    the session (``daf.report(callback.session)``).
    """

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise ValueError("DAFCallback: the Trainer passed no model to on_train_begin; wrap it yourself with "
                             "daf.wrap(model) before Trainer(...)")
        self._wrapping.begin(model)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs is None or not any(key in logs for key in ("loss", "train_loss")):
            return  # evaluation entries: nothing was trained since the last one
        figures = self._wrapping.figures()
        logs.update(figures)
        if state.log_history:  # Trainer appended a copy of this entry before calling the callbacks
            state.log_history[-1].update(figures)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._wrapping.end()
