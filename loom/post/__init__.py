"""Post-training recipes on the one training loop: supervised fine-tuning (chat templates, masked loss,
packing), reward models and DPO / IPO (pref.py), and the loss library of preference and RL training (losses.py)."""
