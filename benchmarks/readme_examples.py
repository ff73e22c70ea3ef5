"""The example outputs of README.md and docs/guide.md, regenerated from the commands they show.

An example is a ``` block whose paragraph just above starts with a command in backticks, `shardscope ...` (the
block is that command's standard output), or a ``` block whose first line is `$ shardscope ...` (the lines after it
are). Run: .venv/bin/python benchmarks/readme_examples.py [--check] [--only CMD] [--document NAME] rewrites every
example in place (each command runs in a fresh process in a temporary folder, so files it writes go nowhere;
torch-using ones included), or with --check prints which ones differ and exits 1; --document guide.md rewrites
only that file. tests/cli/test_readme_examples.py holds the torch-free ones equal to what the commands print now.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCUMENTS = (README, REPO / "docs" / "guide.md")
FENCE = "```"
# The one field of a human output that is a wall-clock reading: plan's "searched ... in 0.19 s".
SUBCOMMAND = re.compile(r"\bshardscope\s+([a-z]+)")
ELAPSED = re.compile(r"(?<=, in )\d+\.\d+(?= s; ranked by)")


@dataclass(frozen=True, slots=True)
class Example:
    """One example: the command, and where its output block's lines are in the README (start inclusive, end not)."""

    command: str
    """The command line as shown: `shardscope ...`, or a shell line that runs shardscope (a loop, a pipe into jq)."""
    start: int
    """Index of the block's first output line (the line after the opening fence)."""
    end: int
    """Index of the closing fence."""

    @property
    def shell(self) -> bool:
        """The example is a shell line (run by bash with `shardscope` defined as this Python's module)."""
        return not self.command.startswith("shardscope ")

    @property
    def argv(self) -> list[str]:
        """The arguments after `shardscope` (of a plain example)."""
        return shlex.split(self.command)[1:]

    @property
    def subcommand(self) -> str:
        """The shardscope command the example runs, e.g. estimate."""
        match = SUBCOMMAND.search(self.command)
        return match.group(1) if match else ""


def find_examples(lines: list[str]) -> list[Example]:
    """Every ``` block (without a language) whose preceding paragraph starts with `shardscope ...` in backticks, or
    whose first line is `$ ...` running shardscope."""
    examples = []
    index = 0
    while index < len(lines):
        if not lines[index].startswith(FENCE):  # an opening fence may name a language (```python)
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == FENCE)
        above = index - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        while above > 0 and lines[above - 1].strip():
            above -= 1  # to the first line of the paragraph
        match = re.match(r"`(shardscope [^`]+)`", lines[above]) if above >= 0 else None
        prompt = index + 1 < end and lines[index + 1].startswith("$ ") and "shardscope " in lines[index + 1]
        if prompt and lines[index].strip() == FENCE:
            examples.append(Example(command=lines[index + 1][2:], start=index + 2, end=end))
        elif match and lines[index].strip() == FENCE:
            examples.append(Example(command=match.group(1), start=index + 1, end=end))
        index = end + 1
    return examples


def printed(example: Example) -> str:
    """What the command prints on standard output now, in a fresh process started in the repository (examples name
    files of tests/data), with a temporary directory of its own for anything it writes there."""
    with tempfile.TemporaryDirectory(prefix="shardscope-examples-") as folder:
        define = f'shardscope() {{ {shlex.quote(sys.executable)} -m shardscope "$@"; }}; '
        command = ["bash", "-c", define + example.command] if example.shell else [sys.executable, "-m", "shardscope"]
        result = subprocess.run(
            command if example.shell else [*command, *example.argv],
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
            cwd=REPO,
            env=dict(os.environ, TMPDIR=folder),
        )
    if result.returncode != 0:
        raise SystemExit(f"{example.command} exited {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def block(lines: list[str], example: Example) -> str:
    """The README's output block of an example, as the command would print it."""
    return "".join(line + "\n" for line in lines[example.start : example.end])


def without_elapsed(text: str) -> str:
    """The output with its wall-clock reading masked, for comparing two runs."""
    return ELAPSED.sub("N", text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which examples differ; exit 1 if any")
    parser.add_argument("--only", metavar="COMMAND", help="only the examples of this subcommand, e.g. estimate")
    parser.add_argument(
        "--document", metavar="NAME", choices=[path.name for path in DOCUMENTS], help="only this file, e.g. guide.md"
    )
    args = parser.parse_args()
    changed = 0
    for document in DOCUMENTS:
        if args.document and document.name != args.document:
            continue
        lines = document.read_text(encoding="utf-8").splitlines()
        for example in reversed(find_examples(lines)):  # from the end, so earlier indices stay valid
            if args.only and example.subcommand != args.only:
                continue
            now = printed(example)
            if without_elapsed(now) == without_elapsed(block(lines, example)):
                continue
            changed += 1
            print(f"{'differs' if args.check else 'updated'}: {document.name}: {example.command}")
            lines[example.start : example.end] = now.rstrip("\n").split("\n")
        if not args.check:
            document.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{changed} example(s) {'differ' if args.check else 'rewritten'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
