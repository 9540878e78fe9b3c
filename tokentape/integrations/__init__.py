"""Recorders for other engines: their runs written as tokentape tapes, so that fold, verify,
postmortem, debug, diff and export work on them as on tokentape's own (`integrations.vllm`)."""
