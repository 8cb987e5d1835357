"""The analyses, one package each; shared parts (influence estimators) are packages of their own."""
