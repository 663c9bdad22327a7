"""PNG plots of `disagg bench serve` reports: TTFT and TPOT CDFs, and each request's TTFT over the run.

Several reports (e.g. a P/D cluster and a unified server under the same load) share the axes, one
colour each. matplotlib is a dev dependency, imported only here and with the Agg backend.
"""

from __future__ import annotations

import numpy as np


def _values_ms(report: dict, key: str) -> np.ndarray:
    """The successful requests' values of `key` (seconds in the report) in ms."""
    per = report["per_request"]
    return np.array([v * 1000.0 for v, ok in zip(per[key], per["ok"]) if ok and v is not None])


def _draw_cdf(ax, report: dict, key: str, colour: str) -> None:
    values = np.sort(_values_ms(report, key))
    if values.size:
        ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", color=colour,
                label=f"{report['label']} (p50 {np.median(values):.0f} ms)")


def _draw_slo(ax, report: dict, key: str) -> None:
    limit_ms = report["slo"].get(f"{key}_ms")
    if limit_ms is not None:
        ax.axvline(limit_ms, color="grey", linestyle="--", linewidth=1, label=f"SLO {limit_ms:g} ms")


def _draw_timeline(ax, report: dict, colour: str) -> None:
    per = report["per_request"]
    pairs = [(s, t * 1000.0) for s, t, ok in zip(per["start_s"], per["ttft_s"], per["ok"]) if ok]
    if pairs:
        starts, ttfts = zip(*pairs)
        ax.plot(starts, ttfts, "o", markersize=3, color=colour, label=report["label"])
    failed = [s for s, ok in zip(per["start_s"], per["ok"]) if not ok]
    if failed:
        ax.plot(failed, [0.0] * len(failed), "x", color=colour, label=f"{report['label']} failed")


def plot_reports(reports: list[dict], path: str) -> None:
    """Write one PNG with three panels (TTFT CDF, TPOT CDF, TTFT by send time) for these reports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tpot, ax_time) = plt.subplots(1, 3, figsize=(15, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, report in enumerate(reports):
        colour = colours[i % len(colours)]
        _draw_cdf(ax_ttft, report, "ttft_s", colour)
        _draw_cdf(ax_tpot, report, "tpot_s", colour)
        _draw_timeline(ax_time, report, colour)
    _draw_slo(ax_ttft, reports[-1], "ttft")
    _draw_slo(ax_tpot, reports[-1], "tpot")
    cfg = reports[-1]["config"]
    fig.suptitle(f"{reports[-1]['model']}: {cfg['num_prompts']} requests, {cfg['input_len']} in / "
                 f"{cfg['output_len']} out, {cfg['request_rate']} req/s")
    for ax, title, xlabel, ylabel in (
        (ax_ttft, "TTFT CDF", "TTFT (ms)", "fraction of requests"),
        (ax_tpot, "TPOT CDF", "TPOT (ms)", "fraction of requests"),
        (ax_time, "TTFT of each request", "sent at (s from start)", "TTFT (ms)"),
    ):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
