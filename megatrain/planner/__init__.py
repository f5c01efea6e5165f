"""The planner: trace -> LayerGraph -> Plan -> Schedule -> verify. Knows nothing of CUDA."""
