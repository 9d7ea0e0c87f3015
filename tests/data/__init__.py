"""Packaged routing data and users' routing files."""
