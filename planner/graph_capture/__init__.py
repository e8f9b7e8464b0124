"""Capture: a model source (built-in, YAML, config.json, `file.py:factory`, nn.Module) traced on the meta
device into a `ModelGraph` with FLOPs, bytes, parameters and saved tensors per layer kind.

    model_sources -> model_config / reference_model -> tracing + graph_analysis + op_costs -> model_capture
"""
