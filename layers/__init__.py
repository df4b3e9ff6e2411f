"""The model: layers that know tensors, not requests or Ray."""
