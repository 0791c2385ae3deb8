"""Simulated hardware: a local cluster of real orchestrator and agent processes over
simulated devices (``cluster``), the checker of the devices' journals against what jobs
saw (``checker``), and a fake inference engine speaking vLLM's and SGLang's sleep
dialects (``engine_server``). The simulated devices themselves are the agent's ``sim``
backend."""
