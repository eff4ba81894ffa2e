"""Help text that reads like the documentation: ``Usage: autofit plan [OPTIONS] MODEL`` (typer writes required
arguments as ``{MODEL}``), no ``<bool>`` type beside flags that take no value (``--json``, ``--help``), and option
names never cut.

rich's option panels squeeze the name column to fit the terminal and end a long name with an ellipsis
(``--min-stored-preci…`` at 80 columns), and piped output is 80 columns unless ``COLUMNS`` says otherwise. Below
:data:`RICH_HELP_COLUMNS` the help is click's plain layout instead, which wraps the descriptions and keeps every
name whole.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import click
from typer.core import TyperCommand, TyperGroup

from autofit.cli.pipes import quiet_closed_pipe

__all__ = ["Command", "Group", "RICH_HELP_COLUMNS", "CONTEXT"]

# -h beside --help, for the group and (click contexts inherit it) every command
CONTEXT = {"help_option_names": ["-h", "--help"]}

RICH_HELP_COLUMNS = 100  # the narrowest width at which `autofit plan --help`'s panels keep every name (96 does)


def _flag_metavars(params) -> None:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # typer.core.TyperOption.display_type_rich shows a metavar, even an empty one, as is


@contextlib.contextmanager
def _layout_for_width(command, ctx) -> Iterator[None]:
    """Typer formats help with click's plain layout when the command's ``rich_markup_mode`` is None: set so while
    the help of a narrow terminal (or pipe) is written."""
    width = ctx.terminal_width or shutil.get_terminal_size().columns  # COLUMNS first, then the terminal, else 80
    mode = command.rich_markup_mode
    if width < RICH_HELP_COLUMNS:
        command.rich_markup_mode = None
    try:
        yield
    finally:
        command.rich_markup_mode = mode


class Command(TyperCommand):
    def collect_usage_pieces(self, ctx) -> list[str]:
        return [piece.strip("{}") for piece in super().collect_usage_pieces(ctx)]

    def get_params(self, ctx):
        params = super().get_params(ctx)
        _flag_metavars(params)
        return params

    def format_help(self, ctx, formatter) -> None:
        with _layout_for_width(self, ctx):
            super().format_help(ctx, formatter)


class Group(TyperGroup):
    def make_context(self, *args, **kwargs):  # --help and click's usage errors print while the context is made
        with quiet_closed_pipe():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with quiet_closed_pipe():
            return super().invoke(ctx)

    def parse_args(self, ctx, args):
        """Bare ``autofit``: the help, exit 0 (click's ``no_args_is_help`` exits 2, and typer's printed nothing)."""
        if not args and not ctx.resilient_parsing:
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit(0)
        return super().parse_args(ctx, args)

    def get_params(self, ctx):
        params = super().get_params(ctx)
        _flag_metavars(params)
        return params

    def format_help(self, ctx, formatter) -> None:
        with _layout_for_width(self, ctx):
            super().format_help(ctx, formatter)
