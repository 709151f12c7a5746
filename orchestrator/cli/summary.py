"""The closing summary of a training run (it lives in :mod:`orchestrator.runtime.summary`,
shared with the Python API; this module keeps the CLI's import path)."""

from orchestrator.runtime.summary import format_progress, format_summary, summarize

__all__ = ["format_progress", "format_summary", "summarize"]
