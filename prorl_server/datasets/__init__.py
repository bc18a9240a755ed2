"""Loaders that turn task data shipped in PyPI packages into `prorl run` task lines."""
