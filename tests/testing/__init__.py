"""The test machinery itself (tritonep.testing): CPU and GPU worlds, the protocol recorder, interrupts, the harness."""
