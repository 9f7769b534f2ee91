"""Regenerate the README's results tables from the JSON record in ``results/<hardware>/``.

    python -m pageserve.report            # rewrites the block between the markers in README.md

Only figures that a notebook wrote are shown; nothing here is typed in by hand.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0 or 1e-3 <= abs(v) < 1e6:
            return f"{v:,.4g}" if abs(v) < 10 else f"{v:,.1f}"
        return f"{v:.3g}"
    return str(v)


def render(results_dir: Path = ROOT / "results") -> str:
    lines: list[str] = []
    for hw_dir in sorted(p for p in results_dir.iterdir() if p.is_dir() and p.name != "local"):
        records = [json.loads(p.read_text()) for p in sorted(hw_dir.glob("*.json"))]
        if not records:
            continue
        lines.append(f"### `results/{hw_dir.name}/`\n")
        for rec in records:
            lines.append(
                f"**{rec['notebook']}** — {rec['hardware']}, torch {rec['torch']}, "
                f"{rec['date']}, commit `{rec['git_commit'][:10]}` "
                f"([notebook](results/{hw_dir.name}/{rec['notebook']}.ipynb))\n"
            )
            lines.append("| figure | value |\n|---|---|")
            for k, v in rec["figures"].items():
                lines.append(f"| `{k}` | {_fmt(v)} |")
            lines.append("")
    return "\n".join(lines) if lines else "_No GPU results recorded yet._\n"


def main(argv: list[str] | None = None) -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"README.md has no {BEGIN} … {END} block", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{render()}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
