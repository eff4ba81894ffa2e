"""Help text that reads like the documentation: ``Usage: autofit plan [OPTIONS] MODEL`` (typer writes required
arguments as ``{MODEL}``), and no ``<bool>`` type beside flags that take no value (``--json``, ``--help``)."""

from __future__ import annotations

from typer.core import TyperCommand, TyperGroup

__all__ = ["Command", "Group"]


def _flag_metavars(params) -> None:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # typer.core.TyperOption.display_type_rich shows a metavar, even an empty one, as is


class Command(TyperCommand):
    def collect_usage_pieces(self, ctx) -> list[str]:
        return [piece.strip("{}") for piece in super().collect_usage_pieces(ctx)]

    def get_params(self, ctx):
        params = super().get_params(ctx)
        _flag_metavars(params)
        return params


class Group(TyperGroup):
    def get_params(self, ctx):
        params = super().get_params(ctx)
        _flag_metavars(params)
        return params
