"""Reward-model training: Bradley-Terry loss, preference data, the DeepSpeed RM trainer. No Prefect here."""
