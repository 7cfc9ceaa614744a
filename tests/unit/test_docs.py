"""The docs a newcomer walks: every page is reachable from the README, every job snippet in
them loads through the spec loader, and every `baton ...` command line in them parses."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from baton import cli
from baton.spec import JobSpec, spec_from_dict
from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FIELDS = {f for f in JobSpec.__dataclass_fields__}


def _blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return [m.group(2) for m in re.finditer(r"(?ms)^```(\w*)\n(.*?)^```", text)
            if m.group(1) in languages]


def test_every_page_is_reachable_from_the_readme():
    readme = (REPO / "README.md").read_text()
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", readme))
    assert linked == {p.name for p in PAGES[1:]}
    for page in PAGES:  # and every link in them leads somewhere, to a heading that exists
        for target in re.findall(r"\]\(((?!https?:)[^)#\s]+)", page.read_text()):
            assert (page.parent / target).exists(), (page.name, target)
        for target, anchor in re.findall(r"\]\(((?!https?:)[^)#\s]*)#([^)\s]+)\)", page.read_text()):
            assert anchor in _anchors(page.parent / target if target else page), (page.name, target, anchor)


def _anchors(page) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    to hyphens."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"(?m)^#+\s+(.*)$", page.read_text())}


SNIPPETS = [(page.name, i, block) for page in PAGES
            for i, block in enumerate(_blocks(page.read_text(), ("yaml",)))]


@pytest.mark.parametrize("page, index, block", SNIPPETS, ids=[f"{p}-{i}" for p, i, _ in SNIPPETS])
def test_every_job_snippet_loads(page, index, block):
    """A snippet whose top-level keys are a job's is loaded as a job (with a name if it has
    none); any other (a Kubernetes manifest, a Prometheus configuration) is valid YAML."""
    raw = yaml.safe_load(block)
    if isinstance(raw, dict) and set(raw) <= FIELDS:
        spec_from_dict({"name": "doc", **raw}, f"{page} snippet {index}")
    else:
        assert raw is not None


def _commands(text: str) -> list[str]:
    lines = []
    for block in _blocks(text, ("", "bash", "sh", "console")):
        for line in block.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("baton "):
                lines.append(line)
    # in prose, a span with a job file is a command line; `baton run` alone names a command
    lines += [c for c in re.findall(r"`(baton [^`]+)`", text) if ".yaml" in c]
    out = []
    for line in lines:
        if not line.isascii():
            continue  # a line of a drawing
        for part in line.split(";"):
            part = re.split(r"\s(?:>|\||&&|#|2>)\s?", part)[0].strip()
            if not part.startswith("baton ") or "[" in part or "..." in part or " or " in part:
                continue  # a synopsis (`baton logs ID [--follow]`), not a command line
            out.append(part)
    return out


COMMANDS = sorted({(page.name, c) for page in PAGES for c in _commands(page.read_text())})


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}: {c}"[:90] for p, c in COMMANDS])
def test_every_command_line_parses(page, command):
    try:
        cli._parser().parse_args(shlex.split(command)[1:])
    except SystemExit as e:
        pytest.fail(f"{page}: {command!r} does not parse (exit {e.code})")
