"""Option helpers shared by the commands: comma-separated lists, and the options of the
commands that write a report (`eval`, `bench`)."""
from __future__ import annotations

import math
from pathlib import Path

import click

from snapcompile.config import DEFAULT_SESSION_KEEP, SESSION_KEEP, PolicyConfig
from snapcompile.serve.partitions import SERVE_SHARING, SESSION_SHARING


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


class FiniteRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (nan passes every bound check)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


SESSION_CACHE_HELP = ("Keep finished conversations' caches in host memory up to this size (bytes, or with KiB / "
                      "MiB / GiB, or decimal kB / MB / GB), so that a request beginning with one (a chat client "
                      "resending its history, a shared document or system prompt) prefills only what is new. "
                      "'auto': an eighth of the memory available once the artifact is loaded; 0: off.")


def parse_session_cache(ctx, param, value):
    """A click callback: "auto" -> None (sized at load), "512MiB" / "2GiB" / "2GB" / "1000000" -> bytes
    (pydantic's ByteSize: KiB / MiB / GiB binary, kB / MB / GB decimal; k / m / g taken as binary)."""
    import psutil
    from pydantic import ByteSize, TypeAdapter, ValidationError
    text = str(value).strip()
    if text.lower() == "auto":
        return None
    if text[-1:].lower() in ("k", "m", "g"):
        text += "iB"
    try:
        size = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        size = -1
    total = psutil.virtual_memory().total
    if not 0 <= size <= total:
        raise click.BadParameter(f"expected 'auto', 0 or a size such as 512MiB, 2GiB or 2GB (at most this machine's "
                                 f"{total / 2**30:.0f} GiB of memory), got {value!r}")
    return size


SESSION_KEEP_HELP = ("What the store keeps of a compressed artifact's conversation. 'full' (the default, exact): "
                     "every prompt row, as a dense prefix cache does (memory grows with the conversation, which must "
                     "fit --max-context); a resumed turn prefills the last answer and its own tokens against them and "
                     "re-selects, getting the answer prefilling the whole turn gets. 'slot': the B rows per "
                     "layer (fixed memory, conversations may pass --max-context), at a loss: it kept 23 of the 39 "
                     "later answers that prefilling every turn whole got on held-out conversations. 'quantized': the "
                     "B rows in 8 bits and the dropped rows in 4, which a resumed turn's last tokens attend over (at "
                     "most the bytes of B float32 rows): also 23 of 39. Figures: docs/results/conversations.md.")


SESSION_SHARING_AUTO_HELP = ("auto (the default): shared when the server listens on loopback without --api-key "
                             "(one user's local server), else private; said at start. ")
SESSION_SHARING_HELP = ("Who shares kept caches when a request carries neither a cache_salt nor the API key: "
                      "private, nobody (such a request is neither resumed nor kept); shared, every such client (a "
                      "client can then learn how much of its prompt another's began with, through cached_tokens and "
                      "the time to first token: for one user or mutually trusting ones). Requests with the same "
                      "cache_salt always share; so do the holders of the API key.")


def session_cache_option(sharing: bool = False, auto: bool = False):
    """--session-cache-bytes and --session-keep (the engine's session store), and with `sharing` the
    --session-sharing of a server (who shares its partitions of kept caches; `auto`: serve's choices,
    auto the default)."""
    options = [click.option("--session-cache-bytes", "session_cache_bytes", default="auto", show_default=True,
                            callback=parse_session_cache, help=SESSION_CACHE_HELP),
               click.option("--session-keep", type=click.Choice(SESSION_KEEP), default=DEFAULT_SESSION_KEEP,
                            show_default=True, help=SESSION_KEEP_HELP)]
    if sharing:
        choices = SERVE_SHARING if auto else SESSION_SHARING
        options.append(click.option("--session-sharing", "--session-scope", "session_sharing",
                                    type=click.Choice(choices), default=choices[0], show_default=True,
                                    help=(SESSION_SHARING_AUTO_HELP if auto else "") + SESSION_SHARING_HELP))
    return option_group(*options)


def kernel_option():
    """--kernel of the evaluation commands: SnapStream's pooling kernel K."""
    return click.option("--kernel", default=config_default(PolicyConfig, "kernel"), show_default=True,
                        type=click.IntRange(min=1), help="SnapStream's pooling kernel K (odd); 31 spans a whole "
                        "fact line (docs/results/conversations.md).")
