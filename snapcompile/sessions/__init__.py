"""The conversation store: finished sequences' caches kept in host memory (`store.py`, `kept.py`),
what each `--session-keep` mode keeps of them (`keepers.py`), and the row forms they hold
(`dropped.py`, `summaries.py`, `kv_quant.py`). Host arrays only; the backend hands rows in and out."""
