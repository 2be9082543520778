"""Scripts that run INSIDE TRL's own venvs (bench/.venvs/trl-*), plus what they share with the ppoflow side."""
