"""The README's first command: ``pageserve generate "…"`` prints a chat reply."""
import pytest

from pageserve.cli import main


def test_generate_prints_a_reply_and_its_stats(capsys):
    assert main(["generate", "What is the capital of France?", "--max-tokens", "8", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out  # SmolLM2-135M-Instruct answers this one greedily
    assert "new tokens" in captured.err and "tok/s" in captured.err  # the stats line goes to stderr


def test_generate_rejects_an_unknown_model_with_a_clear_error(capsys):
    with pytest.raises((ValueError, SystemExit, FileNotFoundError)) as e:
        main(["generate", "hi", "--model", "no-such-model-anywhere", "--device", "cpu"])
    if isinstance(e.value, SystemExit):
        assert e.value.code != 0
        assert "no-such-model-anywhere" in capsys.readouterr().err
    else:
        assert "no-such-model-anywhere" in str(e.value)
