"""`snapcompile serve`: an OpenAI-compatible HTTP server on the continuous-batching engine.

protocol.py (the wire format), completions.py (requests to engine calls, updates from
snapcompile.engine.loop to responses), metrics.py (Prometheus), app.py (routes),
server.py (uvicorn, background loading, graceful drain), bench.py (`bench-serve`, the client)."""
