"""Virtual-expert load balancing: the planner (reference and minimal modes, one launch), weight transport."""
