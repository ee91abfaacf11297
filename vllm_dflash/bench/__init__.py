"""`vllm-dflash bench`: every speculative method on the same prompts, each in its own engine.

command.py  the subcommand: runs (concurrency x method) one at a time, interleaved
run.py      one method at one concurrency in a subprocess (its own engine, honest peak RSS)
offline.py  that run through vllm.LLM()      server.py  through the OpenAI server + clients
methods.py  method name -> speculative_config and environment
counters.py vLLM's spec-decode counters and the process tree's peak RSS
report.py   ratios to no speculation, greedy equality, JSON, PNG and a markdown table
"""
