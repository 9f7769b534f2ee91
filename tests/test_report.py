"""The README's results tables come from the JSON record, never from typed-in numbers."""
import json

from pageserve.lab import report
from pageserve.lab.results import write_figures


def test_tables_show_exactly_the_figures_a_notebook_wrote(tmp_path):
    hw = tmp_path / "h200"
    write_figures("04_cuda_graphs", {"MODEL": "qwen2.5-3b"}, {"batch1_ms_per_token": 3.25, "extra": 7}, hw)
    out = report.render(tmp_path)
    assert "| batch-1 decode, ms per token | 3.25 | ≤ 2.4 |" in out  # the headline row
    assert "| `extra` | 7 |" in out  # and every figure in the per-notebook table
    assert "W1 total tok/s" not in out  # nothing that no record holds
    rec = json.loads((hw / "04_cuda_graphs.json").read_text())
    assert rec["git_commit"] and rec["hardware"] and rec["parameters"] == {"MODEL": "qwen2.5-3b"}


def test_no_records_says_so(tmp_path):
    assert "No GPU results" in report.render(tmp_path)


def test_provenance_is_read_from_git_unless_the_sender_hands_it_over(tmp_path, monkeypatch):
    import subprocess

    from pageserve.lab import results

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=results.__file__.rsplit("/pageserve/", 1)[0],
                          capture_output=True, text=True).stdout.strip()
    monkeypatch.delenv("PAGESERVE_GIT_COMMIT", raising=False)
    monkeypatch.delenv("PAGESERVE_GIT_DIRTY", raising=False)
    p = results.provenance()
    assert p["git_commit"] == head and p["git_commit_source"] == "git" and isinstance(p["git_dirty"], bool)

    # the GPU machine: its copied tree's .git is stale, so the commit computed where the tree
    # came from wins, and is marked as handed over
    monkeypatch.setenv("PAGESERVE_GIT_COMMIT", "abc1234")
    assert results.provenance() == {"git_commit": "abc1234", "git_dirty": None, "git_commit_source": "env"}
    monkeypatch.setenv("PAGESERVE_GIT_DIRTY", "0")
    assert results.provenance()["git_dirty"] is False
    monkeypatch.setenv("PAGESERVE_GIT_DIRTY", "1")
    assert results.provenance()["git_dirty"] is True
    write_figures("04_cuda_graphs", {}, {"batch1_ms_per_token": 3.0}, tmp_path / "h200")
    assert "handed over in $PAGESERVE_GIT_COMMIT" in report.render(tmp_path)

    def no_git(*args):
        raise FileNotFoundError("git")

    monkeypatch.delenv("PAGESERVE_GIT_COMMIT")
    monkeypatch.setattr(results, "_git", no_git)  # no .git and nothing handed over
    assert results.provenance()["git_commit"] == "unknown"
