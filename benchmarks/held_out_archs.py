"""``daf.wrap(model)`` with no argument on architectures no rule was tuned on: one gradient's cosine to autograd.

The rules of the default were written against GPT-2, BERT, T5, Llama, ViT, ConvNeXt and three CNNs
(``benchmarks/default_safety.py``). This is a second, held-out set, built the same way (random init,
seeded, dropout off, small configs, no download): decoder LMs of other families (Mistral, Qwen2, Gemma,
Phi-3, GPT-NeoX, Falcon), encoders (DistilBERT, RoBERTa, DeBERTa-v2), an encoder-decoder (BART), speech
(Whisper, Wav2Vec2), vision (Swin, MobileNetV2, EfficientNet, Segformer, HF ResNet), a state-space model
(Mamba, its slow path), and plain PyTorch (an LSTM language model, ``nn.TransformerEncoder``, a Conv1d
net). Each is measured plain and with large channels (``default_safety.with_large_channels``).

    python benchmarks/held_out_archs.py --json docs/results/held_out_archs.json
    python benchmarks/held_out_archs.py --archs mistral,lstm --config bits=8,rounding=nearest
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from default_safety import _parse_config, measure  # noqa: E402
from transformer_archs import Arch, _text  # noqa: E402

HIDDEN, LAYERS, HEADS, FFN, VOCAB = 128, 2, 4, 512, 500


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return build().train()
    return make


def _ids(batch: int, seq: int, labels: str) -> Callable[[torch.Generator], dict]:
    return _text(batch, seq, labels, VOCAB)


def _pixels(batch: int, size: int, key: str = "labels", classes: int = 10, dense: bool = False) -> Callable:
    def make(g: torch.Generator) -> dict:
        shape = (batch, size // 4, size // 4) if dense else (batch,)
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
                key: torch.randint(0, classes, shape, generator=g)}
    return make


class LSTMLanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.lstm = nn.LSTM(HIDDEN, HIDDEN, num_layers=2, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(input_ids))
        return F.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten())


class TorchEncoder(nn.Module):
    """``nn.TransformerEncoder`` (pre-norm, GELU) with a classification head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, 3)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.encoder(self.embed(input_ids)))
        return F.cross_entropy(self.head(hidden.mean(1)), labels)


class Conv1dNet(nn.Module):
    """A keyword-spotting-style 1-D conv net: conv, batch norm, SiLU, pooling."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 1
        for width in (32, 64, 64, 128):
            layers += [nn.Conv1d(channels, width, 9, padding=4), nn.BatchNorm1d(width), nn.SiLU(), nn.MaxPool1d(2)]
            channels = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(channels, 10)

    def forward(self, audio: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.body(audio).mean(-1)), labels)


def _torch_archs() -> dict[str, Arch]:
    def audio(g: torch.Generator) -> dict:
        return {"audio": torch.randn(8, 1, 4000, generator=g), "labels": torch.randint(0, 10, (8,), generator=g)}
    return {
        "lstm": Arch("lstm", _seeded(LSTMLanguageModel), _ids(4, 64, "lm"), lambda m: m.embed,
                     lambda m, b: m(**b)),
        "torch-encoder": Arch("torch-encoder", _seeded(TorchEncoder), _ids(4, 64, "cls"), lambda m: m.embed,
                              lambda m, b: m(**b)),
        "conv1d": Arch("conv1d", _seeded(Conv1dNet), audio, lambda m: m.body[0], lambda m, b: m(**b)),
    }


def _hf_archs() -> dict[str, Arch]:
    import transformers as tf
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    sdpa = {"attn_implementation": "sdpa"}
    decoder = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, max_position_embeddings=128, **sdpa)

    def hf(cls_name: str, config: Any) -> Callable[[], nn.Module]:
        return _seeded(lambda: getattr(tf, cls_name)(config))

    lm = _ids(4, 64, "lm")
    cls = _ids(4, 64, "cls")
    archs = {
        "mistral": ("MistralForCausalLM", tf.MistralConfig(num_key_value_heads=2, sliding_window=32, **decoder), lm),
        "qwen2": ("Qwen2ForCausalLM", tf.Qwen2Config(num_key_value_heads=2, **decoder), lm),
        "gemma": ("GemmaForCausalLM", tf.GemmaConfig(num_key_value_heads=1, head_dim=32, **decoder), lm),
        "phi3": ("Phi3ForCausalLM", tf.Phi3Config(num_key_value_heads=HEADS, pad_token_id=0, **decoder), lm),
        "gpt-neox": ("GPTNeoXForCausalLM", tf.GPTNeoXConfig(**decoder), lm),
        "falcon": ("FalconForCausalLM", tf.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                                         num_attention_heads=HEADS, **sdpa), lm),
        "distilbert": ("DistilBertForSequenceClassification",
                       tf.DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                                           hidden_dim=FFN, dropout=0.0, attention_dropout=0.0, num_labels=3,
                                           seq_classif_dropout=0.0, **sdpa), cls),
        "roberta": ("RobertaForSequenceClassification",
                    tf.RobertaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, intermediate_size=FFN, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3, **sdpa), cls),
        "deberta-v2": ("DebertaV2ForSequenceClassification",
                       tf.DebertaV2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                          num_attention_heads=HEADS, intermediate_size=FFN, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0, num_labels=3), cls),
        "bart": ("BartForConditionalGeneration",
                 tf.BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                               encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                               decoder_ffn_dim=FFN, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                               max_position_embeddings=128, **sdpa), _ids(4, 64, "seq2seq")),
        "swin": ("SwinForImageClassification",
                 tf.SwinConfig(image_size=64, patch_size=4, embed_dim=32, depths=[1, 1, 2], num_heads=[2, 4, 8],
                               window_size=4, num_labels=10, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, drop_path_rate=0.0), _pixels(4, 64)),
        "mobilenet-v2": ("MobileNetV2ForImageClassification",
                         tf.MobileNetV2Config(image_size=64, depth_multiplier=0.5, num_labels=10,
                                              classifier_dropout_prob=0.0), _pixels(8, 64)),
        "efficientnet": ("EfficientNetForImageClassification",
                         tf.EfficientNetConfig(image_size=64, width_coefficient=0.5, depth_coefficient=0.5,
                                               num_labels=10, dropout_rate=0.0, drop_connect_rate=0.0, hidden_dim=640),
                         _pixels(8, 64)),
        "hf-resnet": ("ResNetForImageClassification",
                      tf.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                                      num_labels=10), _pixels(8, 64)),
        "segformer": ("SegformerForSemanticSegmentation",
                      tf.SegformerConfig(num_labels=4, hidden_sizes=[16, 32, 64, 128], decoder_hidden_size=64,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                         classifier_dropout_prob=0.0, drop_path_rate=0.0),
                      _pixels(4, 64, classes=4, dense=True)),
        "mamba": ("MambaForCausalLM", tf.MambaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, state_size=16,
                                                     num_hidden_layers=LAYERS, use_mambapy=False), lm),
    }
    out = {name: Arch(name, hf(cls_name, config), batch, lambda m: nn.Identity())
           for name, (cls_name, config, batch) in archs.items()}

    def whisper_batch(g: torch.Generator) -> dict:
        return {"input_features": torch.randn(2, 80, 3000, generator=g),
                "labels": torch.randint(0, VOCAB, (2, 16), generator=g)}
    whisper = tf.WhisperConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                               encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                               decoder_ffn_dim=FFN, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                               max_source_positions=1500, max_target_positions=64, decoder_start_token_id=1,
                               pad_token_id=0, **sdpa)
    out["whisper"] = Arch("whisper", hf("WhisperForConditionalGeneration", whisper), whisper_batch,
                          lambda m: nn.Identity())

    def wav2vec_batch(g: torch.Generator) -> dict:
        return {"input_values": torch.randn(4, 8000, generator=g), "labels": torch.randint(0, 3, (4,), generator=g)}
    wav2vec = tf.Wav2Vec2Config(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                intermediate_size=FFN, hidden_dropout=0.0, attention_dropout=0.0,
                                activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, num_labels=3,
                                conv_dim=(64, 64, 64), conv_stride=(5, 4, 4), conv_kernel=(10, 8, 4),
                                num_conv_pos_embeddings=16, mask_time_prob=0.0, **sdpa)
    out["wav2vec2"] = Arch("wav2vec2", hf("Wav2Vec2ForSequenceClassification", wav2vec), wav2vec_batch,
                           lambda m: nn.Identity())
    return out


def all_archs() -> dict[str, Arch]:
    return {**_hf_archs(), **_torch_archs()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="", help="comma-separated names (default: all)")
    parser.add_argument("--config", default="", help="keywords of daf.wrap, e.g. bits=8,rounding=nearest")
    parser.add_argument("--no-large", action="store_true", help="the plain models only")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = _parse_config(args.config)
    known = all_archs()
    names = args.archs.split(",") if args.archs else list(known)
    rows: dict[str, dict[str, Any]] = {}
    print(f"daf.wrap(model{''.join(f', {k}={v!r}' for k, v in config.items())})")
    print(f"{'case':22s} {'cosine':>8s} {'rel err':>8s} {'ratio':>7s} {'stored MiB':>11s}")
    for name in names:
        for large in (False,) if args.no_large else (False, True):
            case = f"{name}{' +large' if large else ''}"
            try:
                rows[case] = row = measure(known[name], large, config, 1)
            except Exception as error:  # a model DAF cannot run is a finding, not a crash of the table
                traceback.print_exc()
                rows[case] = {"error": f"{type(error).__name__}: {error}"[:300]}
                print(f"{case:22s} ERROR {rows[case]['error']}", flush=True)
                continue
            print(f"{case:22s} {row['cosine']:8.4f} {row['rel_error']:8.4f} {row['ratio']:7.2f} "
                  f"{row['stored_bytes'] / 2**20:11.2f}", flush=True)
    done = [r for r in rows.values() if "cosine" in r]
    if done:
        print(f"min cosine {min(r['cosine'] for r in done):.4f}, "
              f"median stored ratio {statistics.median(r['ratio'] for r in done):.2f}, "
              f"errors {len(rows) - len(done)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "daf_config": config, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
