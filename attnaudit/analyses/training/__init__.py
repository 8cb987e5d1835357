"""Training a built-in model into an auditable checkpoint (``attnaudit train``)."""
