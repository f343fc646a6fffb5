"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class SnapcompileError(Exception):
    """A problem with the user's input or environment (bad model, bad flags, missing file).

    The CLI turns it into a one-line message without a traceback; anything else is a bug.
    """


class ParityError(SnapcompileError):
    """A validated artifact disagrees with the PyTorch oracle beyond tolerance."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
