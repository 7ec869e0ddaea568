"""Every table of figures in README.md and BENCHMARKS.md says where its figures come from.

A table whose cells hold numbers must be preceded, inside its section (the text between the nearest heading above
it and the table), by a fenced command block that runs a benchmark or the app, or by the path of a result file
under ``benchmarks/results/`` that exists in the repository; the table may also name that file itself. Every
``benchmarks/results/`` path either document names must exist. So a figure pasted without its command, or one whose
result file was removed or renamed, fails here rather than in a reader's hands.

The parser is deliberately small: ATX headings (``#`` to ``####``), fenced blocks (`````), and tables as runs of
lines starting with ``|``. It does not check that a file holds the figure, only that the reader is told where to
look.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "BENCHMARKS.md")

#: a command that produces figures: a benchmark script or the experiment app
COMMAND = re.compile(r"(?:python\S*\s+(?:-m\s+)?benchmarks/\w+\.py|lightprune-experiment)")
#: a result path as the documents write it (inside backticks or prose); trailing punctuation is not part of it
RESULT_PATH = re.compile(r"benchmarks/results/[\w./*-]*[\w/*-]")
#: a figure in a table cell: a digit (dates and commit hashes aside, every table with a digit in a body cell reports
#: something measured or counted)
FIGURE = re.compile(r"\d")
#: a measured figure in prose: a ratio (``29x``, ``1.5×``) or a percentage with decimals (``95.8%``); settings such
#: as "pruned to 90%" are whole percentages and are not taken for measurements
PROSE_FIGURE = re.compile(r"\b\d+(?:\.\d+)?[x×](?!\w)|\b\d+\.\d+%")


@dataclass(frozen=True)
class Table:
    """A Markdown table: where it starts (1-based line), its heading, and the section text before it."""

    line: int
    heading: str
    before: str
    body: str


def tables(text: str) -> list[Table]:
    """The tables of ``text`` with the text of their section that precedes them.

    Example:
        >>> page = "# A\\n\\n```bash\\npython benchmarks/x.py\\n```\\n\\n| a | b |\\n|---|---|\\n| 1 | 2 |\\n"
        >>> [(t.line, t.heading, "benchmarks/x.py" in t.before, t.body) for t in tables(page)]
        [(7, '# A', True, '| 1 | 2 |')]
    """
    found: list[Table] = []
    heading, section_start = "(top)", 0
    lines = text.splitlines()
    fenced = False
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            heading, section_start = line, index + 1
        elif not fenced and line.startswith("|"):
            end = index
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            body = [row for row in lines[index + 2 : end]]  # header and separator rows left out
            found.append(Table(index + 1, heading, "\n".join(lines[section_start:index]), "\n".join(body)))
            index = end
            continue
        index += 1
    return found


def result_paths(text: str) -> list[str]:
    """The ``benchmarks/results/`` paths named in ``text`` (globs kept as written).

    Example:
        >>> result_paths("see `benchmarks/results/quality/runs/`, and benchmarks/results/export_cpu.json.")
        ['benchmarks/results/quality/runs/', 'benchmarks/results/export_cpu.json']
    """
    return RESULT_PATH.findall(text)


def exists(path: str) -> bool:
    """Whether a result path (a file, a folder, or a glob) names something in the repository."""
    return any(ROOT.glob(path.rstrip("/"))) if "*" in path else (ROOT / path).exists()


def has_command_block(text: str) -> bool:
    """Whether ``text`` holds a fenced block with a command that produces figures.

    Example:
        >>> has_command_block("Run:\\n\\n```bash\\npython benchmarks/engine.py --quick\\n```\\n")
        True
        >>> has_command_block("the script `python benchmarks/engine.py` in prose")
        False
    """
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    return any(COMMAND.search(block) for block in blocks)


def unsourced(text: str) -> list[str]:
    """The tables of figures in ``text`` with neither a command block nor an existing result file in their section.

    Example:
        >>> unsourced("## Speed\\n\\n| model | time |\\n|---|---|\\n| dense | 2.6 s |\\n")
        ['line 3 under ## Speed']
        >>> unsourced("## Speed\\n\\nFrom `benchmarks/results/export_cpu.json`:\\n\\n| a |\\n|---|\\n| 2.6 s |\\n")
        []
    """
    missing = []
    for table in tables(text):
        if not FIGURE.search(table.body):
            continue
        context = table.before + "\n" + table.body
        if has_command_block(table.before) or any(exists(path) for path in result_paths(context)):
            continue
        missing.append(f"line {table.line} under {table.heading}")
    return missing


def paragraphs(text: str) -> list[str]:
    """The blocks of ``text`` between blank lines, a fenced block (blank lines and all) being one.

    Example:
        >>> paragraphs("a\\nb\\n\\n```\\nx\\n\\ny\\n```\\n\\nc")
        ['a\\nb', '```\\nx\\n\\ny\\n```', 'c']
    """
    blocks: list[list[str]] = [[]]
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            if not fenced and blocks[-1]:
                blocks.append([])
            fenced = not fenced
        if not line.strip() and not fenced:
            blocks.append([])
        else:
            blocks[-1].append(line)
    return ["\n".join(block) for block in blocks if block]


def unsourced_paragraphs(text: str) -> list[str]:
    """The paragraphs (blocks between blank lines) of ``text`` with a measured figure but no existing result file in
    them or in the paragraph just before (which introduces a code block that follows it).

    Example:
        >>> unsourced_paragraphs("Fast: 29x torch.\\n\\nOr 7.6x (`benchmarks/results/export_cpu.json`).\\n")
        ['Fast: 29x torch.']
        >>> unsourced_paragraphs("Pruned to 90% on a cubic schedule.\\n")
        []
    """
    blocks = paragraphs(text)
    missing = []
    for index, block in enumerate(blocks):
        if not PROSE_FIGURE.search(block):
            continue
        context = block if index == 0 else blocks[index - 1] + "\n" + block
        if not any(exists(path) for path in result_paths(context)):
            missing.append(block.splitlines()[0])
    return missing


@pytest.mark.parametrize("page", PAGES)
def test_every_table_of_figures_names_its_command_or_result_file(page: str) -> None:
    assert unsourced((ROOT / page).read_text()) == []


def test_every_measured_figure_in_the_readme_names_its_result_file() -> None:
    """The README quotes figures in prose, not tables: each paragraph that does names the file they come from."""
    assert unsourced_paragraphs((ROOT / "README.md").read_text()) == []


@pytest.mark.parametrize("page", PAGES)
def test_every_result_path_named_exists(page: str) -> None:
    text = (ROOT / page).read_text()
    assert [path for path in result_paths(text) if not exists(path)] == []


def test_a_table_whose_command_was_removed_is_caught() -> None:
    """Planted in a copy of BENCHMARKS.md: the first command block of the "Busy machine" section removed."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert unsourced(text) == []
    section = text.index("#### Busy machine")
    block = re.compile(r"```bash\n.*?```\n", flags=re.DOTALL).search(text, section)
    assert block is not None
    planted = text[: block.start()] + text[block.end() :]
    # the section also names its JSON in prose: drop that too, as a figure pasted without provenance would
    planted = planted[:section] + planted[section:].replace("`benchmarks/results/engine_busy.json`", "the JSON", 1)
    assert [entry for entry in unsourced(planted) if "Busy machine" in entry]
