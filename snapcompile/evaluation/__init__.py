"""Accuracy evaluation through the compiled artifacts (tasks, runner, report)."""
