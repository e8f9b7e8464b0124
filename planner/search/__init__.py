"""Search: the layout space and its validity rules (space), the bounds of its subtrees (bounds), the
best-first branch and bound over them (tree) and the CP-SAT stage partition at its leaves (partition)."""
