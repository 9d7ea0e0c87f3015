"""Wire formats: quantizers and codecs (Triton == torch twin == independent reference), the registry."""
