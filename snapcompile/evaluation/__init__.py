"""Accuracy evaluation through the compiled artifacts.

config (what runs), tasks (the cases), retrieval / fidelity (how each kind runs), metrics (per-case
measures), store (resumable records), runner (run_eval), report (tables and plots)."""
