"""The MoE layer: routers, experts, virtual experts, training (params, checkpoints, micro-batches), HF equality."""
