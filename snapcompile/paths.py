"""Where snapcompile keeps what it makes for itself."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where converted built-in models, the measuring tools' artifacts, and the records of verified
    checksums and passed graph checks are kept ($SNAPCOMPILE_CACHE or ~/.cache/snapcompile)."""
    return Path(os.environ.get("SNAPCOMPILE_CACHE", Path.home() / ".cache" / "snapcompile"))
