"""Writing a command's report: OUTPUT (JSON), OUTPUT.md and plots, each written atomically."""
from __future__ import annotations

import json
from pathlib import Path

import click


def write_report(output: Path, payload: dict, table: str, make_plots, printed: dict, as_json: bool,
                 timing: str) -> None:
    """Write OUTPUT (JSON), OUTPUT.md and the plots (make_plots(stem) -> paths), all atomically
    written, then print `printed` as JSON or the table and what was written."""
    from snapcompile.atomic import write_json_atomic, write_text_atomic
    stem = output.with_suffix("")
    write_json_atomic(output, payload)
    write_text_atomic(stem.with_suffix(".md"), table)
    pictures = make_plots(stem)
    if as_json:
        click.echo(json.dumps(printed))
        return
    click.echo(table)
    click.echo(f"wrote {output}, {stem.with_suffix('.md')}, {', '.join(map(str, pictures))} ({timing})")
