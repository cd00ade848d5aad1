"""The RL loop: a step's rollouts and DAPO dynamic sampling (sampling), advantages (advantages),
the training batch (batch), the trainer and its settings (trainer, settings), metrics (progress)."""
