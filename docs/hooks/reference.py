"""MkDocs hook: reference tables generated from the code at build time, so they cannot go stale.

- ``docs/reference/cli.md``, marker ``<!-- hybridkv:cli-reference -->``: one section per command
  and subcommand of :func:`hybridkv.cli.build_parser` (usage, description, and a table of every
  option with its help and default).
- ``docs/reference/report.md``, marker ``<!-- hybridkv:report-keys -->``: every top-level key of
  the replay's JSON report in order (``REPORT_KEYS``, then ``OPTIONAL_KEYS`` of
  :mod:`hybridkv.replay.report`), each with its description from the ``ReplayReport`` docstring;
  a key the docstring does not describe fails the build.

Neither import needs torch (about a second together).
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

MARKER = "<!-- hybridkv:cli-reference -->"
PAGE = "reference/cli.md"
REPORT_MARKER = "<!-- hybridkv:report-keys -->"
REPORT_PAGE = "reference/report.md"
_SRC = Path(__file__).resolve().parents[2] / "src"
_WIDTH = 100                       # columns of the usage lines (fixed, so the page does not depend on a terminal)


def _inline(text: str) -> str:
    """Help text as Markdown for a table cell: code spans kept; outside them ``<``, ``>``, ``&`` become
    entities and ``* _ \\ [ ]`` are escaped (help is plain text, not markup); pipes are escaped
    everywhere (a pipe would split the cell)."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    out = [p if p.startswith("`") and p.endswith("`") and len(p) > 1
           else re.sub(r"([*_\\\[\]])", r"\\\1", html.escape(p, quote=False)) for p in parts]
    return "".join(out).replace("|", "\\|")


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, width=_WIDTH, max_help_position=40)


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return ""
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    d = action.default
    if d is None or d is argparse.SUPPRESS or d == []:
        return "—"
    if isinstance(d, (list, tuple)):
        d = " ".join(map(str, d))
    return f"`{d}`"


def _option(action: argparse.Action, prog: str) -> str:
    fmt = _formatter(prog)
    if not action.option_strings:
        return f"`{fmt._format_args(action, action.dest)}`"
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{names}`"
    return f"`{names} {fmt._format_args(action, action.dest.upper())}`"


def _help(action: argparse.Action, prog: str) -> str:
    if not action.help or action.help is argparse.SUPPRESS:
        return ""
    return _inline(_formatter(prog)._expand_help(action))


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, sub, helps.get(name, "")) for name, sub in action.choices.items()]
    return out


def _section(parser: argparse.ArgumentParser, path: list[str], level: int) -> list[str]:
    prog = " ".join(path)
    lines = [f"{'#' * level} {prog}", ""]
    if parser.description:
        lines += [_inline(parser.description), ""]
    usage = _formatter(prog)
    usage.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    lines += ["```text", usage.format_help().strip(), "```", ""]
    options = [a for a in parser._actions
               if not isinstance(a, (argparse._SubParsersAction, argparse._HelpAction))]
    if options:
        lines += ["| option | default | meaning |", "|---|---|---|"]
        lines += [f"| {_option(a, prog)} | {_default(a)} | {_help(a, prog)} |" for a in options]
        lines.append("")
    subs = _subcommands(parser)
    if subs:
        lines += ["| command | what it does |", "|---|---|"]
        for name, _, text in subs:
            anchor = "-".join([*path, name]).replace(" ", "-")
            lines.append(f"| [`{prog} {name}`](#{anchor}) | {_inline(text)} |")
        lines.append("")
        for name, sub, _ in subs:
            lines += _section(sub, [*path, name], min(level + 1, 4))
    return lines


def cli_reference() -> str:
    """The generated Markdown of every command of ``hybridkv`` (for the marker of :data:`PAGE`)."""
    if str(_SRC) not in sys.path:
        sys.path.insert(0, str(_SRC))
    from hybridkv.cli import build_parser

    return "\n".join(_section(build_parser(), ["hybridkv"], 2))


def commands() -> list[str]:
    """Every command path of the parser, e.g. ``["hybridkv", "hybridkv replay", "hybridkv cache purge", ...]``."""
    if str(_SRC) not in sys.path:
        sys.path.insert(0, str(_SRC))
    from hybridkv.cli import build_parser

    def walk(parser, path):
        yield " ".join(path)
        for name, sub, _ in _subcommands(parser):
            yield from walk(sub, [*path, name])

    return list(walk(build_parser(), ["hybridkv"]))


def _rst_to_markdown(text: str) -> str:
    """Docstring markup to Markdown: ``:role:`~a.b.c``` -> `` `c` ``, ````x```` -> `` `x` ``."""
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: "`" + (m.group(1).rsplit(".", 1)[-1]
                                                      if m.group(0).split("`")[1].startswith("~")
                                                      else m.group(1)) + "`", text)
    return text.replace("``", "`")


def report_descriptions() -> dict[str, str]:
    """Key -> description, parsed from the ``ReplayReport`` docstring (entries ``name[, name]: text``
    at 4 spaces, continued at 8)."""
    if str(_SRC) not in sys.path:
        sys.path.insert(0, str(_SRC))
    from hybridkv.replay.report import ReplayReport

    entries: list[tuple[list[str], list[str]]] = []
    for line in (ReplayReport.__doc__ or "").splitlines():
        m = re.match(r"^    ([a-z][a-z0-9_]*(?:, [a-z][a-z0-9_]*)*): (.*)$", line)
        if m:
            entries.append((m.group(1).split(", "), [m.group(2)]))
        elif entries and line.startswith("        "):
            entries[-1][1].append(line.strip())
    return {name: " ".join(text) for names, text in entries for name in names}


def report_keys() -> str:
    """The generated Markdown table of every report key (for the marker of :data:`REPORT_PAGE`)."""
    from hybridkv.replay.report import OPTIONAL_KEYS, REPORT_KEYS, TIMED_KEYS

    described = report_descriptions()
    missing = [k for k in (*REPORT_KEYS, *OPTIONAL_KEYS) if k not in described]
    if missing:
        raise ValueError(f"ReplayReport's docstring does not describe report key(s) {', '.join(missing)} "
                         "(src/hybridkv/replay/report.py): describe them there")
    lines = ["| key | written | meaning |", "|---|---|---|"]
    for key in (*REPORT_KEYS, *OPTIONAL_KEYS):
        when = "always" if key in REPORT_KEYS else "`--timed`" if key in TIMED_KEYS else "when set"
        lines.append(f"| `{key}` | {when} | {_inline(_rst_to_markdown(described[key]))} |")
    return "\n".join(lines)


_GENERATED = {PAGE: (MARKER, cli_reference), REPORT_PAGE: (REPORT_MARKER, report_keys)}


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs event: fill the marker of a generated reference page; other pages pass through."""
    if page.file.src_uri not in _GENERATED:
        return markdown
    marker, generate = _GENERATED[page.file.src_uri]
    if marker not in markdown:
        raise ValueError(f"docs/{page.file.src_uri} lost its marker {marker!r}: the generated reference "
                         "has nowhere to go")
    return markdown.replace(marker, generate())


def on_page_content(html_text: str, page, config, files) -> str:
    """MkDocs event: on the API page, drop the Sphinx roles docstrings use (``:class:`` before a
    code span) and the ``~`` that shortens a dotted name, which mkdocstrings shows verbatim."""
    if page.file.src_uri != "reference/api.md":
        return html_text
    html_text = re.sub(r":(?:class|meth|func|mod|data|attr|exc|obj):(<code>)", r"\1", html_text)
    return re.sub(r"<code>~(?:[\w]+\.)*([\w]+)</code>", r"<code>\1</code>", html_text)
