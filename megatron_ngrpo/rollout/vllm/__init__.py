"""vLLM rollout backend: the engine, its worker-extension hook, weight transfer, replica spreading, wire checks."""
