"""The host launch path shared by both backends: bound launches (binding once, packed launch, the C entry),
the output pool, field views, host status and the launch recorder."""
