"""The baselines that the benchmarks measure in the same run as tokentape.

Two halves that share only JSON:

- the tokentape side (`locate`, `client`, `vllm_serve`, stdlib only): finds the Python that
  runs a baseline and drives its side script as a child process, or runs vLLM's own
  `vllm serve` and `vllm bench serve` there;
- the side scripts (`vllm_generate.py`, `vllm_scheduler.py`, `hf_generate.py`, and
  `vllm_requests.py` for tests/integrations), run by that Python (vLLM's venv, or any
  interpreter with transformers): they never import tokentape, load their engine once, then
  answer one JSON line per command on a private pipe (`sideserver`).

`procstat` (CPU time of any process, by pid) is used by both.
"""
