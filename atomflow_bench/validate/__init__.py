from .check import prepare_truth, print_quality, print_result, quality, validate  # the commands' entry points

__all__ = ["prepare_truth", "print_quality", "print_result", "quality", "validate"]
