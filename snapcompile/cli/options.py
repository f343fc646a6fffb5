"""Option helpers shared by the commands: comma-separated lists, and the options of the
commands that write a report (`eval`, `bench`)."""
from __future__ import annotations

from pathlib import Path

import click


def csv_option(kind):
    """A click callback parsing "a,b,c" into a tuple of `kind`."""
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            return tuple(kind(v.strip()) for v in value.split(",") if v.strip())
        except ValueError:
            raise click.BadParameter(f"expected comma-separated {kind.__name__} values, got {value!r}") from None
    return parse


def option_group(*options):
    """One decorator applying click `options` in the order given (as they appear in --help)."""
    def decorate(func):
        for option in reversed(options):
            func = option(func)
        return func
    return decorate


def report_options(default_output: str, cache_name: str, output_help: str):
    """--cache-dir, -o/--output and --json of a command that builds artifacts and writes a report
    (OUTPUT JSON, the Markdown table and the plots beside it)."""
    return option_group(
        click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
                     help=f"Where built artifacts are kept (default: $SNAPCOMPILE_CACHE/{cache_name})."),
        click.option("-o", "--output", type=click.Path(path_type=Path), default=Path(default_output),
                     show_default=True, help=output_help),
        click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON object."),
    )


def config_default(config_class, name: str):
    """The default of a configuration dataclass's field: the one place a default is stated."""
    return config_class.__dataclass_fields__[name].default
