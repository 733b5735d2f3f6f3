"""The planner: `loom plan` predicts memory and step time of parallel layouts and ranks them.

hardware.py (presets and measured profiles); the cost model of a training layout: workload.py (what is
priced: workload, layout, estimate), params.py (parameter counts), kernels.py (GEMM, collective, memory
traffic times), layertime.py (one layer and the LM head), stages.py (what a pipeline rank holds), memory.py
(memory per GPU), steptime.py (step time and the estimate); search.py (the layouts), inference.py (serving
layouts), report.py (table, plot, config), published.py and validation.py (published runs), profile.py (calibration),
command.py (`loom plan`).
"""
