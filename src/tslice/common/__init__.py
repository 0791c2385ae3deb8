"""Small pieces shared by every layer (ids, errors, logging, task supervision).

Layers (orchestrator, agent, client, workload) share only this package and
``tslice.api``; see the import-linter contract in pyproject.toml.
"""
