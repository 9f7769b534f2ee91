"""scripts/sweep.py: a 2-point papermill sweep of notebook 02 (tiny, CPU) -> one CSV + one plot."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sweep  # noqa: E402


def test_grid_is_the_product_of_the_lists_and_values_parse_as_json():
    grid = sweep.parse_grid(["A=1,2", "B=x,null"])
    assert grid == {"A": [1, 2], "B": ["x", None]}
    assert sweep.points(grid) == [{"A": 1, "B": "x"}, {"A": 1, "B": None}, {"A": 2, "B": "x"}, {"A": 2, "B": None}]
    assert sweep.point_name({"A": 1, "B": "x"}) == "A=1__B=x"


def test_two_point_sweep_of_notebook_02_writes_a_csv_row_per_point_and_a_plot(tmp_path):
    pytest.importorskip("papermill")
    cmd = [sys.executable, str(ROOT / "scripts" / "sweep.py"), "--notebook", "02_continuous_batching_paged_kv",
           "--grid", "MAX_NUM_BATCHED_TOKENS=64,128", "--set", "MODEL=smollm2-135m", "--set", "NUM_REQUESTS=2",
           "--set", "PROMPT_LEN=8", "--set", "OUTPUT_LEN=2", "--set", "HF_NUM_REQUESTS=1",
           "--set", "HF_SERIAL_NUM_REQUESTS=0", "--set", "NUM_BLOCKS=64", "--plot", "w1_total_tok_s",
           "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert [r["MAX_NUM_BATCHED_TOKENS"] for r in rows] == ["64", "128"]
    assert all(float(r["w1_total_tok_s"]) > 0 and r["error"] == "" for r in rows)
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    assert (tmp_path / "MAX_NUM_BATCHED_TOKENS=64" / "02_continuous_batching_paged_kv.json").exists()


def test_w1_defaults_grid_leaves_max_num_seqs_to_the_engine_at_auto():
    import w1_defaults

    off = {"enable_prefix_caching": False}
    points = w1_defaults.grid("auto,256", "8192,16384")
    assert points == [{"max_num_batched_tokens": 8192, **off}, {"max_num_batched_tokens": 16384, **off},
                      {"max_num_batched_tokens": 8192, "max_num_seqs": 256, **off},
                      {"max_num_batched_tokens": 16384, "max_num_seqs": 256, **off}]
    with pytest.raises(ValueError):
        w1_defaults.grid("many", "8192")
    # the prefix cache's A/B: alternating points, the grid repeated
    assert w1_defaults.grid("auto", "auto", "off,on", repeats=2) == [
        {"enable_prefix_caching": False}, {"enable_prefix_caching": True}] * 2
    with pytest.raises(ValueError):
        w1_defaults.grid("auto", "auto", "yes")


@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_every_parameter_of_a_notebook_is_one_papermill_can_read(notebook):
    # papermill --help-notebook and its parameter check infer names and types from the tagged cell; a
    # line it cannot parse ("=" inside a comment, "A, B = 1, 2") drops out of both, and every run that
    # sets it warns "Passed unknown parameter"
    import ast
    import json
    import logging

    translators = pytest.importorskip("papermill.translators")
    nb = json.loads((ROOT / "notebooks" / notebook).read_text())
    cells = [c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", [])]
    assert len(cells) == 1, f"{notebook}: one cell tagged 'parameters', found {len(cells)}"
    src = "".join(cells[0]["source"])
    assigned = [t.id for node in ast.parse(src).body if isinstance(node, (ast.Assign, ast.AnnAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for t in ast.walk(target) if isinstance(t, ast.Name)]
    logging.disable(logging.WARNING)  # the parser's own "Unable to parse" lines; the names tell here
    try:
        read = [p.name for p in translators.PythonTranslator.inspect({"source": src})]
    finally:
        logging.disable(logging.NOTSET)
    assert read == assigned, f"{notebook}: papermill cannot read {sorted(set(assigned) - set(read))}"
