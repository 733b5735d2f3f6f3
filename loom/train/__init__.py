"""Training: the step runners, evaluation, run control, checkpoints and the loop (see trainer.py)."""
