"""Postmortem of a tape: checkers that name what went wrong, a findings report (JSON, HTML
with a timeline) and a pytest plugin that keeps the tapes of failing tests."""

from tokentape.postmortem.analysis import postmortem
from tokentape.postmortem.findings import BUG_CLASSES, ExcerptEvent, Finding, Report, Summary

__all__ = ["BUG_CLASSES", "ExcerptEvent", "Finding", "Report", "Summary", "postmortem"]
