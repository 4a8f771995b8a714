"""mkdocs hook: the CLI reference's help texts, generated from the typer app at build time.

`docs/reference/cli.md` holds the marker below; each build replaces it with `conveyor --help`
and every command's `--help` as the installed app prints them, so the page cannot drift
from the tool. Run by mkdocs (`hooks:` in mkdocs.yml); ``python docs/gen_cli.py`` prints it.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- cli-help -->"


def _helps(command: Any, context: Any) -> list[tuple[str, str]]:
    """``(command path, its --help)`` for ``command`` and, depth first, every command under it.

    Duck-typed and with the command's own context class: typer vendors its own click.
    """
    found = [(context.command_path, command.get_help(context).rstrip())]
    for name in command.list_commands(context) if hasattr(command, "list_commands") else []:
        sub = command.get_command(context, name)
        if sub is not None and not sub.hidden:
            found += _helps(sub, sub.context_class(sub, info_name=name, parent=context))
    return found


def cli_markdown() -> str:
    """One section per command: its name as a heading and its ``--help`` in a code block."""
    import typer

    from conveyor.cli.app import app

    root = typer.main.get_command(app)
    context = root.context_class(root, info_name="conveyor", terminal_width=100, max_content_width=100)
    return "\n".join(f"### `{path}`\n\n```text\n$ {path} --help\n{text}\n```\n"
                     for path, text in _helps(root, context))


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs' hook: fill the marker of the CLI reference."""
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_markdown())
    return markdown


if __name__ == "__main__":
    print(cli_markdown())
