"""Before/after: one benchmark script from two revisions, interleaved in one run.

    python benchmarks/before_after.py --base 58ce7e0 benchmarks/bench_core.py --quick

checks ``--base`` out into a temporary git worktree, then runs the benchmark
from that tree and from this one in turn (A B A B ..., ``--repeats`` times
each, each run in its own process with ``PYTHONPATH`` pointing at its tree),
so both sides see the same machine load. Every output line ``label: NUMBER
UNIT ...`` is a figure (under the latest ``[section]`` heading), and so is a
``ratio N`` on it (the benchmark's own ratio to a baseline of the same run,
which cancels most of the machine's drift); the script prints the median and the
minimum of each side and the ratios after/before of both, turned so that
above 1 means faster now (times in s/ms/us are inverted).

``--same-script`` runs this tree's copy of the benchmark against both trees'
code (only ``PYTHONPATH`` differs): for a benchmark the base revision lacks
or measures otherwise. The script must then call only what both trees have.

    python benchmarks/before_after.py --base e08bd75 --same-script \
        benchmarks/bench_core.py --only read
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
_FIGURE = re.compile(r"^\s*(?P<label>[^:\[]+?)\s*:\s*(?:[A-Za-z]+\s+)?"
                     r"(?P<value>[-+]?\d+(?:\.\d+)?)\s*(?P<unit>[A-Za-zµ/%]+)?")
_RATIO = re.compile(r"\bratio\s+(?P<value>\d+(?:\.\d+)?)")
_SECTION = re.compile(r"^\s*\[(?P<name>[^\]]+)\]")
# "before 0.87 (0.36)  after 0.54": a word, then its number.
_NAMED = re.compile(r"(?:(?<=\s)|^)(?P<name>[A-Za-z_]+)\s+(?P<value>[-+]?\d+(?:\.\d+)?)\b")
_TIMES = {"s", "ms", "us", "µs", "ns"}
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_STAT = re.compile(r"p\d+|min|max|mean|median")


def figures(output: str) -> dict[str, tuple[float, str]]:
    """``{"[section] label": (value, unit)}`` of every figure line in ``output``.

    A line indented deeper than the figure line before it is a detail of that
    line: its label is prefixed with the outer one ("consecutive block table /
    to_chunks"). A figure line naming several values (``to_chunks: before 0.87
    after 0.54``) gives one figure per name. What follows a ``[section]`` heading
    on its line describes the section ("16 chunks of 32 MiB"): only a ``label:
    value`` figure there is one.
    """
    found: dict[str, tuple[float, str]] = {}
    section = section_unit = ""
    outer: list[tuple[int, str]] = []  # (indent, label) of the enclosing figure lines
    for line in output.splitlines():
        head = _SECTION.match(line)
        if head:
            section, outer = head["name"], []
            line = line[head.end():]
            words = line.split()
            section_unit = words[0] if words and words[0] in _TIMES else ""
        indent = len(line) - len(line.lstrip())
        while outer and outer[-1][0] >= indent:
            outer.pop()
        match = _FIGURE.match(line)
        if match:
            label = " / ".join([*(o[1] for o in outer), match["label"]])
            outer.append((indent, match["label"]))
            key = f"[{section}] {label}" if section else label
            rest = line[line.index(":", match.start()) + 1:]
            named = [(n, v) for n, v in _NAMED.findall(rest) if n != "ratio"]
            if len(named) > 1:  # values in the section's unit
                for name, value in named:
                    found.setdefault(f"{key} {name}", (float(value), section_unit))
            else:
                found.setdefault(key, (float(match["value"]), match["unit"] or ""))
            ratio = _RATIO.search(line, match.end())
            if ratio:
                found.setdefault(f"{key} (ratio)", (float(ratio["value"]), "x"))
        elif head:  # the rest of a heading: its numbers describe the section
            continue
        elif (ratio := _RATIO.search(line)) is not None:  # "what ... ratio N" alone
            label = " ".join(line[:ratio.start()].split()[:6])
            key = f"[{section}] {label}" if section else label
            found.setdefault(f"{key} (ratio)", (float(ratio["value"]), "x"))
        else:  # a table row or "label p50 N ms p99 N ms": each number after the label
            for key, value, unit in _row(line):
                found.setdefault(f"[{section}] {key}" if section else key, (value, unit))
    return found


def _row(line: str) -> list[tuple[str, float, str]]:
    words = line.split()
    first = next((i for i, w in enumerate(words)
                  if _NUMBER.fullmatch(w) or _STAT.fullmatch(w)), None)
    if not first:  # no label, or no number
        return []
    label, out, name = " ".join(words[:first]), [], ""
    for i, word in enumerate(words[first:]):
        if _NUMBER.fullmatch(word):
            following = words[first + i + 1] if first + i + 1 < len(words) else ""
            unit = following if following in _TIMES else ""
            out.append((f"{label} {name or '#' + str(len(out) + 1)}", float(word), unit))
            name = ""
        elif _STAT.fullmatch(word):
            name = word
    return out


def run(tree: Path, script: Path, args: list[str]) -> str:
    """``script``'s output, run with ``tree``'s code first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree), str(tree / "kernels"), str(tree / "plugins" / "lmkv-redis"),
         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{script} failed in {tree}:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side")
    parser.add_argument("--same-script", action="store_true",
                        help="run this tree's copy of the script against both trees' code")
    parser.add_argument("script", help="the benchmark, relative to the repository root")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lmkv-before-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(HERE), "worktree", "add", "-q", "--detach", str(base),
                        args.base], check=True)
        try:
            for ext in (HERE / "lmkv" / "_ext").glob("*.so"):  # the optional C accelerator
                shutil.copy(ext, base / "lmkv" / "_ext" / ext.name)
            sides: dict[str, list[dict[str, tuple[float, str]]]] = {"before": [], "after": []}
            for i in range(args.repeats):
                for name, tree in (("before", base), ("after", HERE)):
                    print(f"run {i + 1}/{args.repeats}: {name}", file=sys.stderr, flush=True)
                    script = (HERE if args.same_script else tree) / args.script
                    sides[name].append(figures(run(tree, script, args.args)))
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(base)],
                           check=False)
    script = "this tree's " + args.script if args.same_script else args.script
    print(f"{script} {' '.join(args.args)}: {args.base} (before) against the work tree "
          f"(after), {args.repeats} interleaved runs each")
    width = max([len(k) for k in sides["after"][0]] + [6])
    print(f"{'figure':{width}s} {'before':>10s} {'after':>10s}  after/before (>1: faster): "
          "of the medians, of the best (min for times, max otherwise)")
    for key, (_, unit) in sides["after"][0].items():
        before = [run_[key][0] for run_ in sides["before"] if key in run_]
        after = [run_[key][0] for run_ in sides["after"] if key in run_]
        if not before or not after:
            continue
        b, a = statistics.median(before), statistics.median(after)
        best = min if unit in _TIMES else max
        b_best, a_best = best(before), best(after)
        if not a or not b or not a_best or not b_best:
            continue
        ratio = b / a if unit in _TIMES else a / b
        ratio_best = b_best / a_best if unit in _TIMES else a_best / b_best
        print(f"{key:{width}s} {b:10.3f} {a:10.3f}  {ratio:5.2f} {ratio_best:5.2f}  {unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
