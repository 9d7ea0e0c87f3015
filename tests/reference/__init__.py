"""The pure-torch oracles (tritonep.reference) against hand-worked cases and autograd."""
