"""`ntk-distance`: width sweeps against the infinite-width NTK (widths) and kernel movement of trained nets (movement)."""
