"""`alignment`: target alignment of the attention kernel."""
