"""What is running when a tensor is saved: the torch function (``OpTracker``) and the module (``SiteTracker``).

The lowest floor the runtime and the policies share: both read an ``OpCall``, neither
is imported from here.
"""

from daf.tracing.ops import ATTENTION_FUNCTIONS, RELU_FUNCTIONS, OpCall, OpTracker
from daf.tracing.sites import SiteTracker

__all__ = ["OpCall", "OpTracker", "SiteTracker", "RELU_FUNCTIONS", "ATTENTION_FUNCTIONS"]
