"""The README and docs/ name what the code has; the examples run and check themselves."""
