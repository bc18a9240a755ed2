"""GRPO on the CPU against a prorl server: see docs/training.md."""
