#!/usr/bin/env python3
"""Run mypy over the tree and hold it to a baseline that may only shrink.

mypy checks what ``[tool.mypy]`` in pyproject.toml names. The errors the code
had when typing was first checked are listed in ``scripts/mypy-baseline.txt``,
one per line as ``path: code: message`` (no line numbers: the list does not
move when unrelated lines do). This script fails when mypy reports an error the
baseline does not hold; when errors the baseline holds are gone, it says so and
``--update`` writes the shorter list (it never adds an error: fix a new one, or
silence it with ``# type: ignore[code]`` and a comment saying why; it writes
the first list only where there is none).

    .venv/bin/python scripts/typecheck.py            # check (CI runs this)
    .venv/bin/python scripts/typecheck.py --update   # shrink the baseline
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "scripts/mypy-baseline.txt"
HEADER = """\
# mypy errors this tree still has (scripts/typecheck.py): it may only shrink.
# One error per line, "path: code: message"; a line repeated is an error repeated.
"""

_ERROR = re.compile(r"^(?P<path>[^:\s][^:]*):\d+(?::\d+)?: error: (?P<message>.*?)"
                    r"(?:  \[(?P<code>[a-z0-9-]+)\])?$")
# Line numbers inside a message ("already defined on line 490") move with edits.
_LINE_REF = re.compile(r"\bline \d+\b")


def entries(output: str) -> list[tuple[str, str]]:
    """mypy's ``error:`` lines, each as ``(path: code: message, the line itself)``
    (notes are left out)."""
    found = []
    for line in output.splitlines():
        match = _ERROR.match(line.rstrip())
        if match:
            message = _LINE_REF.sub("line N", match["message"])
            found.append((f"{match['path']}: {match['code'] or 'misc'}: {message}", line))
    return found


def parse(output: str) -> Counter[str]:
    """mypy's errors as a multiset of ``path: code: message``."""
    return Counter(entry for entry, _ in entries(output))


def read_baseline(path: Path) -> Counter[str]:
    if not path.exists():
        return Counter()
    lines = path.read_text(encoding="utf-8").splitlines()
    return Counter(line for line in lines if line.strip() and not line.startswith("#"))


def write_baseline(path: Path, errors: Counter[str]) -> None:
    lines = sorted(errors.elements())
    path.write_text(HEADER + "".join(f"{line}\n" for line in lines), encoding="utf-8")


def run_mypy(root: Path, extra: list[str]) -> tuple[int, str]:
    command = [sys.executable, "-m", "mypy", "--no-pretty", "--no-error-summary",
               "--show-error-codes", "--no-color-output", *extra]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
    return done.returncode, done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true",
                        help="write the baseline without the errors that are gone")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the project to check (its pyproject.toml configures mypy)")
    parser.add_argument("--baseline", default=BASELINE,
                        help=f"baseline file, relative to --root (default {BASELINE})")
    parser.add_argument("mypy_args", nargs="*", help="more arguments for mypy (after --)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    baseline_path = root / args.baseline

    status, output = run_mypy(root, args.mypy_args)
    if status not in (0, 1):  # 2: mypy could not run (bad config, crash)
        print(output, end="")
        print(f"typecheck: mypy stopped with status {status}", file=sys.stderr)
        return 2
    current = parse(output)
    if args.update and not baseline_path.exists():
        write_baseline(baseline_path, current)
        print(f"typecheck: {args.baseline} lists {sum(current.values())} error(s)")
        return 0
    baseline = read_baseline(baseline_path)
    new, gone = current - baseline, baseline - current

    if new:
        print(f"typecheck: {sum(new.values())} mypy error(s) not in {args.baseline}:")
        left = Counter(new)
        for entry, line in entries(output):
            if left[entry] > 0:  # where an error repeats, the baseline holds some of them
                left[entry] -= 1
                print(f"  {line}")
        print("Fix them (the baseline only shrinks); where a check is wrong, add "
              "`# type: ignore[code]` with a comment saying why.")
        if args.update:
            print("typecheck: --update never adds an error to the baseline", file=sys.stderr)
        return 1
    if gone and args.update:
        write_baseline(baseline_path, current)
        print(f"typecheck: {args.baseline} shrank by {sum(gone.values())} "
              f"to {sum(current.values())} error(s)")
    elif gone:
        print(f"typecheck: {sum(gone.values())} error(s) of {args.baseline} are gone; "
              "shrink it: python scripts/typecheck.py --update")
        for line in sorted(gone.elements()):
            print(f"  {line}")
    print(f"typecheck: ok, {sum(current.values())} known error(s), none new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
