"""The table ``daf train`` and ``daf compare`` print at the end."""

from __future__ import annotations

from typing import Any

__all__ = ["format_table", "headline", "config_label", "step_ms", "audit_line"]

_MIB = 2**20


def headline(run: dict[str, Any]) -> float | None:
    """The run's headline metric (accuracy or eval loss), None if it was not evaluated."""
    figures = run.get("eval") or {}
    value = figures.get(run["metric"])
    return None if value is None else float(value)


def _metric_text(run: dict[str, Any]) -> str:
    value = headline(run)
    if value is None:
        return "not evaluated"
    if run["metric"] == "accuracy":
        return f"{100 * value:.2f}%"
    extra = (run.get("eval") or {}).get("perplexity")
    return f"{value:.4f}" + (f" (ppl {extra:.2f})" if extra is not None else "")


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / _MIB:.1f}"


def _row(run: dict[str, Any]) -> list[str]:
    activations = run.get("activations") or {}
    raw, stored = activations.get("raw_bytes"), activations.get("stored_bytes")
    ratio = f"{raw / stored:.1f}x" if raw and stored else "-"
    label = (run["arm"] if run["arm"] == "fp32" else _daf_label(run)) + _allocator_label(run)
    steps = f"{run['steps_done']}/{run['steps_requested']}"
    peak, start = run.get("peak_rss_bytes"), run.get("start_rss_bytes")
    growth = None if peak is None or start is None else peak - start
    return [label, steps, _metric_text(run), _mib(raw), _mib(stored), ratio, _mib(peak), _mib(growth),
            step_ms(run)]


def step_ms(run: dict[str, Any]) -> str:
    """The run's median step time in milliseconds, as the table and the memory plot show it."""
    step = run.get("median_step_seconds")
    return "-" if step is None else f"{1000 * step:.0f}"


def _allocator_label(run: dict[str, Any]) -> str:
    """Where the run's tensors came from (the process's memory depends on it as much as on DAF)."""
    name = (run.get("allocator") or {}).get("name")
    return f" ({'system malloc' if name == 'system' else name})" if name else ""


def _daf_label(run: dict[str, Any]) -> str:
    config = run.get("config") or {}
    label = config_label(config)
    if config.get("budget"):
        label += f" budget {config['budget'] / _MIB:g}MiB"
    return label


def config_label(config: dict[str, Any]) -> str:
    """"DAF 2-bit", "DAF adaptive 1.5-bit avg", "DAF 4-bit division", ... from a record's config: a
    ``Config.to_dict`` of version 2 (typed ``{"kind": ...}`` policy and codec) or 1 (strings, the
    adaptive average in ``bits``), so that old records still read.

    >>> config_label({"bits": 2, "policy": {"kind": "uniform"}, "codec": {"kind": "minmax"}, "version": 2})
    'DAF 2-bit'
    >>> config_label({"bits": 1.5, "policy": "adaptive", "codec": "division", "version": 1})
    'DAF adaptive 1.5-bit avg division'
    >>> config_label({"policy": {"kind": "adaptive", "average": 2.5, "generic": "floor"}, "version": 2})
    'DAF adaptive 2.5-bit avg (floor)'
    >>> config_label({"bits": None, "policy": {"kind": "auto"}, "codec": {"kind": "outliers", "above": 8.0}})
    'DAF auto'
    """
    policy, codec = config.get("policy", "uniform"), config.get("codec", "minmax")
    kind = policy.get("kind") if isinstance(policy, dict) else policy
    if kind == "adaptive":
        average = policy.get("average") if isinstance(policy, dict) else config.get("bits")
        label = f"DAF adaptive {average:g}-bit avg" if isinstance(average, (int, float)) else "DAF adaptive"
        if isinstance(policy, dict) and policy.get("generic", "hold") != "hold":
            label += f" ({policy['generic']})"
    else:
        bits = config.get("bits")
        label = f"DAF {bits:g}-bit" if isinstance(bits, (int, float)) else "DAF"
        if kind not in ("uniform", None):
            label += f" {kind}"
    codec_kind = codec.get("kind") if isinstance(codec, dict) else codec
    if codec_kind == "outliers" and isinstance(codec, dict) and codec.get("derivatives"):
        codec_kind = "outliers+derivatives"
    elif codec_kind == "outliers" and isinstance(codec, dict) and codec.get("above"):
        codec_kind = None  # the default's split, only where large channels are: not a choice worth a word
    label = label if codec_kind in ("minmax", None) else f"{label} {codec_kind}"
    floors = config.get("floors")
    return f"{label} floors {','.join(f'{op}={bits}' for op, bits in floors.items())}" if floors else label


def format_table(runs: list[dict[str, Any]]) -> str:
    """A plain-text table, one row per run, and a difference line when an fp32 and a DAF run are both there.

    Columns: arm, steps done, eval metric, activation MiB raw and stored (one traced step), their
    ratio, peak RSS during training (MiB), its growth above the RSS when training started
    (``+train``: what training itself needed), median step time (ms).
    """
    if not runs:
        return "(no run finished)"
    metric = "eval accuracy" if runs[0]["metric"] == "accuracy" else "eval loss"
    header = ["arm", "steps", metric, "act raw MiB", "act stored MiB", "ratio", "peak RSS MiB", "+train MiB", "step ms"]
    rows = [header] + [_row(run) for run in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    by_arm = {run["arm"]: run for run in runs}
    if "fp32" in by_arm and "daf" in by_arm:
        lines.append("")
        lines.append(difference(by_arm["fp32"], by_arm["daf"]))
    lines.extend(audit_line(run) for run in runs if (run.get("activations_last_step") or {}).get("audit"))
    if any(run.get("interrupted") for run in runs):
        lines.append("interrupted: figures cover the steps that ran")
    return "\n".join(lines)


def audit_line(run: dict[str, Any]) -> str:
    """The gradient audit's figures at the run's last step (docs/audit.md)."""
    audit = run["activations_last_step"]["audit"]
    cosine = audit.get("cosine")
    text = (f"audit ({_daf_label(run)}): {audit.get('audits', 0)} audits, last gradient cosine "
            f"{'-' if cosine is None else f'{cosine:.4f}'} (slice of {audit.get('samples', '-')})")
    return text + (f"; raised {audit['raised']}" if audit.get("raised") else "") + \
        (f"; off: {audit['off']}" if audit.get("off") else "")


def difference(fp32: dict[str, Any], compressed: dict[str, Any]) -> str:
    """One line: the metric difference (points or relative), memory and time ratios of DAF against fp32."""
    parts = []
    base, value = headline(fp32), headline(compressed)
    if base is not None and value is not None:
        if fp32["metric"] == "accuracy":
            parts.append(f"accuracy {100 * (value - base):+.2f} points")
        else:
            parts.append(f"eval loss {100 * (value - base) / base:+.2f}% relative")
    a, b = fp32.get("activations") or {}, compressed.get("activations") or {}
    if a.get("stored_bytes") and b.get("stored_bytes"):
        parts.append(f"activations {a['stored_bytes'] / b['stored_bytes']:.1f}x smaller")
    if fp32.get("peak_rss_bytes") and compressed.get("peak_rss_bytes"):
        parts.append(f"peak RSS x{compressed['peak_rss_bytes'] / fp32['peak_rss_bytes']:.2f}")
        growth = [run["peak_rss_bytes"] - run.get("start_rss_bytes", 0) for run in (fp32, compressed)]
        if growth[0] > 0 and growth[1] > 0:
            parts.append(f"RSS growth in training x{growth[1] / growth[0]:.2f}")
    if fp32.get("median_step_seconds") and compressed.get("median_step_seconds"):
        parts.append(f"step time x{compressed['median_step_seconds'] / fp32['median_step_seconds']:.2f}")
    against = "DAF vs fp32" + _allocator_label(fp32)
    return f"{against}: " + ", ".join(parts) if parts else f"{against}: nothing to compare"
