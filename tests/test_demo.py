"""``aiocb demo``: the README's first command, run non-interactively."""

from __future__ import annotations

import argparse
import asyncio
import io
import re

import pytest

from aiocb.__main__ import main
from aiocb.cli.demo import _demo, _fit, _Glyphs, _visible, add_demo_arguments

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_REQUEST_LINE = re.compile(r"^\[(req_\d+)\] (\d+) tokens \((\w+)\), time to first token (\d+) ms: ", re.MULTILINE)


def _summary(out: str) -> dict[str, float]:
    lines = [line for line in out.splitlines() if line.startswith("summary: ")]
    assert len(lines) == 1, out
    fields = dict(pair.split("=", 1) for pair in lines[0].removeprefix("summary: ").split())
    return {key: float(value) for key, value in fields.items()}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    return parser.parse_args(list(argv))


def test_plain_demo_prints_each_request_and_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["demo", "--plain", "--requests", "5", "--concurrency", "2", "--max-new-tokens", "8", "--seed", "3"])
    out = capsys.readouterr().out
    assert status == 0
    assert "\x1b" not in out
    requests = _REQUEST_LINE.findall(out)
    assert sorted(rid for rid, *_ in requests) == [f"req_{i}" for i in range(5)]
    assert all(1 <= int(tokens) <= 8 and reason in ("length", "stop") for _, tokens, reason, _ in requests)
    summary = _summary(out)
    assert summary["requests"] == 5
    assert summary["tokens"] == sum(int(tokens) for _, tokens, *_ in requests)
    assert summary["tokens_per_s"] > 0
    assert 0 < summary["ttft_median_ms"] <= summary["ttft_p90_ms"]
    assert summary["elapsed_s"] > 0
    # Two slots share the steps: fewer steps than tokens means requests were batched.
    assert summary["steps"] < summary["tokens"]


def test_demo_output_is_plain_when_stdout_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "2", "--concurrency", "2", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert _summary(out)["requests"] == 2


def test_more_new_tokens_than_the_context_holds_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--plain", "--requests", "2", "--max-new-tokens", "3000"]) == 2
    error = capsys.readouterr().err
    assert "--max-new-tokens 3000 does not fit the model's context of 1024 tokens" in error, error


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "mps"], "aiocb demo: --device must be cpu, cuda or cuda:N, got 'mps'"),
        (["--device", "meta"], "aiocb demo: --device must be cpu, cuda or cuda:N, got 'meta'"),
        (["--device", "auto"], "aiocb demo: --device must be cpu, cuda or cuda:N, got 'auto'"),
        (["--seed", str(2**64)], f"argument --seed: must be in [-2**63, 2**64), got {2**64}"),
    ],
)
def test_a_bad_device_or_seed_is_one_line_naming_it(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each ran into a traceback: a device torch knows but aiocb does not run on, a seed
    out of range."""
    try:
        status = main(["demo", "--plain", "--requests", "1", *argv])
    except SystemExit as exit:  # (argparse's own refusal)
        status = exit.code
    assert status == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error, error


def test_live_view_redraws_slots_in_place_below_the_finished_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    out = io.StringIO()
    status = asyncio.run(_demo(_args("--requests", "3", "--concurrency", "2", "--max-new-tokens", "6"), out, live=True))
    text = out.getvalue()
    assert status == 0
    assert "\x1b[3F" in text  # moved up over the two slot lines and the footer to redraw them
    assert text.count("\x1b[?25l") == text.count("\x1b[?25h") == 1  # cursor hidden, then shown again
    plain = _ANSI.sub("", text)
    # Each finished request's line stays above the slots, once, however soon a later
    # request took its slot (one that came and went between two frames was never shown).
    assert sorted(rid for rid, *_ in _REQUEST_LINE.findall(plain)) == ["req_0", "req_1", "req_2"]
    assert _summary(plain)["requests"] == 3


def test_visible_text_is_one_line_of_single_cells() -> None:
    glyphs = _Glyphs(newline="⏎", tab="⇥", ellipsis="…", running=">", done="*")
    assert _visible("a\n\tb\x07漢", glyphs) == "a⏎⇥b??"


def test_fit_keeps_the_newest_text() -> None:
    assert _fit("def ", "f(x):", 20, "…") == ("def ", "f(x):")
    assert _fit("def ", "f(x):", 7, "…") == ("… ", "f(x):")
    assert _fit("def ", "abcdefghij", 5, "…") == ("", "…ghij")
