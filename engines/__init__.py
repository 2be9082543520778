"""Compute for ppoflow: rollout engines, scoring, the DeepSpeed trainer and the PPO math.

Importable and testable without Prefect: nothing under engines/ imports prefect.
"""
