"""`atomflow-bench validate`: the engine, probe by probe, against HuggingFace transformers in float32.

truth (the HF reference and its storage) -> probes (the engine side) -> metrics -> check (validate, quality) ->
report (the tables). What is compared, the thresholds and why, and how to regenerate the truth: docs/VALIDATION.md.
"""
from .check import prepare_truth, quality, validate
from .report import print_quality, print_result

__all__ = ["prepare_truth", "print_quality", "print_result", "quality", "validate"]
