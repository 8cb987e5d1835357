"""`kappa`: conditioning of a data set (dataset) and of a trained transformer's layers (layers)."""
