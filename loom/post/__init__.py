"""Post-training recipes on the one training loop: supervised fine-tuning (chat templates, masked loss,
packing) today."""
