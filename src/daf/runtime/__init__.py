"""Runtime: the per-model session and the saved-tensor hooks that feed it."""

from daf.runtime.session import Session
from daf.runtime.sites import SiteTracker

__all__ = ["Session", "SiteTracker"]
