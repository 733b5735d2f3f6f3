"""Inference: the generation engine. engine.py schedules (schedule -> run -> postprocess) and refits; kv.py holds
the key/value slab, sampling.py the per-request sampler, step.py the compiled decode step, cpu/ the CPU decode
path behind one entry point (`cpu_decode`), batch.py the `loom generate` files, probe.py the engine's measured
costs for `loom plan --profile-hardware`."""
