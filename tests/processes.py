"""Finding every process a test started, to kill them all on a timeout (a test must not leave any)."""

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first, from /proc. The arms of ``daf compare`` and the
    probes of ``daf bench`` run in sessions of their own, so killing a process group misses them."""
    children = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            child = int(entry.name)
            children += [child, *descendants(child)]
    return children
