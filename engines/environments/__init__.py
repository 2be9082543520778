"""Multi-turn environments: the contract (base.py) and the built-in and adapted environments."""
