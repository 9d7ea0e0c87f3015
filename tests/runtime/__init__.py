"""The host launch path: bound and packed launches, the launch cache, the interpreter patch."""
