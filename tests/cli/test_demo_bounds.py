"""Every size flag of ``lmkv demo`` is bounded: past its range, one line naming the
flag and the range, before anything is built."""

from __future__ import annotations

import pytest

from lmkv.cli.commands import main


@pytest.mark.parametrize(("args", "line"), [
    (["--new-tokens", "100000"], "--new-tokens = 100000: must be a positive integer of at "
                                 "most 1024"),
    (["--prompts", "100000"], "--prompts = 100000: must be a positive integer of at most 64"),
    (["--prefix-tokens", "10000000"], "--prefix-tokens = 10000000: must be a positive "
                                      "integer of at most 16384"),
    (["--suffix-tokens", "0"], "--suffix-tokens = 0: must be a positive integer of at most "
                               "16384"),
    (["--seed", "-1"], "--seed = -1: must be an integer from 0 to 4294967295"),
    (["--threads", "100000"], "--threads = 100000: must be a positive integer of at most 256"),
    (["--hidden-size", "1000000"], "--hidden-size = 1000000: must be a positive integer of "
                                   "at most 8192"),
    (["--layers", "100000"], "--layers = 100000: must be a positive integer of at most 128"),
    (["--heads", "1000"], "--heads = 1000: must be a positive integer of at most 128"),
    (["--kv-heads", "1000"], "--kv-heads = 1000: must be a positive integer of at most 128"),
    (["--head-dim", "100000"], "--head-dim = 100000: must be an integer from 2 to 512"),
    (["--intermediate-size", "10000000"], "--intermediate-size = 10000000: must be a "
                                          "positive integer of at most 32768"),
    (["--prefix-tokens", "16000", "--suffix-tokens", "384", "--new-tokens", "8"],
     "--prefix-tokens + --suffix-tokens + --new-tokens = 16392: must be at most 16384 tokens"),
])
def test_a_size_past_its_range_is_one_line(args: list[str], line: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--preset", "tiny", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"lmkv: error: {line}\n"
    assert captured.out == ""


def test_a_model_past_the_parameter_bound_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--hidden-size", "8192", "--layers", "128", "--heads", "64",
                 "--kv-heads", "8", "--head-dim", "128", "--intermediate-size", "32768"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("lmkv: error: the model flags (--hidden-size = 8192, --layers = "
                          "128, --heads = 64, --kv-heads = 8, --head-dim = 128, "
                          "--intermediate-size = 32768) make a Llama of ")
    assert err.endswith("M parameters; the demo builds at most 2,000M\n")
