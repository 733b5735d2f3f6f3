"""The planner: `loom plan` predicts memory and step time of parallel layouts and ranks them.

hardware.py (presets and measured profiles), costmodel.py (memory and time terms), search.py (the
layouts), inference.py (serving layouts), report.py (table, plot, config), profile.py (calibration).
"""
