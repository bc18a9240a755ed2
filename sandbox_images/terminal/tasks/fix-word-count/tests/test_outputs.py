import subprocess
from pathlib import Path

DATA = Path(__file__).with_name("data")


def run(path, n):
    done = subprocess.run(
        ["python3", "/app/wordfreq.py", str(path), str(n)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [line.split() for line in done.stdout.splitlines() if line.strip()]


def test_example():
    assert run("/app/example.txt", 3) == [["the", "4"], ["saw", "3"], ["bird", "2"]]


def test_hidden_text():
    assert run(DATA / "hidden.txt", 4) == [["apple", "4"], ["banana", "3"], ["grape", "3"], ["cherry", "2"]]


def test_n_larger_than_vocabulary(tmp_path):
    text = tmp_path / "two.txt"
    text.write_text("b a B")
    assert run(text, 10) == [["b", "2"], ["a", "1"]]
