"""Charts attached to Slack messages, as PNG bytes.

matplotlib is imported inside the functions, so the control plane starts without paying
for it, and figures are drawn on the Agg canvas of a plain ``Figure`` (no pyplot): no
display, no global backend switch, no figure registry shared between threads.

The digest's spend chart is :func:`jobs.spend.spend_chart_png`, drawn by the digest job
itself; :func:`digest_chart_png` only hands it over (or draws it when a digest arrives
without one).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

from jobs.outbound.notify import DigestMessage

LOSS_CURVE_FILENAME = "loss-curve.png"
SPEND_CHART_FILENAME = "spend-chart.png"


def loss_curve_png(
    steps: Sequence[int], losses: Sequence[float | None], *, title: str = "Loss"
) -> bytes:
    """The loss against the step, with every NaN or infinite point marked.

    A divergent run is the reason this chart exists, so non-finite losses are not
    dropped: each is drawn as a red cross on the top edge of the plot at its step,
    where the eye finds it. Missing losses (``None``) leave a gap.
    """
    if len(steps) != len(losses):
        raise ValueError(f"{len(steps)} steps but {len(losses)} losses: give one loss per step")
    from matplotlib.figure import Figure

    finite_x: list[float] = []
    finite_y: list[float] = []
    bad_x: list[float] = []
    for step, loss in zip(steps, losses, strict=True):
        if loss is None:
            continue
        if math.isfinite(loss):
            finite_x.append(step)
            finite_y.append(loss)
        else:
            bad_x.append(step)

    fig = Figure(figsize=(6, 3), dpi=100)
    ax = fig.subplots()
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if finite_x:
        ax.plot(finite_x, finite_y, color="#4c72b0", linewidth=1.2, marker=".", markersize=3)
    if bad_x:
        # Blended transform: x in data units, y at the top of the axes whatever the scale.
        ax.scatter(
            bad_x,
            [0.97] * len(bad_x),
            marker="x",
            color="#c44e52",
            s=40,
            transform=ax.get_xaxis_transform(),
            label="NaN / inf",
            zorder=3,
        )
        ax.legend(loc="upper left", fontsize=7)
        if not finite_x:
            ax.set_xlim(min(bad_x) - 1, max(bad_x) + 1)
    if not finite_x and not bad_x:
        ax.text(0.5, 0.5, "no loss reported", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def digest_chart_png(msg: DigestMessage) -> bytes | None:
    """The digest's spend chart: the one it carries, else drawn from its figures."""
    if msg.chart_png:
        return msg.chart_png
    if not msg.figures.get("per_run") and not msg.figures.get("per_day"):
        return None  # nothing to draw
    from jobs.spend import spend_chart_png

    return spend_chart_png(msg.figures)
