"""Influence estimators (a shared part of the analyses): exact, CG, LiSSA, K-FAC/EK-FAC, projected."""
