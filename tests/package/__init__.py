"""The package as a whole: import side effects, TRITONEP_* environment variables."""
