"""Models to audit: built-in reference nets, ViTs, and loaders for trained checkpoints (attnaudit, Hugging Face, user factories)."""
