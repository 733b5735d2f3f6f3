"""Online RL (`loom rl`): the recipe (recipe.py: set-up, the RL step, evaluation), its prompts, rollouts,
rewards and policy loss, one file each."""
