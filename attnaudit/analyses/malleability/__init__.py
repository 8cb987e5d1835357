"""`malleability`: how far perturbed training data moves influence rankings."""
