"""stability.png: loss and gradient norm over the steps that survived, with every
incident marked where it happened and each rewind drawn back to the step it went to."""

from __future__ import annotations

from pathlib import Path


def plot_stability(metrics: list[dict], incidents: list[dict], out: Path, title: str) -> Path:
    from mixprec.train.metrics import _pyplot  # matplotlib, or one line saying what to install

    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for ax, key, label in ((axes[0], "loss", "training loss"), (axes[1], "grad_norm", "gradient norm")):
        points = [(r["step"], r[key]) for r in metrics if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot(*zip(*points), linewidth=1, label=label)
        marks = [(i["step"], i[key]) for i in incidents if isinstance(i.get(key), (int, float))]
        for i in incidents:  # non-finite values are drawn at the top of the panel
            if not isinstance(i.get(key), (int, float)):
                marks.append((i["step"], max((v for _, v in points), default=1.0)))
        if marks:
            ax.plot(*zip(*marks), "rx", markersize=9, label=f"incident ({len(incidents)})")
        for i in incidents:
            if i.get("rewound_to") is not None:
                ax.axvspan(i["rewound_to"], i["step"], color="orange", alpha=0.15)
        if points and max(v for _, v in points + marks) > 20 * max(min(v for _, v in points), 1e-12):
            ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    rewinds = sum(i.get("rewound_to") is not None for i in incidents)
    axes[0].set_title(f"{title}: {len(incidents)} incidents, {rewinds} rewinds (shaded: steps rewound)")
    axes[1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
