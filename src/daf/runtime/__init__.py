"""Runtime: the per-model session, its saved-tensor hooks, and the router they ask."""

from daf.runtime.route import Context, Encoding, Kind, route
from daf.runtime.session import Session

__all__ = ["Session", "route", "Context", "Encoding", "Kind"]
