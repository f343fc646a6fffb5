"""What one client may cost `serve`: the values (each has a flag; serve/limits.py applies them). No
imports beyond the standard library: the command line reads them for its options."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost `serve` (snapcompile.serve.limits applies them; each has a flag)."""

    max_body_bytes: int = 4 * 2**20      # a 4096-token prompt is < 1.5 MB even JSON-escaped
    body_timeout_s: float = 30.0         # to receive a whole body once its head arrived
    head_timeout_s: float = 10.0         # to receive a request head (from connecting, or the last response)
    keep_alive_s: float = 5.0            # idle time of a kept-alive connection
    max_connections: int = 512           # open connections (and tasks); beyond: 503 from uvicorn
    max_connections_per_client: int = 64     # open connections from one address; beyond: closed at once (0: no bound)
    max_requests_per_client: int = 64        # engine requests in flight from one address; 429 beyond (0: no bound)
    send_timeout_s: float = 30.0         # a response the client stops reading may wait this long, then is dropped
    render_timeout_s: float = 10.0       # to render a chat template (a file of the artifact) or tokenize; 400 beyond
    tokenizer_workers: int = 1           # worker processes per lane (chat templates / plain tokenization)
    max_prompts: int = 32                # prompts in one /v1/completions request (each one engine request)
    forwarded_allow_ips: str = ""        # proxies whose X-Forwarded-For names the client ("": no header believed)


MAX_WAITING = 256    # requests waiting for a slot before `serve` answers 429 (ServerSettings, --max-waiting)
