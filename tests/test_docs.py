"""The documentation site builds in strict mode, and its reference pages cover the code.

``mkdocs build --strict`` fails on a broken link, a link to a missing anchor, a page left out of
the navigation or a warning of the API generator (``mkdocs.yml`` ``validation``), so running it
here makes the docs build part of the suite. The generated pages are then checked against the
code they describe: every command and option of the real parser, every report key, every
exported metric and every cache event kind.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.cli import build_parser
from hybridkv.replay.report import OPTIONAL_KEYS, REPORT_KEYS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 300          # the build takes seconds; the bound only stops a hung build


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("hybridkv",)):
    """``(command path, parser)`` for the root and every subcommand, depth first."""
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _text(html: str) -> str:
    """Visible text of an HTML page (tags dropped, the few entities the pages use decoded)."""
    text = re.sub(r"<[^>]+>", "", html)
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    warnings = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(warnings or [done.stderr[-4000:]])
    return out


def test_site_builds_in_strict_mode_with_every_nav_page(site):
    nav_pages = re.findall(r":\s*([\w/-]+)\.md\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert "index" in nav_pages and "reference/cli" in nav_pages
    for page in nav_pages:
        built = site / ("index.html" if page == "index" else f"{page.removesuffix('/index')}/index.html")
        assert built.is_file(), f"docs/{page}.md was not built ({built})"


def test_cli_page_lists_every_command_and_option_of_the_real_parser(site):
    page = _text((site / "reference" / "cli" / "index.html").read_text())
    commands = list(_commands(build_parser()))
    assert len(commands) >= 10
    for path, parser in commands:
        assert path in page, f"the CLI reference does not mention {path!r}"
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert flag in page, f"the CLI reference does not mention {path} {flag}"
    assert "<!-- hybridkv:cli-reference -->" not in page


def test_report_page_lists_every_report_key(site):
    page = _text((site / "reference" / "report" / "index.html").read_text())
    for key in (*REPORT_KEYS, *OPTIONAL_KEYS):
        assert re.search(rf"\b{key}\b", page), f"the report reference does not describe {key!r}"


def test_api_page_renders_the_public_api(site):
    page = _text((site / "reference" / "api" / "index.html").read_text())
    for name in ("hybridkv.api.LLM", "hybridkv.api.GenerationOutput", "hybridkv.engine.build.build_engine",
                 "hybridkv.cache.config.CacheConfig", "hybridkv.store.url.open_store"):
        assert name in page, f"the API reference does not render {name}"
    assert "generate" in page and "reused_tokens" in page


def test_metrics_page_names_every_exported_metric():
    """Every metric family a server exports (with a snapshot of every kind of figure) is named
    on docs/reference/metrics.md, counters with their ``_total`` sample name."""
    from prometheus_client import generate_latest

    from hybridkv.serve.metrics import ServeMetrics, _COUNTER_HELP, _TIER_HELP

    metrics = ServeMetrics()
    metrics.set_snapshot({"counters": {name: 0 for name in _COUNTER_HELP}, "checkpoints_created": {"branch": 1},
                          "tiers": {"device": {key: 0 for key in _TIER_HELP}},
                          "misses": {"store": {"absent": 0}}, "queue_depth": 0, "running": 0,
                          "hit_rates": {"token": 0.0, "request": 0.0, "byte": 0.0}})
    exposition = generate_latest(metrics.registry).decode()
    families = re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M)
    assert len(families) >= 30
    doc = (DOCS / "reference" / "metrics.md").read_text()
    names = {name for name, _ in families}
    for name, kind in families:
        base = name.removesuffix("_created")
        if kind == "gauge" and base != name and (base in names or f"{base}_total" in names):
            continue                 # the client library's creation time of a histogram or counter
        shown = f"{name.removesuffix('_total')}_total" if kind == "counter" else name
        assert f"`{shown}" in doc, f"docs/reference/metrics.md does not name {shown} ({kind})"


def test_events_page_names_every_event_kind():
    from hybridkv.fleet.events import EventKind

    doc = (DOCS / "reference" / "events.md").read_text()
    for kind in EventKind:
        assert f"`{kind.value}`" in doc, f"docs/reference/events.md does not describe {kind.value}"


README_MAX_LINES = 150


def test_readme_is_short_starts_with_the_two_commands_and_links_existing_docs():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    first_block = re.search(r"```\w*\n(.*?)```", readme, re.S).group(1)
    assert first_block.splitlines()[0].startswith("bash scripts/replay.sh")
    assert first_block.splitlines()[1].startswith("bash scripts/test.sh")
    for target in re.findall(r"\]\(((?:docs/)[^)#\s]+)", readme):
        assert (ROOT / target).exists(), f"README.md links {target}, which does not exist"
    history = re.findall(r"\bissue \d+|\brounds?\b(?!-)|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", readme)
    assert not history, f"README.md carries development history: {history}"


def test_every_docs_page_cited_in_code_exists():
    """Docstrings, help texts, error messages, benchmarks and scripts cite pages as ``docs/<path>.md``;
    each must be a page of the site."""
    cited = {}
    for root in ("src", "benchmarks", "scripts"):
        for path in (ROOT / root).rglob("*"):
            if path.suffix in (".py", ".sh") and path.is_file():
                for page in re.findall(r"docs/[\w./-]+?\.md\b", path.read_text(errors="replace")):
                    cited.setdefault(page, str(path.relative_to(ROOT)))
    assert len(cited) >= 10, "the code cites almost no page: the pattern is stale"
    missing = {page: where for page, where in cited.items() if not (ROOT / page).is_file()}
    assert not missing, f"pages cited in the code that do not exist (page: first file citing it): {missing}"
