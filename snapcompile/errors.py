"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class SnapcompileError(Exception):
    """A problem with the user's input or environment (bad model, bad flags, missing file).

    The CLI turns it into a one-line message without a traceback; anything else is a bug.
    """


class PromptError(SnapcompileError):
    """A prompt the artifact cannot take: `reason` "empty" or "too_long", with its `tokens` and the
    artifact's `limit` (protocols word it their own way: OpenAI's 400 context_length_exceeded, ...)."""

    def __init__(self, reason: str, tokens: int, limit: int, bound: str = "the artifact's --max-context"):
        self.reason, self.tokens, self.limit = reason, tokens, limit
        super().__init__(f"prompt of {tokens} tokens does not fit: {bound} allows 1..{limit} prompt tokens")


class EngineFailure(SnapcompileError):
    """The engine thread died (a bug, not the user's): the server stopped; exit code 1."""


class ParityError(SnapcompileError):
    """A validated artifact disagrees with the PyTorch oracle beyond tolerance."""


class JsonTooDeep(SnapcompileError):
    """JSON nested past the interpreter's recursion limit (never a plausible user file)."""


def parse_json(text, where: str):
    """json.loads with every way a user's file can break it one SnapcompileError naming `where`:
    invalid JSON, nesting past the interpreter's recursion limit, integers past its digit limit."""
    import json
    try:
        return json.loads(text)
    except RecursionError:
        raise JsonTooDeep(f"{where} nests too deeply to be a JSON file snapcompile reads") from None
    except json.JSONDecodeError as err:
        raise SnapcompileError(f"{where} is not valid JSON ({err.msg}, line {err.lineno})") from None
    except (ValueError, UnicodeDecodeError) as err:        # e.g. an integer of thousands of digits
        raise SnapcompileError(f"{where} is not valid JSON: {first_line(err)}") from None


def check_text(text: str, where: str) -> str:
    """`text` itself when it is valid Unicode text (no lone surrogate, as bytes that are not UTF-8
    in argv or a \\ud800 escape in JSON produce); else a SnapcompileError naming `where`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SnapcompileError(f"{where} is not valid UTF-8 text (it holds a lone surrogate or undecodable "
                               "bytes)") from None
    return text


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
