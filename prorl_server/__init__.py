"""prorl server: rollouts of multi-turn LLM agents as a gRPC service."""

__version__ = "0.1.0"
