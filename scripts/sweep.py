"""Run a phase notebook over a parameter grid with papermill; one CSV and one plot of the figures.

    python scripts/sweep.py --notebook 02_continuous_batching_paged_kv \\
        --grid MAX_NUM_BATCHED_TOKENS=256,512 --grid MAX_NUM_SEQS=8,16 \\
        --set MODEL=smollm2-135m --out /tmp/sweep02 [--plot w1_total_tok_s]

Every point of the grid (the product of the ``--grid`` lists) runs into its own folder
``<out>/<point>/`` (executed notebook + its figures JSON, ``RESULTS_DIR`` set to that folder);
``<out>/sweep.csv`` has one row per point: the grid parameters, then every figure the point
wrote; ``<out>/sweep.png`` plots one figure (``--plot``, default the first numeric one) against
the first grid parameter, one line per value of the others. Values are read as JSON where they
parse (``8``, ``true``, ``null``, ``[4, 16]``), else as strings; ``--set`` fixes a parameter for
every point. A point that fails is kept in the CSV with its error.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_grid(items: list[str]) -> dict[str, list]:
    """``["A=1,2", "B=x"]`` -> ``{"A": [1, 2], "B": ["x"]}`` (a value in [...] stays one list)."""
    grid = {}
    for item in items:
        name, _, values = item.partition("=")
        if not name or not values:
            raise ValueError(f"--grid wants NAME=v1,v2,...; got {item!r}")
        if values.strip().startswith("[") and ";" in values:  # lists as values: A=[1,2];[3,4]
            grid[name] = [parse_value(v) for v in values.split(";")]
        else:
            grid[name] = [parse_value(v) for v in values.split(",")]
    return grid


def points(grid: dict[str, list]) -> list[dict]:
    names = list(grid)
    return [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]


def point_name(point: dict) -> str:
    return "__".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}".replace("/", "_").replace(" ", "")
                     for k, v in point.items()) or "default"


def run_point(notebook: str, point: dict, fixed: dict, out: Path, kernel: str | None = None) -> dict:
    import papermill as pm

    folder = out / point_name(point)
    folder.mkdir(parents=True, exist_ok=True)
    params = {**fixed, **point, "RESULTS_DIR": str(folder.resolve())}
    row: dict = dict(point)
    try:
        pm.execute_notebook(str(ROOT / "notebooks" / f"{notebook}.ipynb"), str(folder / f"{notebook}.ipynb"),
                            parameters=params, cwd=str(ROOT / "notebooks"), progress_bar=False, kernel_name=kernel)
        rec = json.loads((folder / f"{notebook}.json").read_text())
        row.update(rec["figures"])
        row["error"] = ""
    except Exception as e:  # noqa: BLE001 - a failed point is a row, the sweep goes on
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return row


def write_csv(rows: list[dict], path: Path) -> None:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()})


def plot(rows: list[dict], grid: dict[str, list], figure: str | None, path: Path) -> str | None:
    """``figure`` against the first grid parameter, one line per combination of the others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(grid)
    numeric = [k for r in rows for k, v in r.items()
               if k not in names and isinstance(v, (int, float)) and not isinstance(v, bool)]
    figure = figure or (numeric[0] if numeric else None)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if figure:
        x = names[0] if names else None
        groups: dict[str, list] = {}
        for r in rows:
            label = ", ".join(f"{n}={r[n]}" for n in names[1:]) or figure
            groups.setdefault(label, []).append(r)
        for label, rs in groups.items():
            xs = [str(r.get(x)) for r in rs] if x else [str(i) for i in range(len(rs))]
            ax.plot(xs, [r.get(figure) for r in rs], marker="o", label=label)
        ax.set_xlabel(x or "point")
        ax.set_ylabel(figure)
        ax.legend(fontsize=7)
    ax.set_title(f"sweep: {figure or 'no numeric figure'}")
    plt.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return figure


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notebook", required=True, help="a name in notebooks/, without .ipynb")
    ap.add_argument("--grid", action="append", default=[], help="NAME=v1,v2,... (repeatable; the product is swept)")
    ap.add_argument("--set", action="append", default=[], help="NAME=value fixed for every point")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", default=None, help="the figure to plot (default: the first numeric one)")
    ap.add_argument("--kernel", default=None, help="Jupyter kernel name (default: the notebook's)")
    a = ap.parse_args(argv)
    grid = parse_grid(a.grid)
    fixed = {k: parse_value(v) for k, _, v in (s.partition("=") for s in a.set)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for p in points(grid):
        rows.append(run_point(a.notebook, p, fixed, out, a.kernel))
        print(f"{point_name(p)}: {rows[-1]['error'] or 'ok'}", flush=True)
    write_csv(rows, out / "sweep.csv")
    shown = plot(rows, grid, a.plot, out / "sweep.png")
    print(f"{len(rows)} points -> {out / 'sweep.csv'}, {out / 'sweep.png'} ({shown})")
    return 0 if all(not r["error"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
