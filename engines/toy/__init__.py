"""Tiny models and toy tasks built locally, so everything runs on CPU with no hub download."""
