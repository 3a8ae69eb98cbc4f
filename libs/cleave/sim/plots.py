"""PNG figures of a report (matplotlib with the Agg backend, imported only here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cleave.errors import ConfigError

COLORS = {
    "cleave": "#d62728",
    "alpa": "#1f77b4",
    "dp_tp": "#9467bd",
    "dtfm": "#2ca02c",
    "asteroid": "#ff7f0e",
    "pipeline": "#8c564b",
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'cleave[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(points: list[dict], model: str, system: str, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for p in points:
        r = p["systems"].get(system)
        if (
            p["model"] == model
            and r is not None
            and r.get(key) is not None
            and (r["feasible"] or key.startswith("unconstrained"))
        ):
            xs.append(p["devices"])
            ys.append(r[key])
    return xs, ys


def _models(points: list[dict]) -> list[str]:
    return list(dict.fromkeys(p["model"] for p in points))


def _systems(points: list[dict]) -> list[str]:
    return list(points[0]["systems"]) if points else []


def step_vs_devices(plt: Any, doc: dict, path: Path) -> None:
    points, models = doc["points"], _models(doc["points"])
    cols = min(2, len(models))
    rows = -(-len(models) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax, model in zip(axes.flat, models, strict=False):
        for s in _systems(points):
            xs, ys = _series(points, model, s, "step_s")
            ax.plot(xs, ys, "o-", color=COLORS.get(s), label=s, lw=2 if s == "cleave" else 1.2)
            if s != "cleave":
                ux, uy = _series(points, model, s, "unconstrained_step_s")
                ax.plot(ux, uy, ":", color=COLORS.get(s), alpha=0.6)
        ax.set(xscale="log", yscale="log", xlabel="devices", ylabel="seconds per batch", title=model)
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=8, title="solid: fits 512 MiB\ndotted: memory ignored", title_fontsize=7)
    for ax in list(axes.flat)[len(models) :]:
        ax.set_visible(False)
    fig.suptitle("Per-batch time against fleet size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def largest_fleet(plt: Any, doc: dict, path: Path) -> None:
    largest = doc["claims"]["largest_fleet"]
    models = list(largest)
    systems = list(next(iter(largest.values()))) if largest else []
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / max(len(systems), 1)
    for i, s in enumerate(systems):
        xs = [m + (i - len(systems) / 2 + 0.5) * width for m in range(len(models))]
        ys = [largest[m][s] for m in models]
        ax.bar(xs, [max(y, 0.8) for y in ys], width, color=COLORS.get(s), label=s)
        for x, y in zip(xs, ys, strict=True):
            if y == 0:
                ax.text(x, 1.0, "none", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set(
        xticks=range(len(models)),
        xticklabels=models,
        yscale="log",
        ylabel="largest fleet it puts to work",
        title="Largest fleet each system can use (512 MiB devices)",
    )
    ax.legend(fontsize=8, ncol=3)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def traffic(plt: Any, doc: dict, path: Path) -> None:
    points, base = doc["points"], doc["spec"]["base"]["model"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    for model in _models(points):
        xs, down = _series(points, model, "cleave", "per_device_down_bytes")
        _, up = _series(points, model, "cleave", "per_device_up_bytes")
        line = a.plot(xs, [d / 1e9 for d in down], "o-", label=f"{model} down")[0]
        a.plot(xs, [u / 1e9 for u in up], "s--", color=line.get_color(), label=f"{model} up")
    a.set(
        xscale="log",
        yscale="log",
        xlabel="devices",
        ylabel="GB per device per batch",
        title="Cleave: per-device traffic as devices join",
    )
    for s in _systems(points):
        xs, ys = _series(points, base, s, "per_device_down_bytes")
        b.plot(
            xs,
            [y / 1e9 for y in ys],
            "o-",
            color=COLORS.get(s),
            label=f"{s} (down = up for peers)" if s != "cleave" else "cleave down",
        )
        if s == "cleave":
            ux, uy = _series(points, base, s, "per_device_up_bytes")
            b.plot(ux, [y / 1e9 for y in uy], "s--", color=COLORS["cleave"], label="cleave up")
    b.set(
        xscale="log",
        yscale="log",
        xlabel="devices",
        ylabel="GB per device per batch",
        title=f"{base}: per-device traffic, systems that fit",
    )
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recovery(plt: Any, doc: dict, path: Path) -> None:
    rec = doc["claims"]["recovery_at_base"]
    base = doc["spec"]["base"]
    names = [s for s in rec if rec[s]["recovery_s"] is not None]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for i, s in enumerate(names):
        r = rec[s]
        ax.bar(
            i,
            r["recovery_s"],
            color=COLORS.get(s),
            hatch=None if r["feasible"] else "//",
            alpha=1.0 if r["feasible"] else 0.5,
        )
        if s == "cleave":
            label = f"{r['recovery_s']:.1f} s" + (f"\nworst {r['worst_s']:.0f} s" if r.get("worst_s") else "")
        else:
            label = f"{r['recovery_s']:.0f} s" + (f"\n{r['vs_cleave']:.0f}x" if r["vs_cleave"] else "")
        ax.text(i, r["recovery_s"], label, ha="center", va="bottom", fontsize=8)
    ax.set(
        xticks=range(len(names)),
        xticklabels=names,
        yscale="log",
        ylabel="seconds from failure to work redone\n(cleave: mean over a step's GEMMs)",
        title=f"Recovery from one device failure: {base['model']}, {base['devices']} devices "
        "(hatched: does not fit, memory ignored)",
    )
    ax.title.set_fontsize(9)
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * 4)  # room for the labels
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def churn(plt: Any, doc: dict, path: Path) -> None:
    base = doc["spec"]["base"]
    fleets = list(dict.fromkeys(r.get("devices", base["devices"]) for r in doc["churn"]))
    fig, axes = plt.subplots(1, len(fleets), figsize=(7 * len(fleets), 4.2), squeeze=False)
    for ax, n in zip(axes.flat, fleets, strict=True):
        rows = [r for r in doc["churn"] if r.get("devices", base["devices"]) == n]
        lines = [("cleave", "step_s", "o-", "cleave (simulated)")]
        for s in _systems(rows)[1:]:
            lines += [
                (s, "step_s_with_churn", "o-", s),
                (s, "unconstrained_step_s_with_churn", "x:", f"{s}, memory ignored"),
            ]
        for s, key, style, label in lines:
            pts = [(r["churn"], r["systems"][s].get(key)) for r in rows if r["systems"][s].get(key) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, color=COLORS.get(s), label=label)
        ax.set(
            xlabel="leaves per device-hour (joins keep the fleet size)",
            ylabel="seconds per batch",
            yscale="log",
            title=f"Per-batch time under churn: {base['model']}, {n} devices",
        )
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(
        fontsize=8,
        title="a line stops where a failure comes\nbefore the last one is recovered",
        title_fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(doc: dict[str, Any], out_dir: Path) -> list[str]:
    """All figures of the report; returns their paths."""
    plt = _pyplot()
    figures = [
        ("step_vs_devices.png", step_vs_devices),
        ("largest_fleet.png", largest_fleet),
        ("traffic_vs_devices.png", traffic),
        ("recovery.png", recovery),
    ]
    if doc.get("churn"):
        figures.append(("churn.png", churn))
    files = []
    for name, fn in figures:
        fn(plt, doc, out_dir / name)
        files.append(str(out_dir / name))
    return files
