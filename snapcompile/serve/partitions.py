"""Who shares kept caches: the session-store partition of a request (docs/serving.md, "Who shares kept
caches"). The store never lets one partition resume from, or learn of, another's entries."""
from __future__ import annotations

import hashlib
import hmac

from snapcompile.errors import SnapcompileError

SESSION_SHARING = ("private", "shared")     # what a request with neither a cache_salt nor an API key gets
SERVE_SHARING = ("auto", *SESSION_SHARING)  # serve's choices: auto decides by who can reach the server
MAX_SALT_CHARS = 256


def resolve_sharing(choice: str, loopback: bool, api_key: bool) -> str:
    """serve --session-sharing: "auto" is "shared" for a server only this machine can reach and that
    has no API key (one user's local server, as llama-server runs: a plain chat client gets its
    cache back), else "private"; "private" and "shared" are themselves."""
    if choice != "auto":
        return choice
    return "shared" if loopback and not api_key else "private"


def cache_partition(secret: bytes, cache_salt: str | None, api_key_used: bool, session_sharing: str) -> str | None:
    """Requests with the same cache_salt share (under the same server and API key); without a salt the
    holders of the API key share; without either, nobody does (None: neither resumed nor kept) unless
    session_sharing is "shared". A partition is a keyed hash under `secret` (one per process, never shown),
    so its name tells nothing about the salt."""
    if cache_salt is not None:
        if not isinstance(cache_salt, str) or not 1 <= len(cache_salt) <= MAX_SALT_CHARS:
            raise SnapcompileError(f"cache_salt must be a string of 1 to {MAX_SALT_CHARS} characters")
        material = b"salt\0" + (b"key\0" if api_key_used else b"") + cache_salt.encode("utf-8", "surrogatepass")
    elif api_key_used:
        material = b"api-key"
    elif session_sharing == "shared":
        material = b"shared"
    else:
        return None
    return hmac.new(secret, material, hashlib.sha256).hexdigest()
