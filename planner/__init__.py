"""parallel-planner: capture, cost, search and apply parallel layouts for LLM training."""
