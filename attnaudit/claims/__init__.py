"""`claims`: the paper's claims as hypotheses, each tested by one documented run."""
