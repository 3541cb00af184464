"""DAF: train in small memory by storing what autograd saves for backward, compressed.

>>> import torch, daf
>>> model = daf.wrap(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()), bits=2, min_numel=1)
>>> model(torch.randn(256, 64)).sum().backward()
>>> daf.report(model).raw_bytes > daf.report(model).stored_bytes
True

The bit policy and the codec are typed configs: ``daf.wrap(model, policy=daf.Adaptive(average=1.5))``,
``daf.wrap(model, codec=daf.Division())``.
"""

from daf.api import allocator_status, compress, native_status, report, session_of, unwrap, wrap
from daf.config import Adaptive, Audit, Auto, Config, Division, MinMax, Outliers, Uniform
from daf.memory.errors import OutOfBudget
from daf.report import Report

__version__ = "0.1.0"

__all__ = ["wrap", "unwrap", "compress", "report", "session_of", "Config", "Auto", "Uniform", "Adaptive", "MinMax",
           "Division", "Outliers", "Audit", "Report", "OutOfBudget", "allocator_status", "native_status"]
