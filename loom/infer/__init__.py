"""Inference: the generation engine. engine.py builds it and runs each round as schedule (scheduler.py) -> run
(runner.py) -> postprocess (postprocess.py) over the requests of request.py, and refits; kv.py holds the key/value
slab, paged.py and blocks.py paged key/value memory, sampling.py the per-request sampler, step.py the compiled
decode step, cpu/ the CPU decode path behind one entry point (`cpu_decode`), batch.py the `loom generate` files,
probe.py the engine's measured costs for `loom plan --profile-hardware`."""
