"""File formats: named tensors plus configuration, nothing model-specific."""
