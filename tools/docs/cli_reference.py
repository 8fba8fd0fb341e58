"""Write the command-line reference (every ``dcr`` command and flag) from the argparse parsers.

The site's hook (``tools/docs/hooks.py``) calls :func:`render` at every build, so the page always
matches ``flows/cli``; ``python tools/docs/cli_reference.py [OUT]`` writes it to a file (or stdout)
to read it without building the site.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

HEADER = """# Command-line reference

Generated from the argparse parsers of `flows/cli` (and of the `dcr-bench` commands that plug in
through the `dcr.commands` entry point group) each time the site is built: every command, every
flag, its default and its help text, as `dcr COMMAND --help` prints them. For what the
commands do together, see the [command overview](commands.md); exit codes and error lines are on
the same page.
"""


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _plugin_parser(main) -> argparse.ArgumentParser | None:
    """The parser a plugin's ``main(argv)`` builds: caught when it parses (nothing runs)."""
    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(["--help"])
    except _Captured as caught:
        return caught.parser
    except (SystemExit, Exception):  # noqa: BLE001 - a plugin that cannot be introspected is listed without flags
        return None
    finally:
        argparse.ArgumentParser.parse_args = original
    return None


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def _flags(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{s}`" for s in action.option_strings)
        if action.nargs != 0:
            metavar = action.metavar or (action.dest.upper() if not action.choices else "{" + ",".join(map(str, action.choices)) + "}")
            if isinstance(metavar, tuple):
                metavar = " ".join(metavar)
            names += f" `{metavar}`"
        return names
    metavar = action.metavar or action.dest
    return f"`{metavar if isinstance(metavar, str) else ' '.join(metavar)}`"


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, [], ""):
        return ""
    default = str(action.default)
    if default.startswith(REPO + os.sep):  # a file of the checkout: named from it, not from where this one was built
        default = os.path.relpath(default, REPO)
    return f"`{default}`"


def _render_parser(title: str, parser: argparse.ArgumentParser, level: int, out: list[str]) -> None:
    out.append(f"{'#' * level} `{title}`\n")
    if parser.description:
        out.append(_escape_para(parser.description) + "\n")
    usage = parser.format_usage().strip()
    if usage.startswith("usage: "):
        usage = usage[len("usage: "):].replace("\n" + " " * len("usage: "), "\n")
    out.append("```text\n" + usage + "\n```\n")
    rows = []
    children: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                if child.description is None and helps.get(name):
                    child.description = helps[name]
                children.append((name, child))
            continue
        help_text = action.help if action.help not in (None, argparse.SUPPRESS) else ""
        if help_text and "%(" in help_text:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                help_text = help_text % {**vars(action), "prog": parser.prog, "default": action.default}
        kind = "option" if action.option_strings else "argument"
        rows.append(f"| {_escape(_flags(action))} | {kind} | {_escape(str(help_text))} | {_default(action)} |")
    if rows:
        # the class lets the site's stylesheet keep each flag on one line
        out.append('<div class="cli-flags" markdown>\n\n| flag | kind | help | default |\n|---|---|---|---|\n'
                   + "\n".join(rows) + "\n\n</div>\n")
    for name, child in children:
        _render_parser(f"{title} {name}", child, min(level + 1, 6), out)


def _escape_para(text: str) -> str:
    return text.replace("<", "&lt;").replace(">", "&gt;")


def render() -> str:
    """The whole reference page, as Markdown."""
    os.environ.pop("DCR_ORCHESTRATOR", None)  # its value would show as --orchestrator's default
    os.environ["COLUMNS"] = "80"  # argparse wraps usage and help to the terminal: the same page everywhere
    from flows import cli  # noqa: PLC0415 - imported when the page is built, not when the hook loads

    out = [HEADER]
    top = cli.build_parser()
    out.append("## `dcr`\n")
    out.append(_escape_para(top.description or "") + "\n")
    out.append("```text\n" + top.format_help().strip() + "\n```\n")
    out.append("Common to the bucket commands: `ROOT` is a local path, `file://`, `memory://name`, "
               "`s3://bucket/prefix` or `gs://bucket/prefix`.\n")
    for name in cli.COMMANDS:
        parser = cli.build_parser(name)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        _render_parser(f"dcr {name}", sub.choices[name], 2, out)
    for name, ep in sorted(cli.plugins().items()):
        dist = ep.dist.name if ep.dist else "a plugin"
        parser = _plugin_parser(ep.load())
        if parser is None:
            out.append(f"## `dcr {name}`\n\nFrom `{dist}`; see `dcr {name} --help`.\n")
            continue
        parser.prog = f"dcr {name}"
        out.append(f"<!-- from the {dist} package -->\n")
        _render_parser(f"dcr {name}", parser, 2, out)
        out.append(f"(From the `{dist}` package: `pip install -e ./bench`.)\n")
    return "\n".join(out)


if __name__ == "__main__":
    text = render()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
