"""`vllm-dflash bench`: every speculative method on the same prompts, each in its own engine.

command.py   the subcommand: (concurrency x method) runs one at a time, interleaved
run.py       one run in a process of its own (its own engine, metrics and peak RSS)
runspec.py   what a run is and the numbers every run reports
offline.py   a run through vllm.LLM()
server.py    a run through the OpenAI server and C streaming clients
methods.py   method name -> speculative_config and environment
prompts.py   the prompts file and the requests at each concurrency
counters.py  vLLM's spec-decode counters and the process tree's peak RSS
report.py    ratios to no speculation, greedy equality, JSON, PNG and a markdown table
"""
