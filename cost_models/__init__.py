"""Analytical cost models: communication, compute, memory, pipeline schedules, step time, reliability."""
